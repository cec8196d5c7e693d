"""Hierarchical scoring: group summaries choose where to look, page summaries what to read.

Flat LOCKS reads every page's summary at every step. With ``LocksConfig.group_pages = m`` the full
pages also form groups of ``m`` consecutive pages, and each group has a LOCKS summary of its own:
the same spectral summary (Algorithm 1) of its ``m * S`` keys as one super-page, rank
``group_rank``, so its Eq. 4 score is an estimate of the group's log-sum-exp attention mass with
the same error analysis as a page's (Theorem 1 with the group's tail energy). A step:

1. scores every full group by Eq. 4 on its group summary and combines the query heads (the
   configured GQA rule);
2. keeps the best ``group_keep * (k - sink - recent)`` groups; their pages and the pages not in
   any full group (the sequence's tail, fewer than ``m`` pages) are the candidates;
3. scores the candidates by Eq. 4 on their page summaries; the GQA combine runs over the
   candidates' page scores and the other groups' scores (each group standing in for its pages'
   mass in the combine's normalisers), and the selection takes sink + recent + the best
   candidates.

When the budget covers the context every page is selected, as in flat LOCKS. The page scores of
pages outside the kept groups are never needed: a kernel reads only the candidates' summaries.

Pure PyTorch (the reference). The paged store (:mod:`kvlocks.cache.paged`) builds a group's
summary once, when its last page fills; without one, the group summaries are built from the keys.
"""

from __future__ import annotations

import torch

from kvlocks.config import METHOD_MODES, LocksConfig, group_config  # noqa: F401  (group_config re-exported)
from kvlocks.scoring.reference import combine_group, score_pages_from_summaries
from kvlocks.summary.build import build_summaries
from kvlocks.summary.types import PageSummaries

NEG_INF = float("-inf")
HIER_METHOD = "locks_hier"  # the method name of LOCKS with hierarchical scoring (LocksCache, the CLI, eval)
DEFAULT_GROUPS = METHOD_MODES[HIER_METHOD]  # its groups (kvlocks.config.method_config)


def group_summaries(keys: torch.Tensor, config: LocksConfig) -> PageSummaries:
    """Summaries of the full groups of ``keys [..., N, D]`` (token-major): ``N // (m * S)`` groups."""
    gcfg = group_config(config)
    ng = keys.shape[-2] // gcfg.page_size
    full = keys[..., : ng * gcfg.page_size, :].float()
    return build_summaries(full.unflatten(-2, (ng, gcfg.page_size)), gcfg)


def hierarchical_ranking(page_scores: torch.Tensor, group_scores: torch.Tensor,
                         config: LocksConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ranking [..., Pc], scores [..., G, Pc])``: the combined ranking of the full pages
    (``-inf`` outside the candidates) and the page scores a kernel would have read (the
    candidates', ``-inf`` elsewhere; what the exact re-rank starts from).

    page_scores float32 ``[..., G, Pc]`` (Eq. 4 on the page summaries; only the candidates'
    entries are read), group_scores float32 ``[..., G, NG]`` (Eq. 4 on the group summaries,
    NG = Pc // m full groups).
    """
    m, pc, ng = config.group_pages, page_scores.shape[-1], group_scores.shape[-1]
    keep = config.groups_kept(ng)
    granking = combine_group(group_scores, config.combine)  # [..., NG]
    kept = torch.zeros_like(granking, dtype=torch.bool)
    if keep:
        kept.scatter_(-1, torch.topk(granking, keep, dim=-1).indices, True)
    cand = torch.ones(*kept.shape[:-1], pc, dtype=torch.bool, device=kept.device)  # the tail: always
    cand[..., : ng * m] = kept.repeat_interleave(m, dim=-1)
    pages = page_scores.float().masked_fill(~cand.unsqueeze(-2), NEG_INF)
    others = group_scores.float().masked_fill(kept.unsqueeze(-2), NEG_INF)  # stand-ins for unread pages
    combined = combine_group(torch.cat([pages, others], dim=-1), config.combine)[..., :pc]
    return torch.where(torch.isneginf(pages).all(dim=-2), NEG_INF, combined), pages


def hierarchical_page_scores(queries: torch.Tensor, keys: torch.Tensor, summaries: PageSummaries,
                             config: LocksConfig, *, scale: float, token_mask=None,
                             groups: PageSummaries | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(page_scores [..., G, Pc], group_scores [..., G, NG])`` for :func:`hierarchical_ranking`,
    from the page summaries and the group summaries ``groups`` (a cache's, kept as pages fill;
    built here from ``keys [..., N, D]`` when None)."""
    gs = group_summaries(keys, config) if groups is None else groups
    if gs.num_pages != keys.shape[-2] // (config.group_pages * config.page_size):
        raise ValueError(f"{gs.num_pages} group summaries for {keys.shape[-2]} keys: expected one per full "
                         f"group of {config.group_pages * config.page_size} keys")
    gmask = None
    if token_mask is not None:
        size = config.group_pages * config.page_size
        ng = gs.num_pages
        gmask = token_mask[..., : ng * size].unflatten(-1, (ng, size))
    groups = score_pages_from_summaries(queries, gs, scale=scale, token_mask=gmask)
    pmask = None
    if token_mask is not None:
        pc = summaries.num_pages
        pmask = token_mask[..., : pc * config.page_size].unflatten(-1, (pc, config.page_size))
    pages = score_pages_from_summaries(queries, summaries, scale=scale, token_mask=pmask)
    return pages, groups
