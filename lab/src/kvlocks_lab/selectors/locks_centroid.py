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
scores from the summaries a LOCKS cache keeps.
"""

from __future__ import annotations

from kvlocks.config import LocksConfig
from kvlocks.scoring.reference import score_pages_from_centroids
from kvlocks.selection.pages import page_mask
from kvlocks.selection.selectors import LocksSelector


class LocksCentroidSelector(LocksSelector):
    """LOCKS with ``rerank_scores="centroid"``, token-major: the summaries' centroids choose the
    candidates (:func:`kvlocks.scoring.reference.score_pages_from_centroids`) whatever the config's
    ``rerank_scores``, the re-rank of the config decides. The method name ``locks_centroid`` is the
    product's mode of ``locks`` (:data:`kvlocks.config.METHOD_MODES`, its settings by
    :func:`kvlocks.config.method_config`), which the decode plan runs on every path; an instance of
    this class runs its own scores through the plan's select -> attend."""

    name = "locks_centroid"

    def page_scores(self, queries, view, config: LocksConfig):
        """Centroid scores whatever ``config.rerank_scores`` says (this selector's own scores)."""
        s = view.summaries
        return score_pages_from_centroids(queries, s, scale=view.scale,
                                          token_mask=page_mask(view.token_mask, config.page_size, s.num_pages))

    def selection_bytes(self, config: LocksConfig, head_dim: int, elem_size: int, full_pages: int) -> float:
        """The centroids' bytes (int8 and a float16 scale, or float16 at ``coef_bits=16``), one KV head."""
        return float(full_pages * (head_dim * config.coef_bits // 8 + 2 * (config.coef_bits == 8)))
