"""The functional API: the pieces of LOCKS as plain functions on tensors (any device).

Shapes (the documented case; extra leading dims such as a batch dim also work):

- ``build_summaries(keys [Hkv, P, S, D], config)`` -> :class:`PageSummaries`
- ``score_pages(queries [Hkv, G, D], summaries, config)`` -> float32 ``[Hkv, G, P]``
- ``select_pages(queries [Hkv, G, D], summaries, config)`` -> int64 ``[Hkv, K]``
- ``sparse_decode(queries, keys [Hkv, N, D], values, page_ids, page_size)`` -> (out, lse)
"""

from __future__ import annotations

import torch

from kvlocks._checks import check_finite, check_same, check_tensor
from kvlocks.attention.reference import dense_decode, sparse_decode
from kvlocks.config import LocksConfig
from kvlocks.scoring.reference import combine_group, score_pages_from_summaries
from kvlocks.selection.topk import select_top_pages
from kvlocks.summary.build import build_summaries
from kvlocks.summary.types import PageSummaries


def _check_queries(queries: torch.Tensor, summaries: PageSummaries, config: LocksConfig) -> None:
    check_tensor("queries", queries, 2)
    check_finite("queries", queries)
    check_same("head_dim", "queries.shape[-1]", queries.shape[-1], "summaries.head_dim", summaries.head_dim)
    check_same("leading dims", "queries", tuple(queries.shape[:-2]), "summaries", summaries.lead_shape)
    check_same("page_size", "config.page_size", config.page_size, "summaries.page_size", summaries.page_size)


def score_pages(
    queries: torch.Tensor, summaries: PageSummaries, config: LocksConfig, *, scale: float | None = None
) -> torch.Tensor:
    """Eq. 4 estimate of each page's log-sum-exp of ``q.k / sqrt(D)``, from the summary only.

    queries ``[Hkv, G, D]`` -> float32 ``[Hkv, G, P]``.
    """
    _check_queries(queries, summaries, config)
    return score_pages_from_summaries(queries, summaries, scale=scale)


def select_pages(
    queries: torch.Tensor, summaries: PageSummaries, config: LocksConfig, *, scale: float | None = None
) -> torch.Tensor:
    """LOCKS selection over full pages: sink + most recent + top-(k-2) by the combined share.

    queries ``[Hkv, G, D]`` -> int64 ``[Hkv, K]`` ascending, ``K = min(budget / page_size, P)``;
    page 0 and page P-1 are always included.
    """
    _check_queries(queries, summaries, config)
    p = summaries.num_pages
    if p == 0:
        raise ValueError("no full pages to select from (empty context)")
    ranking = combine_group(score_pages_from_summaries(queries, summaries, scale=scale), config.combine)
    return select_top_pages(
        ranking, p, config.pages_per_step, sink_pages=config.sink_pages, recent_pages=config.recent_pages
    )


__all__ = [
    "LocksConfig", "PageSummaries", "build_summaries", "dense_decode", "score_pages",
    "select_pages", "sparse_decode",
]
