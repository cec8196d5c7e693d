"""``locks_centroid``: the centroids of the LOCKS summaries choose candidates for the exact re-rank.

A page of ``n_p`` real tokens scores ``log n_p + scale * q.mu_p`` with ``mu_p`` the int8 centroid its
LOCKS summary already holds: Eq. 4 at rank 0, at most the page's log-sum-exp by Jensen's inequality
(up to the centroid's int8 rounding). A step reads ``D + 2`` of a summary's bytes per page (130 of
818 at D = 128, rank 8), so the scores only choose ``rerank * (k - sink - recent)`` candidates
and the candidates' exact page masses, from their keys, pick the pages (:mod:`kvlocks.selection.rerank`).
Unless the configuration sets them, the multiple is 16 and the candidates are at least 256 pages
(``rerank_min``): with few pages (k = 8 of 500 at 8K tokens, budget 128) 16 (k - 2) candidates
miss needle pages the rank-8 summaries find, and 256 pages of keys are little to read there
(``docs/locks.md``); at 1M tokens and budget 2048 the multiple gives 2,016 and the floor is idle. Unlike the ``centroid``
baseline (:mod:`.centroid`, which recomputes centroids from the keys at a chosen precision), it
scores from the summaries a LOCKS cache keeps. Runs on the references (the Hugging Face path).
"""

from __future__ import annotations

import torch

from kvlocks.config import LocksConfig
from kvlocks.selection._common import NEG_INF, page_mask


class LocksCentroidSelector:
    """Scores from the LOCKS summaries' centroids; the cache's re-rank decides (``config_defaults``)."""

    name = "locks_centroid"
    needs_summaries = True
    reads_all_keys = False
    config_defaults = {"rerank": 16, "rerank_min": 256}

    def page_scores(self, queries: torch.Tensor, view, config: LocksConfig) -> torch.Tensor:
        """queries ``[..., G, D]`` -> float32 ``[..., G, Pc]``."""
        s = view.summaries
        logits = torch.einsum("...gd,...pd->...gp", queries.float(), s.centroid_float()) * view.scale
        pm = page_mask(view.token_mask, config.page_size, s.num_pages)  # [..., Pc, S] or None
        n = torch.full_like(logits[..., :1, :], config.page_size) if pm is None else pm.sum(-1).unsqueeze(-2).float()
        return torch.where(n > 0, logits + n.clamp_min(1).log(), NEG_INF)

    def selection_bytes(self, config: LocksConfig, head_dim: int, elem_size: int, full_pages: int) -> float:
        """The centroids' bytes (int8 and a float16 scale, or float16 at ``coef_bits=16``), one KV head."""
        return float(full_pages * (head_dim * config.coef_bits // 8 + 2 * (config.coef_bits == 8)))
