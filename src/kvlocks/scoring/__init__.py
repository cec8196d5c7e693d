"""Score pages from summaries (Eq. 4), exactly (oracle), and combine over the GQA group (Eq. 5)."""

from kvlocks.scoring.reference import (
    combine_group,
    exact_page_lse,
    score_pages_from_summaries,
    summary_logits,
)

__all__ = ["combine_group", "exact_page_lse", "score_pages_from_summaries", "summary_logits"]
