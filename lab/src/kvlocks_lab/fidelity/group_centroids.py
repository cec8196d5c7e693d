"""A group score from the member pages' centroids (a candidate coarse level that keeps the pages apart).

The Eq. 4 score of a group summarised as one super-page (:mod:`kvlocks_lab.selectors.hier`) mixes
its m pages into one rank-R basis, so a page whose keys point elsewhere than the rest of the
group (a needle in a haystack) is averaged away. Here a group of m pages is summarised by the m
int8 centroids its pages' LOCKS summaries hold anyway, and scored by the rank-0 Eq. 4 estimate
of each member, combined by log-sum-exp:

    score(group) = log Σ_{p in group} exp(log S + s q·μ_p),

the log-mass the group would have if every key of page p sat at μ_p. By Jensen's inequality each
member's term is at most the page's exact log-sum-exp (log Σ_j exp(s q·k_j) >= log S + s q·mean_j k_j),
so the score underestimates the group's mass; the member that holds a needle keeps its own term
instead of sharing a basis with the other m − 1 pages. It reads D + 2 bytes per page (int8 and its
scale): at D = 128 and rank 8, 130 of a LOCKS summary's ~780 bytes, the whole context's centroids
at every step, plus the kept groups' page summaries.
"""

from __future__ import annotations

import math

import torch

from kvlocks.config import LocksConfig
from kvlocks.summary.build import build_summaries


def centroid_group_scores(queries: torch.Tensor, keys: torch.Tensor, config: LocksConfig, *, group_pages: int,
                          scale: float) -> torch.Tensor:
    """Scores ``[..., G, NG]`` of the full groups of ``group_pages`` pages.

    queries ``[..., G, D]`` (one query step per leading index, as the Eq. 4 scorers take them),
    keys ``[..., N, D]`` token-major; the centroids are those of the LOCKS page summaries
    (int8 with their scales) that ``config`` builds.
    """
    s, m = config.page_size, group_pages
    pages = keys.shape[-2] // s
    ng = pages // m
    k = keys[..., : pages * s, :].float().unflatten(-2, (pages, s))  # [..., P, S, D]
    mu = build_summaries(k, config).centroid_float()[..., : ng * m, :]  # [..., NG*m, D]
    page = math.log(s) + scale * (queries.float() @ mu.transpose(-1, -2))  # [..., G, NG*m]
    return torch.logsumexp(page.unflatten(-1, (ng, m)), dim=-1)  # [..., G, NG]
