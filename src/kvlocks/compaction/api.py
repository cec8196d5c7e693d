"""Compact one KV head (or a layer of them) with any of the compaction methods.

Pipeline per head (T keys -> t entries):

* ``am``: select t keys, fit beta (box NNLS on partition functions), refit values with beta.
* ``fold``: ``am``, then fold beta into the keys along u, round, refit values without bias.
* ``drop``: ``am``'s keys and values, beta discarded (read as a plain cache).
* ``drop_refit``: selected keys, values refit without bias (no bias fit).
* ``rank1``: ``am`` with beta stored as key coordinate D (head dim D+1, exact).
* ``merge_fold``: log-count merge to t entries, fold log(count), refit values without bias.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import batched
from .common import check_matrix, default_scale
from .bias import fit_bias
from .config import CompactionConfig
from .fold import fold_head
from .merge import merge_to_budget
from .rank1 import augment_keys
from .select import select_keys
from .values import exact_attention, refit_values

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompactedHead:
    """One compacted KV head.

    Attributes
    ----------
    keys : Tensor [t, head_dim_out], float32
        What the cache stores as keys (folded for ``fold``/``merge_fold``, augmented for rank1).
    values : Tensor [t, Dv], float32
    beta : Tensor [t], float32, or None
        Logit bias the kernel must add; set only for ``am``.
    indices : Tensor [t], int64
        Kept positions, ascending (for ``merge_fold``: each cluster's leader position).
    u : Tensor [D], float32, or None
        Fold direction (``fold``, ``merge_fold``).
    method : str
    head_dim_out : int
        D, or D+1 for ``rank1``.
    fitted_bias : Tensor [t], float32, or None
        The per-entry bias the method computed, whatever became of it: AM's beta (``am``,
        ``fold``, ``drop``, ``rank1``), log(count) (``merge_fold``), None (``drop_refit``).
    """

    keys: torch.Tensor
    values: torch.Tensor
    beta: torch.Tensor | None
    indices: torch.Tensor
    u: torch.Tensor | None
    method: str
    head_dim_out: int
    fitted_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class CompactedLayer:
    """The KV heads of one layer, compacted with the same budget t, stacked on dim 0.

    Attributes
    ----------
    keys : Tensor [Hkv, t, head_dim_out], float32
    values : Tensor [Hkv, t, Dv], float32
    beta : Tensor [Hkv, t] or None
    indices : Tensor [Hkv, t], int64
    u : Tensor [Hkv, D] or None
    method : str
    head_dim_out : int
    fitted_bias : Tensor [Hkv, t] or None
    """

    keys: torch.Tensor
    values: torch.Tensor
    beta: torch.Tensor | None
    indices: torch.Tensor
    u: torch.Tensor | None
    method: str
    head_dim_out: int
    fitted_bias: torch.Tensor | None = None


def _resolve_budget(t: int | None, num_tokens: int, config: CompactionConfig) -> int:
    if t is None:
        return config.budget(num_tokens)
    if isinstance(t, bool) or not isinstance(t, int):
        raise ValueError(f"t={t!r}: must be an integer (or None to use config.ratio)")
    if not 1 <= t <= num_tokens:
        raise ValueError(f"t={t}: must satisfy 1 <= t <= T={num_tokens}")
    return t


def _check_head(k, v, q) -> None:
    check_matrix("K", k)
    if k.shape[0] == 0:
        raise ValueError(f"K is empty: shape {tuple(k.shape)} has T=0 tokens")
    check_matrix("V", v)
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"V shape {tuple(v.shape)} does not match K shape {tuple(k.shape)} (T)")
    check_matrix("Q", q, cols=k.shape[1])
    if q.shape[0] == 0:
        raise ValueError(f"Q is empty: shape {tuple(q.shape)} has no reference queries")


def _check_question(question, dim: int) -> None:
    if question is None:
        return
    check_matrix("question", question, cols=dim)
    if question.shape[0] == 0:
        raise ValueError(f"question is empty: shape {tuple(question.shape)} has no query rows (pass None for none)")


def subsample_queries(q: torch.Tensor, max_queries: int, seed: int) -> torch.Tensor:
    """At most ``max_queries`` rows of ``q`` [n, D], drawn without replacement, kept in order."""
    if q.shape[0] <= max_queries:
        return q
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(q.shape[0], generator=gen)[:max_queries].sort().values
    return q[rows]


def compact_head(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor,
                 t: int | None, config: CompactionConfig, scale: float | None = None, *,
                 question: torch.Tensor | None = None) -> CompactedHead:
    """Compact one KV head from T tokens to t entries.

    Parameters
    ----------
    keys : Tensor [T, D], float (post-RoPE)
    values : Tensor [T, Dv], float
    queries : Tensor [n, D], float
        Reference queries, pooled over the GQA group; subsampled to ``config.max_queries``.
    t : int or None
        Entries kept, 1 <= t <= T; None uses ``config.budget(T)``.
    config : CompactionConfig
    scale : float, optional
        Logit scale; default ``1/sqrt(D)``.
    question : Tensor [m, D], optional
        Query rows of questions known when compacting (also among ``queries``): with
        ``selection="attention"``, ``config.question_share`` of the t slots go to the keys
        they attend to most (:mod:`.select`).

    Returns
    -------
    CompactedHead (all tensors on CPU, float32 / int64)

    Raises
    ------
    ValueError
        NaN/Inf inputs (naming the tensor), shape mismatches, empty T or Q, bad t.
    """
    if not isinstance(config, CompactionConfig):
        raise ValueError(f"config must be a CompactionConfig, got {type(config).__name__}")
    _check_head(keys, values, queries)
    _check_question(question, keys.shape[1])
    num, d = keys.shape
    t = _resolve_budget(t, num, config)
    s = default_scale(d, scale)
    k = keys.detach().to(torch.float32)
    v = values.detach().to(torch.float32)
    q = subsample_queries(queries.detach().to(torch.float32), config.max_queries, config.seed)
    target, _ = exact_attention(q, k, v, scale=s)  # [n, Dv]
    method = config.method
    logger.debug("compact_head: method=%s T=%d t=%d D=%d n=%d", method, num, t, d, q.shape[0])

    if method == "merge_fold":
        merged = merge_to_budget(k, v, q, t, threshold=config.merge_threshold, scale=s)
        fr = fold_head(merged.keys, merged.bias, q, target, scale=s, fold_lambda=config.fold_lambda,
                       round_dtype=config.round_dtype, ridge=config.ridge, anchor=merged.values,
                       anchor_weight=config.value_anchor)
        return CompactedHead(keys=fr.keys, values=fr.values, beta=None, indices=merged.indices,
                             u=fr.u, method=method, head_dim_out=d, fitted_bias=merged.bias)

    guard = None if question is None or config.question_share == 0 else question.detach().to(torch.float32)
    idx = select_keys(k, q, t, rule=config.selection, scale=s, question=guard,
                      question_share=config.question_share, coverage_share=config.coverage_share)  # [t]
    kept = k[idx]  # [t, D]
    anchor = {"anchor": v[idx], "anchor_weight": config.value_anchor}  # pull towards the kept values
    if method == "drop_refit":
        vals = refit_values(kept, q, target, scale=s, bias=None, ridge=config.ridge, **anchor)
        return CompactedHead(keys=kept, values=vals, beta=None, indices=idx, u=None,
                             method=method, head_dim_out=d)

    beta = fit_bias(k, idx, q, scale=s, beta_min=config.beta_min, beta_max=config.beta_max,
                    solver=config.bias_solver)  # [t]
    if method == "fold":
        fr = fold_head(kept, beta, q, target, scale=s, fold_lambda=config.fold_lambda,
                       round_dtype=config.round_dtype, ridge=config.ridge, **anchor)
        return CompactedHead(keys=fr.keys, values=fr.values, beta=None, indices=idx, u=fr.u,
                             method=method, head_dim_out=d, fitted_bias=beta)
    vals = refit_values(kept, q, target, scale=s, bias=beta, ridge=config.ridge, **anchor)  # [t, Dv]
    if method == "am":
        return CompactedHead(keys=kept, values=vals, beta=beta, indices=idx, u=None,
                             method=method, head_dim_out=d, fitted_bias=beta)
    if method == "drop":
        return CompactedHead(keys=kept, values=vals, beta=None, indices=idx, u=None,
                             method=method, head_dim_out=d, fitted_bias=beta)
    # rank1: q' = [q, 1/scale] reads k' = [k, beta] with the ORIGINAL scale (see .rank1)
    return CompactedHead(keys=augment_keys(kept, beta), values=vals, beta=None, indices=idx,
                         u=None, method=method, head_dim_out=d + 1, fitted_bias=beta)


def _stack(heads: list[CompactedHead], name: str) -> torch.Tensor | None:
    parts = [getattr(h, name) for h in heads]
    return None if parts[0] is None else torch.stack(parts)


def compact_layer(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor,
                  t: int | None, config: CompactionConfig, scale: float | None = None, *,
                  timings: dict | None = None, question: torch.Tensor | None = None) -> CompactedLayer:
    """Compact every KV head of one layer with the same budget t (equal per-head lengths).

    ``selection="attention"`` with ``am``, ``fold``, ``drop``, ``drop_refit`` or ``rank1`` takes
    the batched path of :mod:`.batched` (logits computed once, heads solved together); OMP
    selection and ``merge_fold`` run :func:`compact_head` per head.

    Parameters
    ----------
    keys : Tensor [Hkv, T, D]
    values : Tensor [Hkv, T, Dv]
    queries : Tensor [Hkv, n, D]
        Reference queries of each KV head, already pooled over its GQA group.
    t : int or None
        Entries kept per head; None uses ``config.budget(T)``.
    config : CompactionConfig
    scale : float, optional
        Default ``1/sqrt(D)``.
    timings : dict, optional
        Batched path only: seconds per stage are added to it (see :mod:`.batched`).
    question : Tensor [Hkv, m, D], optional
        Query rows of questions known when compacting, pooled like ``queries`` (and among
        them): the guard of :mod:`.select` (see :func:`compact_head`).

    Returns
    -------
    CompactedLayer
    """
    for name, x in (("K", keys), ("V", values), ("Q", queries)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 3-D tensor [Hkv, *, *], got {shape}")
    if not keys.shape[0] == values.shape[0] == queries.shape[0]:
        raise ValueError(f"KV head count mismatch: K {tuple(keys.shape)}, V {tuple(values.shape)}, "
                         f"Q {tuple(queries.shape)} must agree on dim 0 (Hkv)")
    if keys.shape[0] == 0:
        raise ValueError(f"K has no KV heads: shape {tuple(keys.shape)}")
    if not isinstance(config, CompactionConfig):
        raise ValueError(f"config must be a CompactionConfig, got {type(config).__name__}")
    if question is not None and (not isinstance(question, torch.Tensor) or question.dim() != 3
                                 or question.shape[0] != keys.shape[0]):
        shape = tuple(question.shape) if isinstance(question, torch.Tensor) else type(question).__name__
        raise ValueError(f"question must be a 3-D tensor [Hkv={keys.shape[0]}, m, D], got {shape}")
    qh = (lambda h: None) if question is None else (lambda h: question[h])
    if batched.supports(config):
        for h in range(keys.shape[0]):
            try:
                _check_head(keys[h], values[h], queries[h])
                _check_question(qh(h), keys.shape[2])
            except ValueError as exc:
                raise ValueError(f"KV head {h}: {exc}") from None
        t = _resolve_budget(t, keys.shape[1], config)
        out = batched.compact_layer_batched(keys, values, queries, t, config, scale, timings=timings,
                                            question=question)
        return CompactedLayer(method=config.method, head_dim_out=out["keys"].shape[-1], **out)
    heads = []
    for h in range(keys.shape[0]):
        try:
            heads.append(compact_head(keys[h], values[h], queries[h], t, config, scale, question=qh(h)))
        except ValueError as exc:
            raise ValueError(f"KV head {h}: {exc}") from None
    return CompactedLayer(keys=torch.stack([h.keys for h in heads]),
                          values=torch.stack([h.values for h in heads]),
                          beta=_stack(heads, "beta"),
                          indices=torch.stack([h.indices for h in heads]),
                          u=_stack(heads, "u"), method=config.method,
                          head_dim_out=heads[0].head_dim_out,
                          fitted_bias=_stack(heads, "fitted_bias"))
