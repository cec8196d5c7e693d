"""The measurements of the compaction study, as small pure functions (one head, one record).

Definitions (used in the code, the report and ``docs/compaction.md``):

* output error of a compacted head on queries ``Q [n, D]``: the compacted cache's attention
  output over its t entries against the full cache's over the T prefix tokens (both normalised
  over the prefix alone), ``err = mean_j ||o_c(q_j) - o_f(q_j)|| / mean_j ||o_f(q_j)||``;
* fold/AM error ratio: ``err(fold) / err(am)`` of one (record, ratio, layer, head);
* the paper's bound: ``||o_fold(q) - o_am(q)|| <= (b_max - b_min)/4 * D_V * |q . u - 1|``
  (``(3/2) D_V |q . u - 1|`` for beta in [-3, 3]), D_V the largest distance between two of
  AM's compacted values, checked per query;
* KL: ``KL(p_full || p_method)`` of the next-token distributions over the answer positions
  (teacher-forced on full's greedy answer), averaged over the positions.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlocks_lab.eval.metrics import kl_divergence

from kvlocks.compaction.api import CompactedHead
from kvlocks.compaction.fold import fold_error_bound, fold_keys, query_alignment
from kvlocks.compaction.rank1 import augment_queries
from kvlocks.compaction.values import exact_attention


def output_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Relative output error and the reference's mean norm.

    Parameters
    ----------
    out, ref : Tensor [n, Dv]
        Compacted and full-cache attention outputs of the same n queries (n >= 1).

    Returns
    -------
    err : float
        ``mean_j ||out_j - ref_j|| / mean_j ||ref_j||`` (0 when both are all zero).
    norm : float
        ``mean_j ||ref_j||``: ``err * norm`` is the absolute mean error.
    """
    if out.shape != ref.shape or out.dim() != 2 or out.shape[0] == 0:
        raise ValueError(f"out {tuple(out.shape)} and ref {tuple(ref.shape)} must both be [n >= 1, Dv]")
    diff = (out.float() - ref.float()).norm(dim=-1).mean()
    norm = ref.float().norm(dim=-1).mean()
    if float(norm) == 0.0:
        return (0.0 if float(diff) == 0.0 else float("inf")), 0.0
    return float(diff / norm), float(norm)


def served_output(head: CompactedHead, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention output ``[n, Dv]`` of queries ``q [n, D]`` over a compacted head, as served.

    ``am`` adds beta to the logits; ``rank1`` reads its D+1 keys with augmented queries
    ``[q, 1/scale]`` at the original scale; every other method is a plain head.
    """
    if head.method == "rank1":
        out, _ = exact_attention(augment_queries(q, scale=scale), head.keys, head.values,
                                 scale=scale)
        return out
    out, _ = exact_attention(q, head.keys, head.values, scale=scale, bias=head.beta)
    return out


def bound_check(q: torch.Tensor, am: CompactedHead, fold: CompactedHead, scale: float, *,
                beta_min: float = -3.0, beta_max: float = 3.0, round_dtype: str = "float32",
                atol: float = 1e-5) -> dict[str, object]:
    """The paper's bound ``(b_max - b_min)/4 * D_V * |q . u - 1|`` against measured distances.

    Two fold outputs are compared with AM's output ``o_am(q)``:

    * ``exact``: AM's keys folded along the fold's u without rounding, read with AM's values
      and no bias: the setting the bound is proved for (it must hold up to ``atol``);
    * ``deployed``: the fold as served (keys rounded to ``round_dtype`` by the compaction,
      values refit without bias): what the study measures.

    Parameters
    ----------
    q : Tensor [n, D]
    am, fold : CompactedHead
        The ``am`` and ``fold`` compactions of the same head (same selected keys and beta).
    scale : float
    beta_min, beta_max : float
        The bias box of the fit.
    round_dtype : str
        Rounding of the ``exact`` fold's keys (``"float32"``: none).
    atol : float
        Slack for float32 rounding in the ``exact`` check.

    Returns
    -------
    dict with ``bound`` [n], ``exact`` [n] and ``deployed`` [n] distances (float32 tensors),
    ``qu`` [n] (``q . u``), and the counts ``exact_holds``, ``deployed_holds`` and ``n``.
    """
    if am.method != "am" or fold.method != "fold" or fold.u is None:
        raise ValueError(f"bound_check needs an 'am' and a 'fold' head, got {am.method!r} and "
                         f"{fold.method!r}")
    o_am = served_output(am, q, scale)  # [n, Dv]
    bound = fold_error_bound(q, fold.u, am.values, beta_min=beta_min, beta_max=beta_max)  # [n]
    exact_keys = fold_keys(am.keys, am.beta, fold.u, scale=scale, round_dtype=round_dtype)
    o_exact, _ = exact_attention(q, exact_keys, am.values, scale=scale)
    d_exact = (o_exact - o_am).norm(dim=-1)  # [n]
    d_dep = (served_output(fold, q, scale) - o_am).norm(dim=-1)  # [n]
    return {"bound": bound, "exact": d_exact, "deployed": d_dep,
            "qu": query_alignment(q, fold.u),
            "exact_holds": int((d_exact <= bound + atol).sum()),
            "deployed_holds": int((d_dep <= bound).sum()), "n": int(q.shape[0])}


def answer_kl(logp_full: torch.Tensor, logp_method: torch.Tensor) -> float:
    """Mean over answer positions of ``KL(p_full || p_method)`` (nats).

    Parameters
    ----------
    logp_full, logp_method : Tensor [m, V]
        Next-token log-probabilities (or logits) at the m answer positions, m >= 1.
    """
    if logp_full.dim() != 2 or logp_full.shape[0] == 0:
        raise ValueError(f"logp_full must be [m >= 1, V], got {tuple(logp_full.shape)}")
    return float(kl_divergence(logp_full, logp_method).mean())


def median_ratio(num, den) -> float | None:
    """Median of ``num_i / den_i`` over pairs with a finite ratio (None if there are none).

    Pairs with ``den_i == 0`` are skipped (both errors zero: nothing was lost).
    """
    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"num {a.shape} and den {b.shape} must have the same shape")
    ok = (b > 0) & np.isfinite(a) & np.isfinite(b)
    return float(np.median(a[ok] / b[ok])) if ok.any() else None


def excess_share(excess, top: float = 0.1) -> float | None:
    """Share of the total positive excess carried by the worst ``top`` fraction of cases.

    Parameters
    ----------
    excess : array-like [N]
        Per-case excess error (e.g. fold minus AM absolute error); negatives count as 0.
    top : float
        Fraction in (0, 1]; the worst ``ceil(top * N)`` cases are taken.

    Returns
    -------
    float in [0, 1], or None when no case has a positive excess.
    """
    if not 0.0 < top <= 1.0:
        raise ValueError(f"top={top!r}: must be in (0, 1]")
    x = np.clip(np.asarray(excess, dtype=np.float64).ravel(), 0.0, None)
    total = x.sum()
    if x.size == 0 or total <= 0:
        return None
    k = int(np.ceil(top * x.size))
    return float(np.sort(x)[::-1][:k].sum() / total)


def quantiles(x, qs=(0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)) -> dict[str, float] | None:
    """``{"q01": ..., "q50": ..., "mean": ..., "mean_abs": ...}`` of a sample (None if empty)."""
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size == 0:
        return None
    out = {f"q{round(100 * q):02d}": float(np.quantile(a, q)) for q in qs}
    out.update(mean=float(a.mean()), mean_abs=float(np.abs(a).mean()), n=int(a.size))
    return out
