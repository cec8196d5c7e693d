"""Compact one KV head with several methods and ratios, sharing the fits they have in common.

``am``, ``fold``, ``drop`` and ``rank1`` all start from the same selected keys and the same
fitted beta, and ``drop``/``rank1`` also reuse AM's values; ``drop_refit`` shares the
selection. Across ratios, the full cache's outputs on the reference queries and the keys'
selection scores do not change. :func:`prepare_head` computes those once per head;
:func:`compact_methods` then runs each shared step once per ratio and builds every method's
:class:`~.api.CompactedHead` with the very operations :func:`~.api.compact_head` uses (a test
checks they are equal). It also returns each method's own compaction time as if run alone
(the preparation plus its shared and own steps), so ``compact_s`` stays comparable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvlocks.compaction.common import default_scale
from kvlocks.compaction.api import CompactedHead, compact_head, subsample_queries
from kvlocks.compaction.bias import fit_bias
from kvlocks.compaction.config import METHODS, CompactionConfig
from kvlocks.compaction.fold import fold_head
from kvlocks.compaction.rank1 import augment_keys
from kvlocks.compaction.select import attention_scores, coverage_scores, guarded_top_t, guard_slots, select_keys
from kvlocks.compaction.values import exact_attention, refit_values

_NEEDS_BETA = ("am", "fold", "drop", "rank1")
_NEEDS_AM_VALUES = ("am", "drop", "rank1")
_OWN_STEPS = {"am": ("beta", "am_values"), "drop": ("beta", "am_values"),
              "rank1": ("beta", "am_values"), "fold": ("beta", "fold"), "drop_refit": ("refit",)}


@dataclass(frozen=True)
class HeadFit:
    """What every ratio and method of one head shares (:func:`prepare_head`).

    Attributes
    ----------
    keys, values : Tensor [T, D], [T, Dv], float32
    queries : Tensor [n, D], float32
        Reference queries, subsampled to ``config.max_queries``.
    target : Tensor [n, Dv], float32
        Full-cache attention outputs of ``queries``.
    scores : Tensor [T] or None
        RMS attention weight of each key (``selection="attention"`` only).
    scale : float
    seconds : float
        Time spent preparing.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    target: torch.Tensor
    scores: torch.Tensor | None
    scale: float
    seconds: float


@dataclass(frozen=True)
class MethodHeads:
    """Every requested method's compaction of one head at one t.

    Attributes
    ----------
    heads : dict[str, CompactedHead]
    seconds : dict[str, float]
        Each method's compaction time on its own (shared steps counted for every method).
    """

    heads: dict[str, CompactedHead]
    seconds: dict[str, float]


def prepare_head(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor,
                 config: CompactionConfig, scale: float | None = None) -> HeadFit:
    """Subsample the reference queries and compute the full cache's outputs and key scores.

    Parameters
    ----------
    keys : Tensor [T, D] (post-RoPE)
    values : Tensor [T, Dv]
    queries : Tensor [n, D]
        Reference queries pooled over the GQA group; subsampled to ``config.max_queries``.
    config : CompactionConfig
    scale : float, optional
        Default ``1/sqrt(D)``.
    """
    start = time.perf_counter()
    s = default_scale(keys.shape[1], scale)
    k = keys.detach().to(torch.float32)
    v = values.detach().to(torch.float32)
    q = subsample_queries(queries.detach().to(torch.float32), config.max_queries, config.seed)
    target, _ = exact_attention(q, k, v, scale=s)  # [n, Dv]
    scores = attention_scores(k, q, scale=s) if config.selection == "attention" else None  # [T]
    return HeadFit(keys=k, values=v, queries=q, target=target, scores=scores, scale=s,
                   seconds=time.perf_counter() - start)


def _guarded(scores: torch.Tensor, keys: torch.Tensor, t: int, share: float) -> torch.Tensor:
    """:func:`~kvlocks.compaction.select.select_attention`'s keys from precomputed RMS scores."""
    guards = [(coverage_scores(keys)[None], guard_slots(t, share))] if share > 0 else []
    return guarded_top_t(scores[None], guards, t)[0]


def _timed(spent: dict, name: str, fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
    return out


def compact_methods(fit: HeadFit, t: int, methods: tuple[str, ...],
                    config: CompactionConfig) -> MethodHeads:
    """Compact one prepared head to t entries with each of ``methods``.

    Parameters
    ----------
    fit : HeadFit
        From :func:`prepare_head` with the same ``config``.
    t : int
        1 <= t <= T.
    methods : tuple of str
        Non-empty subset of ``CompactionConfig.METHODS``.
    config : CompactionConfig
        Shared settings (its ``method`` field is ignored).

    Returns
    -------
    MethodHeads
    """
    if not methods or any(m not in METHODS for m in methods):
        raise ValueError(f"methods={methods!r}: need a non-empty subset of {METHODS}")
    k, v, q, s = fit.keys, fit.values, fit.queries, fit.scale
    if not 1 <= t <= k.shape[0]:
        raise ValueError(f"t={t}: must satisfy 1 <= t <= T={k.shape[0]}")
    spent: dict[str, float] = {}
    heads: dict[str, CompactedHead] = {}
    own: dict[str, float] = {}
    if "merge_fold" in methods:  # shares nothing with the others but the queries and target
        start = time.perf_counter()
        heads["merge_fold"] = compact_head(k, v, q, t, config.replace(method="merge_fold"), s)
        own["merge_fold"] = time.perf_counter() - start
    plain = [m for m in methods if m != "merge_fold"]
    if not plain:
        return MethodHeads(heads=heads, seconds=own)
    if fit.scores is not None:  # [t], as select_attention
        idx = _timed(spent, "select", _guarded, fit.scores, k, t, config.coverage_share)
    else:
        idx = _timed(spent, "select", select_keys, k, q, t, rule=config.selection, scale=s,
                     coverage_share=config.coverage_share)
    kept = k[idx]  # [t, D]
    anchor = {"ridge": config.ridge, "anchor": v[idx], "anchor_weight": config.value_anchor}
    if any(m in _NEEDS_BETA for m in plain):
        beta = _timed(spent, "beta", fit_bias, k, idx, q, scale=s, beta_min=config.beta_min,
                      beta_max=config.beta_max, solver=config.bias_solver)  # [t]
    if any(m in _NEEDS_AM_VALUES for m in plain):
        am_values = _timed(spent, "am_values", refit_values, kept, q, fit.target, scale=s,
                           bias=beta, **anchor)  # [t, Dv]
    d = k.shape[1]
    for m in plain:
        common = dict(indices=idx, method=m, head_dim_out=d)
        if m == "am":
            heads[m] = CompactedHead(keys=kept, values=am_values, beta=beta, u=None,
                                     fitted_bias=beta, **common)
        elif m == "drop":
            heads[m] = CompactedHead(keys=kept, values=am_values, beta=None, u=None,
                                     fitted_bias=beta, **common)
        elif m == "rank1":
            heads[m] = CompactedHead(keys=augment_keys(kept, beta), values=am_values, beta=None,
                                     u=None, indices=idx, method=m, head_dim_out=d + 1,
                                     fitted_bias=beta)
        elif m == "fold":
            fr = _timed(spent, "fold", fold_head, kept, beta, q, fit.target, scale=s,
                        fold_lambda=config.fold_lambda, round_dtype=config.round_dtype, **anchor)
            heads[m] = CompactedHead(keys=fr.keys, values=fr.values, beta=None, u=fr.u,
                                     fitted_bias=beta, **common)
        else:  # drop_refit
            vals = _timed(spent, "refit", refit_values, kept, q, fit.target, scale=s, bias=None, **anchor)
            heads[m] = CompactedHead(keys=kept, values=vals, beta=None, u=None, **common)
    base = fit.seconds + spent["select"]
    for m in plain:
        own[m] = base + sum(spent.get(step, 0.0) for step in _OWN_STEPS[m])
    return MethodHeads(heads={m: heads[m] for m in methods}, seconds={m: own[m] for m in methods})
