"""The functional API: one function per LOCKS operation, plain tensors in and out, any device.

This is the public front door (re-exported from ``kvlocks``); internal paths (the Hugging Face
cache, the engine, the kernels' dispatch) use their own, differently named entry points.

==============================  =================================================================
operation                       shapes (documented case ``[Hkv, ...]``; extra leading dims such as
                                a batch dim ``[B, Hkv, ...]`` work the same)
==============================  =================================================================
:func:`build_summaries`         keys ``[Hkv, P, S, D]`` -> :class:`PageSummaries` of P pages
:func:`score_pages`             queries ``[Hkv, G, D]`` + summaries -> float32 ``[Hkv, G, P]``
:func:`select_pages`            queries ``[Hkv, G, D]`` + summaries -> int64 ``[Hkv, K]``
:func:`sparse_decode`           queries ``[Hkv, G, D]``, keys/values ``[Hkv, N, D]``, page_ids
                                ``[Hkv, K]`` -> out ``[Hkv, G, D]``, lse float32 ``[Hkv, G]``
:func:`dense_decode`            queries ``[Hkv, G, D]``, keys/values ``[Hkv, N, D]`` -> out, lse
==============================  =================================================================

Every function checks its inputs and raises ``ValueError`` naming the argument, the value and
what is allowed: types, dims, shapes, dtypes, devices, a config that does not match the
summaries, empty inputs, and NaN/Inf values (one pass over each input tensor).
"""

from __future__ import annotations

import torch

from kvlocks._checks import (
    check_finite, check_index_tensor, check_nonempty, check_same, check_same_device, check_scale,
    check_tensor,
)
from kvlocks.attention import reference as _attention
from kvlocks.config import LocksConfig
from kvlocks.scoring.reference import combine_group, score_pages_from_summaries
from kvlocks.selection.topk import select_top_pages
from kvlocks.summary import build as _summary
from kvlocks.summary.types import PageSummaries


def _check_config(config) -> None:
    if not isinstance(config, LocksConfig):
        raise ValueError(f"config must be a kvlocks.LocksConfig, got {type(config).__name__}")


def _check_queries(queries, summaries, config: LocksConfig) -> None:
    if not isinstance(summaries, PageSummaries):
        raise ValueError(f"summaries must be kvlocks.PageSummaries (from build_summaries), "
                         f"got {type(summaries).__name__}")
    _check_config(config)
    check_tensor("queries", queries, 2)
    check_nonempty("queries", queries, -2, "G (query heads per KV head)")
    check_same_device(queries=queries, summaries=summaries.coef)
    check_same("head_dim", "queries.shape[-1]", queries.shape[-1], "summaries.head_dim", summaries.head_dim)
    check_same("leading dims", "queries", tuple(queries.shape[:-2]), "summaries", summaries.lead_shape)
    for field in ("page_size", "rank", "basis_bits", "coef_bits"):
        check_same(field, f"config.{field}", getattr(config, field), f"summaries.{field}",
                   getattr(summaries, field))
    check_finite("queries", queries)


def build_summaries(keys: torch.Tensor, config: LocksConfig) -> PageSummaries:
    """Build and quantize the LOCKS summary of every full page of keys.

    Parameters
    ----------
    keys : float tensor ``[Hkv, P, S, D]`` (or ``[B, Hkv, P, S, D]``)
        Post-RoPE keys of full pages; ``S == config.page_size``; P may be 0. Finite.
    config : LocksConfig
        ``page_size``, ``rank``, ``basis_bits`` and ``coef_bits`` are used.

    Returns
    -------
    PageSummaries
        Leading dims ``[Hkv]``, P pages: basis ``[Hkv, P, R, D·bits/8]`` (packed int4), coefficients
        int8 ``[Hkv, P, S, R]``, centroid int8 ``[Hkv, P, D]``, float16 scales.
    """
    _check_config(config)
    check_tensor("keys", keys, 3)
    check_nonempty("keys", keys, -1, "D (head_dim)")
    return _summary.build_summaries(keys, config)


def score_pages(
    queries: torch.Tensor, summaries: PageSummaries, config: LocksConfig, *, scale: float | None = None
) -> torch.Tensor:
    """Eq. 4 estimate of each page's log-sum-exp of ``q.k * scale``, from the summary only.

    Parameters
    ----------
    queries : float tensor ``[Hkv, G, D]``, on the summaries' device, finite
    summaries : PageSummaries with leading dims ``[Hkv]`` and P pages
    config : LocksConfig; its page_size, rank and bit widths must be the summaries'
    scale : float > 0, optional (default ``1/sqrt(D)``)

    Returns
    -------
    float32 ``[Hkv, G, P]``
    """
    _check_queries(queries, summaries, config)
    return score_pages_from_summaries(queries, summaries, scale=check_scale(scale))


def select_pages(
    queries: torch.Tensor, summaries: PageSummaries, config: LocksConfig, *, scale: float | None = None
) -> torch.Tensor:
    """LOCKS selection over full pages: sink + most recent + top-(k - 2) by the combined share.

    Parameters
    ----------
    queries : float tensor ``[Hkv, G, D]``, on the summaries' device, finite
    summaries : PageSummaries with leading dims ``[Hkv]`` and P >= 1 pages
    config : LocksConfig; ``budget`` gives ``k = budget / page_size``; ``combine`` the GQA rule
    scale : float > 0, optional (default ``1/sqrt(D)``)

    Returns
    -------
    int64 ``[Hkv, K]``, ascending page ids, ``K = min(k, P)``; page 0 (sink) and page P-1
    (recent) are always included.
    """
    _check_queries(queries, summaries, config)
    p = summaries.num_pages
    if p == 0:
        raise ValueError("summaries hold 0 pages: nothing to select from (empty context)")
    scores = score_pages_from_summaries(queries, summaries, scale=check_scale(scale))  # [Hkv, G, P]
    ranking = combine_group(scores, config.combine)  # [Hkv, P]
    return select_top_pages(
        ranking, p, config.pages_per_step, sink_pages=config.sink_pages, recent_pages=config.recent_pages
    )


def _check_finite_qkv(queries, keys, values) -> None:
    """The one pass per tensor that finds NaN/Inf (after the free metadata checks)."""
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        check_finite(name, x)


def _check_attended(lse: torch.Tensor) -> None:
    if bool(torch.isneginf(lse).any()):
        raise ValueError("token_mask excludes every attended token of some row (its output would be "
                         "NaN); each row needs at least one True token among the attended ones")


def sparse_decode(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, page_ids: torch.Tensor,
                  page_size: int, *, scale: float | None = None,
                  token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention of one decode query per head over the selected pages only.

    Parameters
    ----------
    queries : float tensor ``[Hkv, G, D]``
    keys, values : float tensors ``[Hkv, N, D]``, token-major; N need not be a multiple of
        page_size (the partial last page is masked)
    page_ids : integer tensor ``[Hkv, K]``, K >= 1 distinct ids per row in
        ``[0, ceil(N / page_size))``, e.g. from :func:`select_pages`
    page_size : int >= 1
    scale : float > 0, optional (default ``1/sqrt(D)``)
    token_mask : bool ``[Hkv, N]``, optional (False = padding, never attended)

    Returns
    -------
    out : ``[Hkv, G, D]`` in the queries' dtype
    lse : float32 ``[Hkv, G]``, natural-log log-sum-exp of the attended scaled logits
    """
    _attention.check_qkv(queries, keys, values, token_mask, scale)
    check_index_tensor("page_ids", page_ids)
    check_same_device(keys=keys, page_ids=page_ids)
    check_nonempty("page_ids", page_ids, -1, "K (pages selected)")
    _check_finite_qkv(queries, keys, values)
    if page_ids.shape[-1] > 1:
        ordered = torch.sort(page_ids, dim=-1).values
        if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
            raise ValueError("page_ids must be distinct within each row (a repeated page would be "
                             "counted twice in the softmax)")
    out, lse = _attention.sparse_decode(queries, keys, values, page_ids, page_size, scale=scale,
                                        token_mask=token_mask)
    _check_attended(lse)
    return out, lse


def dense_decode(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scale: float | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FullKV reference: exact attention of one decode query per head over every token.

    Parameters
    ----------
    queries : float tensor ``[Hkv, G, D]``
    keys, values : float tensors ``[Hkv, N, D]``, N >= 1
    scale : float > 0, optional (default ``1/sqrt(D)``)
    token_mask : bool ``[Hkv, N]``, optional (False = padding, never attended)

    Returns
    -------
    out : ``[Hkv, G, D]`` in the queries' dtype
    lse : float32 ``[Hkv, G]``
    """
    _attention.check_qkv(queries, keys, values, token_mask, scale)
    _check_finite_qkv(queries, keys, values)
    out, lse = _attention.dense_decode(queries, keys, values, scale=scale, token_mask=token_mask)
    _check_attended(lse)
    return out, lse


__all__ = [
    "LocksConfig", "PageSummaries", "build_summaries", "dense_decode", "score_pages",
    "select_pages", "sparse_decode",
]
