"""Whole-layer compaction with the KV heads batched and the full cache's logits computed once.

The path :func:`~.api.compact_layer` takes for ``selection="attention"`` and the methods
``am``, ``fold``, ``drop``, ``drop_refit`` and ``rank1``. It solves the same problems as
:func:`~.api.compact_head` (the per-head path, kept as the reference), with less work:

* one product ``q k^T`` [n, T] per head, in float32, into one reused workspace, gives the full
  cache's max-shifted exponentials, and from them, without another pass over the T keys: the
  target outputs ``softmax @ V``, the RMS selection scores and the partition functions ``Z``.
  The per-head path computes those logits three times, once of them in float64;
* the kept keys' logits [n, t] are computed once, in float64, and give the bias fit's design
  and (with the fitted bias) AM's value-refit weights;
* the bias fit is one batched active-set solve over the heads (:func:`~.solvers.bounded_lstsq`),
  the fold directions one batched solve, the value refits one batched Cholesky factorisation.

The only numerical difference to the per-head path is ``Z`` from float32 logits (relative
error about 1e-6; the per-head path takes them in float64): kept positions are the same, beta
and values agree to about 1e-5 relative (``tests/test_compaction_batched.py`` checks both paths
against each other). Runs on the tensors' device (CPU or CUDA).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .common import default_scale
from .config import CompactionConfig
from .fold import fold_keys
from .select import coverage_scores, guarded_top_t, question_scores, guard_slots
from .solvers import bounded_lstsq
from .values import refit_weights as refit_batched

BATCHED_METHODS = ("am", "fold", "drop", "drop_refit", "rank1")


def supports(config: CompactionConfig) -> bool:
    """Whether :func:`compact_layer_batched` implements ``config`` (else the per-head path)."""
    return config.selection == "attention" and config.method in BATCHED_METHODS


def subsample_rows(q: torch.Tensor, max_queries: int, seed: int) -> torch.Tensor:
    """``q`` [H, n, D] with at most ``max_queries`` rows per head: the rows
    :func:`~.api.subsample_queries` draws, the same for every head."""
    n = q.shape[1]
    if n <= max_queries:
        return q
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(n, generator=gen)[:max_queries].sort().values
    return q[:, rows.to(q.device)]


def full_pass(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, scale: float,
              out: torch.Tensor | None = None):
    """What every method needs from the full cache of one head, from one product ``q k^T``.

    Parameters
    ----------
    k : Tensor [T, D], float32
    v : Tensor [T, Dv], float32
    q : Tensor [n, D], float32
    scale : float
    out : Tensor [n, T], float32, optional
        Workspace (overwritten). Reusing one across heads matters on the CPU: a fresh
        [4096, 4096] buffer cost 50 ms of page faults per head, more than the exponentials.

    Returns
    -------
    target : Tensor [n, Dv], float32
        ``softmax(q k^T scale) @ v``.
    scores : Tensor [T], float32
        RMS over the queries of each key's softmax weight (:func:`~.select.attention_scores`).
    z : Tensor [n], float64
        ``sum_i exp(l_ji - m_j)``.
    shift : Tensor [n], float64
        ``m_j``, the largest logit of query j.
    """
    w = torch.mm(q, k.T, out=out).mul_(scale)  # [n, T] logits
    shift = w.amax(dim=1)  # [n]
    w.sub_(shift[:, None]).exp_()  # [n, T], in (0, 1]
    z = w.sum(dim=1)  # [n]; pairwise float32 sum of T terms in [0, 1], relative error ~1e-7
    w.div_(z[:, None])  # [n, T] softmax weights
    target = w @ v  # [n, Dv]
    ones = w.new_ones(w.shape[0])
    scores = (ones @ w.mul_(w)).div_(w.shape[0]).sqrt_()  # [T]; a product: sum(0) is slower
    return target, scores, z.to(torch.float64), shift.to(torch.float64)


def fold_directions(q: torch.Tensor, fold_lambda: float) -> torch.Tensor:
    """:func:`~.fold.fold_direction` of every head at once: q [H, n, D] -> u [H, D] float32."""
    x = q.to(torch.float64)
    mu = x.mean(dim=1)  # [H, D]
    xc = x - mu[:, None, :]
    sigma = xc.transpose(1, 2) @ xc / x.shape[1]  # [H, D, D]
    d = mu.shape[1]
    tr = sigma.diagonal(dim1=1, dim2=2).sum(dim=1)  # [H]
    mu2 = (mu * mu).sum(dim=1)  # [H]
    if bool((mu2 == 0).any()):
        raise ValueError("fold_direction: the context queries have zero mean; u is undefined")
    lam = torch.maximum(fold_lambda * tr / d, 1e-12 * (tr + mu2) / d)  # [H]
    eye = torch.eye(d, dtype=torch.float64, device=q.device)
    sol = torch.linalg.solve(sigma + lam[:, None, None] * eye, mu[..., None])[..., 0]  # [H, D]
    return (sol / (mu * sol).sum(dim=1, keepdim=True)).to(torch.float32)


class _Clock:
    """Adds the seconds since the last mark to ``timings[stage]`` (no-op without a dict)."""

    def __init__(self, timings: dict | None) -> None:
        self.timings, self.last = timings, time.perf_counter()

    def __call__(self, stage: str) -> None:
        if self.timings is not None:
            now = time.perf_counter()
            self.timings[stage] = self.timings.get(stage, 0.0) + now - self.last
            self.last = now


@dataclass(frozen=True)
class LayerFit:
    """What every budget and method of one layer shares (:func:`prepare_layer`).

    Attributes
    ----------
    keys, values : Tensor [H, T, D], [H, T, Dv], float32
    queries : Tensor [H, n, D], float32 (subsampled)
    target : Tensor [H, n, Dv], float32
        Full-cache outputs of the queries.
    scores : Tensor [H, T], float32
        RMS attention weight of each key.
    z, shift : Tensor [H, n], float64
        Partition functions and largest logits of the full cache.
    scale : float
    question : Tensor [H, T], float32, or None
        Largest softmax weight of each key over the question's rows
        (:func:`~.select.question_scores`); None without questions.
    coverage : Tensor [H, T], float32, or None
        Ridge leverage of each key (:func:`~.select.coverage_scores`); None when
        ``coverage_share`` is 0.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    target: torch.Tensor
    scores: torch.Tensor
    z: torch.Tensor
    shift: torch.Tensor
    scale: float
    question: torch.Tensor | None = None
    coverage: torch.Tensor | None = None


def question_pass(k: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`~.select.question_scores` of every head: k [H, T, D], q [H, m, D] -> [H, T] float32
    (one head at a time: m can reach the query cap, and [m, T] is the full pass's size)."""
    return torch.stack([question_scores(k[h], q[h], scale=scale) for h in range(k.shape[0])])


def prepare_layer(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor,
                  config: CompactionConfig, scale: float | None = None, *,
                  question: torch.Tensor | None = None) -> LayerFit:
    """The full-cache pass of every head of a layer: keys [H, T, D], values [H, T, Dv],
    queries [H, n, D] (subsampled to ``config.max_queries``); ``question`` [H, m, D]: the
    question's rows (also among ``queries``), scored for the guard of :mod:`~.select`."""
    s = default_scale(keys.shape[2], scale)
    k, v = keys.detach().to(torch.float32), values.detach().to(torch.float32)
    q = subsample_rows(queries.detach().to(torch.float32), config.max_queries, config.seed)
    work = torch.empty(q.shape[1], k.shape[1], dtype=torch.float32, device=k.device)  # [n, T]
    parts = [full_pass(k[h], v[h], q[h], s, out=work) for h in range(k.shape[0])]
    stack = [torch.stack([p[i] for p in parts]) for i in range(4)]
    guard = None
    if question is not None and config.question_share > 0:
        guard = question_pass(k, question.detach().to(device=k.device, dtype=torch.float32), s)
    cover = coverage_scores(k) if config.coverage_share > 0 else None
    return LayerFit(keys=k, values=v, queries=q, target=stack[0], scores=stack[1], z=stack[2],
                    shift=stack[3], scale=s, question=guard, coverage=cover)


def compact_prepared(fit: LayerFit, t: int, methods: tuple[str, ...], config: CompactionConfig,
                     timings: dict | None = None) -> dict[str, dict]:
    """Compact a prepared layer to t entries with each of ``methods``, sharing their fits.

    ``am``, ``fold``, ``drop`` and ``rank1`` share the selection and the bias fit; ``am``,
    ``drop`` and ``rank1`` also AM's values; ``drop_refit`` shares the selection. Each method's
    result is what :func:`compact_layer_batched` gives for it alone.

    Returns
    -------
    dict method -> dict of :class:`~.api.CompactedLayer` fields (see
    :func:`compact_layer_batched`).
    """
    bad = [m for m in methods if m not in BATCHED_METHODS]
    if bad or not methods or config.selection != "attention":
        raise ValueError(f"batched compaction: methods {methods!r}, selection={config.selection!r}: "
                         f"allowed a non-empty subset of {BATCHED_METHODS} with selection 'attention'")
    clock = _Clock(timings)
    k, q, s, target = fit.keys, fit.queries, fit.scale, fit.target
    heads, d = k.shape[0], k.shape[2]
    guards = [(fit.question, guard_slots(t, config.question_share)),
              (fit.coverage, guard_slots(t, config.coverage_share))]
    idx = guarded_top_t(fit.scores, guards, t).to(k.device)  # [H, t]
    clock("select")
    kept = k.gather(1, idx[..., None].expand(-1, -1, d))  # [H, t, D]
    anchor = fit.values.gather(1, idx[..., None].expand(-1, -1, fit.values.shape[2]))  # [H, t, Dv]
    pull = {"anchor": anchor, "anchor_weight": config.value_anchor}
    q64 = q.to(torch.float64)
    lk = (q64 @ kept.to(torch.float64).transpose(1, 2)).mul_(s)  # [H, n, t] kept logits
    base = {"indices": idx, "beta": None, "u": None, "fitted_bias": None}
    out: dict[str, dict] = {}
    if "drop_refit" in methods:
        clock("design")
        out["drop_refit"] = {**base, "keys": kept,
                             "values": refit_batched(torch.softmax(lk, dim=-1), target, config.ridge, **pull)}
        clock("values")
    if all(m == "drop_refit" for m in methods):
        return out
    a = (lk - fit.shift[..., None]).exp_().div_(fit.z[..., None])  # [H, n, t] design, rows / Z_j
    clock("design")
    lo, hi = math.exp(config.beta_min), math.exp(config.beta_max)
    ones = torch.ones(a.shape[:2], dtype=torch.float64, device=a.device)  # [H, n]
    start = torch.ones(heads, t, dtype=torch.float64, device=a.device)  # beta = 0
    w = bounded_lstsq(a, ones, lo, hi, x0=start)  # [H, t]
    del a
    beta = torch.log(w).to(torch.float32).clamp(config.beta_min, config.beta_max)  # [H, t]
    base["fitted_bias"] = beta
    clock("bias")
    if "fold" in methods:
        u = fold_directions(q, config.fold_lambda)  # [H, D]
        folded = torch.stack([fold_keys(kept[h], beta[h], u[h], scale=s, round_dtype=config.round_dtype)
                              for h in range(heads)])  # [H, t, D]
        lf = (q64 @ folded.to(torch.float64).transpose(1, 2)).mul_(s)  # [H, n, t]
        clock("fold")
        out["fold"] = {**base, "keys": folded, "u": u,
                       "values": refit_batched(torch.softmax(lf, dim=-1), target, config.ridge, **pull)}
        clock("values")
    if any(m in ("am", "drop", "rank1") for m in methods):
        vals = refit_batched(torch.softmax(lk + beta.to(torch.float64)[:, None, :], dim=-1),
                             target, config.ridge, **pull)  # [H, t, Dv]
        clock("values")
        out["am"] = {**base, "keys": kept, "values": vals, "beta": beta}
        out["drop"] = {**base, "keys": kept, "values": vals}
        # q' = [q, 1/scale] reads k' = [k, beta] (see .rank1)
        out["rank1"] = {**base, "keys": torch.cat([kept, beta[..., None]], dim=-1), "values": vals}
    return {m: out[m] for m in methods}


def compact_layer_batched(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor,
                          t: int, config: CompactionConfig, scale: float | None = None, *,
                          timings: dict | None = None, question: torch.Tensor | None = None) -> dict:
    """Compact every KV head of one layer (module docstring); inputs checked by the caller.

    Parameters
    ----------
    keys : Tensor [H, T, D]
    values : Tensor [H, T, Dv]
    queries : Tensor [H, n, D]
        Pooled over the GQA group; subsampled to ``config.max_queries``.
    t : int
        1 <= t <= T.
    config : CompactionConfig
        ``supports(config)`` must hold.
    scale : float, optional
    timings : dict, optional
        Seconds per stage are added to it: ``full`` (the [n, T] pass), ``select``, ``design``
        (kept logits and design), ``bias`` (the solve), ``fold``, ``values`` (refits).
    question : Tensor [H, m, D], optional
        The question's query rows (:func:`prepare_layer`).

    Returns
    -------
    dict with ``keys`` [H, t, D or D+1], ``values`` [H, t, Dv], ``beta`` [H, t] or None,
    ``indices`` [H, t] int64, ``u`` [H, D] or None, ``fitted_bias`` [H, t] or None
    (float32; the fields of :class:`~.api.CompactedLayer`).
    """
    if not supports(config):
        raise ValueError(f"batched compaction: method={config.method!r}, selection="
                         f"{config.selection!r}: allowed methods {BATCHED_METHODS} with "
                         "selection 'attention'")
    clock = _Clock(timings)
    fit = prepare_layer(keys, values, queries, config, scale, question=question)
    clock("full")
    return compact_prepared(fit, t, (config.method,), config, timings)[config.method]


__all__ = ["BATCHED_METHODS", "LayerFit", "compact_layer_batched", "compact_prepared",
           "fold_directions", "full_pass", "prepare_layer", "question_pass", "refit_batched", "subsample_rows",
           "supports"]
