"""StreamingLLM baseline: attend the sink pages and a window of the most recent pages only.

The shared rule of :func:`~kvlocks.selection.selectors.choose_pages` always keeps the sink and
recent pages; the remaining ``k - sink - recent`` slots go to the highest scores. Streaming scores
page ``j`` of ``Pc`` as ``j / Pc``: strictly increasing with the page index, so the top slots are
always the latest pages and the selection is sink + the last ``k - sink`` pages (the partial
page, if any, included). The scores span ``[0, 1)`` whatever the context length, so every combine
rule (``softmax`` shares, ``logsumexp`` over the group) keeps their order in float32 up to
``Pc ~ 10^6`` pages. Nothing is read to score: selection bytes are 0.
"""

from __future__ import annotations

import torch

from kvlocks.config import LocksConfig
from kvlocks.selection.pages import mask_empty_pages, page_mask


class StreamingSelector:
    """Sink + recent window; scores ``j / Pc`` increase with the page index ``j``."""

    name = "streaming"
    needs_summaries = False
    reads_all_keys = False

    def page_scores(self, queries: torch.Tensor, view, config: LocksConfig) -> torch.Tensor:
        """queries ``[..., G, D]`` -> float32 ``[..., G, Pc]`` (the same row for every head)."""
        pc = view.keys.shape[-2] // config.page_size
        ramp = torch.arange(pc, dtype=torch.float32, device=queries.device) / pc  # [Pc]
        scores = ramp.expand(*queries.shape[:-1], pc)  # [..., G, Pc]
        return mask_empty_pages(scores, page_mask(view.token_mask, config.page_size, pc))

    def bytes_per_page(self, config: LocksConfig, head_dim: int, elem_size: int) -> tuple[int, int]:
        return 0, 0

    def selection_bytes(self, config: LocksConfig, head_dim: int, elem_size: int, full_pages: int) -> float:
        return 0.0
