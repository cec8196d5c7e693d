"""Per-head oracle: every query head attends its own exact top-k pages (reads every key).

This is the ceiling of *unshared* selection, the reference the LOCKS paper compares group-shared
selection (Eq. 5) against. It does not fit a selection shared by the GQA group, so it is exposed
as follows:

- the selector carries ``per_head = True``; :func:`~kvlocks.selection.selectors.choose_pages`
  then skips the group combine rule and applies sink + recent + top-(k - forced) to each query
  head's exact page log-sum-exps, returning int64 ``[..., G, K]`` instead of ``[..., K]``;
- :func:`kvlocks.attention.per_head.sparse_decode_per_head` attends with those pages, treating G as one more leading dim
  (each head's query ``[..., G, 1, D]`` against the layer's keys expanded, without a copy, to
  ``[..., G, N, D]``).

Cost: G times the selection work of the shared oracle (G top-k sorts instead of one per KV head)
and up to G times the distinct K/V pages per KV head (each head may pick different pages;
:func:`kvlocks.attention.per_head.distinct_pages` measures how many a KV head really reads).
"""

from __future__ import annotations

import torch

from kvlocks.config import LocksConfig
from kvlocks.scoring.reference import exact_page_lse
from kvlocks.selection.pages import page_mask


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
