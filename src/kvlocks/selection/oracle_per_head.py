"""Per-head oracle: every query head attends its own exact top-k pages (reads every key).

This is the ceiling of *unshared* selection, the reference the LOCKS paper compares group-shared
selection (Eq. 5) against. It does not fit a selection shared by the GQA group, so it is exposed
as follows:

- the selector carries ``per_head = True``; :func:`~kvlocks.selection.selectors.choose_pages`
  then skips the group combine rule and applies sink + recent + top-(k - forced) to each query
  head's exact page log-sum-exps, returning int64 ``[..., G, K]`` instead of ``[..., K]``;
- :func:`sparse_decode_per_head` attends with those pages, treating G as one more leading dim
  (each head's query ``[..., G, 1, D]`` against the layer's keys expanded, without a copy, to
  ``[..., G, N, D]``).

Cost: G times the selection work of the shared oracle (G top-k sorts instead of one per KV head)
and up to G times the distinct K/V pages per KV head (each head may pick different pages;
:func:`distinct_pages` measures how many a KV head really reads).
"""

from __future__ import annotations

import torch

from kvlocks.attention.reference import sparse_decode
from kvlocks.config import LocksConfig
from kvlocks.scoring.reference import exact_page_lse
from kvlocks.selection._common import page_mask


class OraclePerHeadSelector:
    """Exact per-page LSE per query head, selected per head (``per_head = True``)."""

    name = "oracle_per_head"
    needs_summaries = False
    reads_all_keys = True
    per_head = True

    def page_scores(self, queries: torch.Tensor, view, config: LocksConfig) -> torch.Tensor:
        """queries ``[..., G, D]`` -> float32 ``[..., G, Pc]`` exact page log-sum-exps."""
        pc = view.keys.shape[-2] // config.page_size
        return exact_page_lse(
            queries, view.keys, config.page_size, scale=view.scale,
            token_mask=page_mask(view.token_mask, config.page_size, pc),
        )


def sparse_decode_per_head(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    page_ids: torch.Tensor,
    page_size: int,
    *,
    scale: float | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of each query head over its own selected pages.

    Parameters
    ----------
    queries : ``[..., G, D]``
    keys, values : ``[..., N, D]`` token-major (shared by the G heads of a group)
    page_ids : int64 ``[..., G, K]`` per-head page ids
    page_size : int
    scale : softmax scale, default ``1/sqrt(D)``
    token_mask : bool ``[..., N]`` optional

    Returns
    -------
    out : ``[..., G, D]`` in the queries' dtype
    lse : float32 ``[..., G]``
    """
    g = queries.shape[-2]
    q = queries.unsqueeze(-2)  # [..., G, 1, D]
    k = keys.unsqueeze(-3).expand(*keys.shape[:-2], g, *keys.shape[-2:])  # [..., G, N, D], no copy
    v = values.unsqueeze(-3).expand(*values.shape[:-2], g, *values.shape[-2:])
    m = None if token_mask is None else token_mask.unsqueeze(-2).expand(*token_mask.shape[:-1], g, token_mask.shape[-1])
    out, lse = sparse_decode(q, k, v, page_ids, page_size, scale=scale, token_mask=m)
    return out.squeeze(-2), lse.squeeze(-1)  # [..., G, D], [..., G]


def distinct_pages(page_ids: torch.Tensor, total_pages: int) -> float:
    """Mean over KV heads (and batch rows) of the distinct pages the G heads select together.

    page_ids int64 ``[..., G, K]`` -> a float in ``[K, min(G * K, total_pages)]`` (host sync).
    """
    hit = torch.zeros((*page_ids.shape[:-2], total_pages), dtype=torch.bool, device=page_ids.device)
    hit.scatter_(-1, page_ids.flatten(-2), True)  # [..., total]
    return float(hit.sum(-1).float().mean())
