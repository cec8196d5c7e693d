"""Key selection for AM compaction: which t of a head's T keys to keep.

Two rules, both deterministic and both returning sorted ascending positions:

* ``"attention"``: score each key by the root-mean-square, over the reference queries, of its
  softmax weight under the full cache, and keep the t best. RMS (not mean) favours keys that
  some queries attend to strongly over keys every query touches a little.
* ``"omp"``: greedy non-negative orthogonal matching pursuit on the partition functions. With
  the row-scaled mass matrix ``A_rel[j, i] = exp(l_ji - m_j) / Z_j`` (rows sum to 1; see
  :mod:`.bias`), the goal is weights ``w >= 0`` on few columns with ``A_rel w ~ 1``. Each step
  picks the unchosen column most correlated with the residual (correlation divided by the
  column norm), then refits all chosen weights by NNLS and recomputes the residual. This
  targets the bias fit directly: it prefers keys whose exp-logit columns, once re-weighted,
  explain every query's total mass. It costs t small NNLS solves (on the Gram matrix of the
  chosen columns, grown by one row per step, each warm-started from the previous weights) and
  t correlation passes over all T columns; use it for studies at moderate t, and
  ``"attention"`` at scale.

Questions known when compacting (``kvlocks compact --question``) add a guard to ``"attention"``:
their rows and their answer's rows are a few dozen among thousands of reference queries, so
RMS over all of them can rank a key that only those rows attend to (a planted fact the answer
copies, read by a few heads for a few rows) below keys with broad mass. The guard reserves
``g = guard_slots(t, share)`` of a head's t slots for the keys with the largest *max*
softmax weight over the question's rows (:func:`question_scores`); the other t - g go to the
best RMS scores among the rest (:func:`guarded_top_t`). Without question rows, or with share
0, the selection is the plain top t.

A second guard needs no question: ``coverage_share`` of the slots go to the keys of largest
ridge leverage in key space (:func:`coverage_scores`), the keys a later query can single out
whatever the reference queries read (a planted fact; docs/compaction.md, "Keys no reference
query reads"). Guards take their slots first (question first), then RMS fills the rest.
"""

from __future__ import annotations

import math

import torch

from .bias import mass_design, partition_targets
from .solvers import box_qp
from .values import attention_weights


def attention_scores(keys: torch.Tensor, q: torch.Tensor, *, scale: float | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """RMS over reference queries of each key's softmax weight under the full cache.

    Parameters
    ----------
    keys : Tensor [T, D]
    q : Tensor [n, D]
    scale : float, optional
        Default ``1/sqrt(D)``.
    bias : Tensor [T], optional
        Per-key logit bias of the cache being scored (e.g. log-counts of merged keys).

    Returns
    -------
    Tensor [T], float32
    """
    w = attention_weights(q, keys, scale=scale, bias=bias)  # [n, T] fp32
    return w.mul_(w).mean(dim=0).sqrt()  # in place: w is [n, T]


def top_t(scores: torch.Tensor, t: int) -> torch.Tensor:
    """Positions of the t largest scores, sorted ascending; ties go to the lower position.

    Parameters
    ----------
    scores : Tensor [T]
    t : int
        1 <= t <= T.

    Returns
    -------
    Tensor [t], int64
    """
    n = scores.shape[0]
    if not 1 <= t <= n:
        raise ValueError(f"t={t}: must satisfy 1 <= t <= T={n}")
    s = scores.detach().to(torch.float64).cpu()
    order = torch.sort(-s, stable=True).indices  # score desc; stable: ties keep position order
    return order[:t].sort().values.to(torch.int64)


def question_scores(keys: torch.Tensor, q: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Largest softmax weight of each key over the question's rows, under the full cache.

    Parameters
    ----------
    keys : Tensor [T, D]
    q : Tensor [m, D]
        The question's (and its answer's) query rows; m >= 1.
    scale : float, optional

    Returns
    -------
    Tensor [T], float32
    """
    return attention_weights(q, keys, scale=scale).amax(dim=0)


def coverage_scores(keys: torch.Tensor, ridge: float = 1e-3) -> torch.Tensor:
    """Ridge leverage of each key among its head's keys: keys [..., T, D] -> [..., T] float32,
    ``k~_i^T (K~^T K~ + lam I)^{-1} k~_i`` with ``k~ = k - mean(k)`` and
    ``lam = ridge * tr(K~^T K~) / D`` (ridge > 0); in [0, 1), summing to at most D."""
    if not ridge > 0:
        raise ValueError(f"ridge={ridge!r}: must be > 0")
    k = keys.detach().to(torch.float64)
    kc = k - k.mean(dim=-2, keepdim=True)
    gram = kc.transpose(-1, -2) @ kc  # [..., D, D]
    lam = ridge * gram.diagonal(dim1=-2, dim2=-1).sum(-1) / gram.shape[-1] + torch.finfo(torch.float64).tiny
    eye = torch.eye(gram.shape[-1], dtype=torch.float64, device=k.device)
    sol = torch.linalg.solve(gram + lam[..., None, None] * eye, kc.transpose(-1, -2))  # [..., D, T]
    return (kc * sol.transpose(-1, -2)).sum(-1).to(torch.float32)


def guard_slots(t: int, share: float) -> int:
    """Slots of t reserved for a guard (question or coverage): ``min(t, round(share * t))``."""
    return min(t, round(share * t))


def guarded_top_t(scores: torch.Tensor, guards, t: int) -> torch.Tensor:
    """Top t of every head with each guard's best keys kept first (module docstring):
    scores [H, T]; guards, in priority order, ``(guard scores [H, T] or None, g)``, each taking
    its g best keys among those no earlier guard took (the g sum to at most t <= T). Returns
    [H, t] int64, rows ascending; ties go to the lower position."""
    guards = [(x, g) for x, g in guards if x is not None and g > 0]
    total = sum(g for _, g in guards)
    if any(g < 0 for _, g in guards) or total > t:
        raise ValueError(f"guard slots {[g for _, g in guards]}: must be >= 0 and sum to <= t={t}")
    s = scores.detach().to(torch.float64).cpu()
    if guards:
        s = s.clone()
    for guard, g in guards:
        if guard.shape != scores.shape:
            raise ValueError(f"guard shape {tuple(guard.shape)} must match scores {tuple(scores.shape)}")
        u = guard.detach().to(torch.float64).cpu().masked_fill(s == math.inf, -math.inf)  # taken ones last
        order = torch.sort(-u, dim=-1, stable=True).indices
        s.scatter_(-1, order[:, :g], math.inf)  # the guarded keys win every comparison
    return torch.stack([top_t(s[h], t) for h in range(s.shape[0])])


def select_attention(keys: torch.Tensor, q: torch.Tensor, t: int, *,
                     scale: float | None = None, question: torch.Tensor | None = None,
                     question_share: float = 0.0, coverage_share: float = 0.0) -> torch.Tensor:
    """Keep the t keys with the largest RMS attention weight (see :func:`attention_scores`),
    ``guard_slots(t, question_share)`` of them guarded for the question and
    ``guard_slots(t, coverage_share)`` for the keys of largest leverage (module docstring).

    Parameters
    ----------
    keys : Tensor [T, D]
    q : Tensor [n, D]
    t : int
        1 <= t <= T.
    scale : float, optional
    question : Tensor [m, D], optional
        The question's query rows (also among ``q``); None: no guard.
    question_share, coverage_share : float
        Shares of t guarded, in [0, 1], summing to at most 1.

    Returns
    -------
    Tensor [t], int64, sorted ascending.
    """
    scores = attention_scores(keys, q, scale=scale)
    guards = []
    if question is not None and question_share > 0:
        guards.append((question_scores(keys, question, scale=scale)[None], guard_slots(t, question_share)))
    if coverage_share > 0:
        guards.append((coverage_scores(keys)[None], guard_slots(t, coverage_share)))
    return guarded_top_t(scores[None], guards, t)[0]


def select_omp(keys: torch.Tensor, q: torch.Tensor, t: int, *,
               scale: float | None = None) -> torch.Tensor:
    """Greedy non-negative OMP on the row-scaled partition functions (module docstring).

    Parameters
    ----------
    keys : Tensor [T, D]
    q : Tensor [n, D]
    t : int
        1 <= t <= T.
    scale : float, optional

    Returns
    -------
    Tensor [t], int64, sorted ascending. Ties in the greedy step (correlations within a
    relative 1e-9) go to the lower position; columns that underflow to all zeros are taken
    only once nothing else is left.
    """
    num = keys.shape[0]
    if not 1 <= t <= num:
        raise ValueError(f"t={t}: must satisfy 1 <= t <= T={num}")
    z, shift = partition_targets(keys, q, scale=scale)
    a = mass_design(keys, q, shift, scale=scale).div_(z[:, None])  # [n, T] float64
    norms = torch.linalg.vector_norm(a, dim=0)  # [T]
    safe = torch.where(norms > 0, norms, 1.0)
    resid = torch.ones(a.shape[0], dtype=torch.float64)  # [n]
    free = torch.ones(num, dtype=torch.bool)
    cols = torch.empty(a.shape[0], t, dtype=torch.float64)  # chosen columns, in pick order
    gram = torch.empty(t, t, dtype=torch.float64)  # their Gram matrix
    rhs = torch.empty(t, dtype=torch.float64)  # their sums (A_s^T 1)
    w = torch.empty(0, dtype=torch.float64)
    chosen: list[int] = []
    for s in range(t):
        corr = torch.where(norms > 0, (a.T @ resid) / safe, -math.inf)  # [T]
        cand = free.nonzero().flatten()  # ascending, so the first hit is the lower position
        c = corr[cand]
        best = float(c.max())
        # identical columns can differ in the last bits (BLAS blocking); treat them as ties
        near = (c >= best - 1e-9 * abs(best)).nonzero() if math.isfinite(best) else [[0]]
        pick = int(cand[int(near[0][0])])
        chosen.append(pick)
        free[pick] = False
        col = a[:, pick]  # [n]
        cols[:, s] = col
        row = col @ cols[:, : s + 1]  # [s + 1]
        gram[s, : s + 1] = row
        gram[: s + 1, s] = row
        rhs[s] = col.sum()
        start = torch.cat([w, w.new_zeros(1)])[None]  # previous weights, the new one at 0
        w = box_qp(gram[None, : s + 1, : s + 1], rhs[None, : s + 1], 0.0, math.inf, x0=start)[0][0]
        resid = 1.0 - cols[:, : s + 1] @ w  # [n]
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def select_keys(keys: torch.Tensor, q: torch.Tensor, t: int, *, rule: str = "attention",
                scale: float | None = None, question: torch.Tensor | None = None,
                question_share: float = 0.0, coverage_share: float = 0.0) -> torch.Tensor:
    """Dispatch to :func:`select_attention` (``rule="attention"``, with its guards) or
    :func:`select_omp` (which scores the question's rows among the others, without guards)."""
    if rule == "attention":
        return select_attention(keys, q, t, scale=scale, question=question, question_share=question_share,
                                coverage_share=coverage_share)
    if rule == "omp":
        return select_omp(keys, q, t, scale=scale)
    raise ValueError(f"rule={rule!r}: allowed ('attention', 'omp')")
