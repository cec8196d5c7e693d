"""Hierarchical scoring (``locks_hier``): group summaries choose where to look, page summaries what to read.

The full pages also form groups of ``m`` consecutive pages (:class:`Groups`), and each group has a
LOCKS summary of its own: the spectral summary (Algorithm 1) of its ``m * S`` keys as one
super-page, rank ``Groups.rank``, so its Eq. 4 score estimates the group's log-sum-exp attention
mass with the same error analysis as a page's (Theorem 1 with the group's tail energy). A step:

1. scores every full group by Eq. 4 on its group summary and combines the query heads (the
   configured GQA rule);
2. keeps the best ``keep * (k - sink - recent)`` groups; their pages and the pages not in any full
   group (the sequence's tail, fewer than ``m`` pages) are the candidates;
3. scores the candidates by Eq. 4 on their page summaries; the GQA combine runs over the
   candidates' page scores and the other groups' scores (each group standing in for its pages'
   mass in the combine's normalisers), and the selection takes sink + recent + the best
   candidates.

When the budget covers the context every page is selected, as in flat LOCKS. A research selector:
measured against flat LOCKS on the task suite, the group summaries blur needles that page
summaries keep (docs/evaluation.md), so the product's way to read fewer summaries at long contexts
is the two-tier centroid mode (``LocksConfig.rerank_scores="centroid"``). The selector builds the
group summaries from ``view.keys`` and keeps each layer's with the keys they were built from: a
group is built again only when its keys changed (compared exactly), so a decode step builds the
groups its new tokens filled. The byte accounting counts what a step reads (every group summary and
the candidates' page summaries).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlocks.config import LocksConfig
from kvlocks.scoring.reference import combine_group, score_pages_from_summaries
from kvlocks.summary.build import build_summaries
from kvlocks.summary.types import PageSummaries, summary_bytes

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Groups:
    """Page groups: ``pages`` consecutive full pages per group (2..256, at most 4096 tokens), the
    group summaries' ``rank`` (1..group tokens), and ``keep``: groups kept per free slot."""

    pages: int = 16
    rank: int = 8
    keep: int = 2

    def __post_init__(self):
        for name, low, high in (("pages", 2, 256), ("rank", 1, None), ("keep", 1, None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                allowed = f"an integer in {low}..{high}" if high else f"an integer >= {low}"
                raise ValueError(f"Groups.{name}={value!r}: allowed {allowed}")

    def config(self, config: LocksConfig) -> LocksConfig:
        """The configuration of the group summaries for pages of ``config``: super-pages of
        ``pages * page_size`` keys at ``rank``, with ``config``'s bit widths and combine rule."""
        size = self.pages * config.page_size
        if size > 4096:
            raise ValueError(f"Groups.pages={self.pages}: a group of pages * page_size = {size} tokens exceeds 4096")
        if self.rank > size:
            raise ValueError(f"Groups.rank={self.rank}: allowed 1..{size} (the tokens of a group)")
        return LocksConfig(page_size=size, rank=self.rank, budget=2 * size, basis_bits=config.basis_bits,
                           coef_bits=config.coef_bits, combine=config.combine, rerank=0)

    def kept(self, config: LocksConfig, full_groups: int) -> int:
        """Groups whose pages are scored, of ``full_groups``."""
        free = max(1, config.pages_per_step - config.sink_pages - config.recent_pages)
        return min(full_groups, self.keep * free)


def group_summaries(keys: torch.Tensor, config: LocksConfig, groups: Groups) -> PageSummaries:
    """Summaries of the full groups of ``keys [..., N, D]`` (token-major): ``N // (m * S)`` groups."""
    gcfg = groups.config(config)
    ng = keys.shape[-2] // gcfg.page_size
    full = keys[..., : ng * gcfg.page_size, :].float()
    return build_summaries(full.unflatten(-2, (ng, gcfg.page_size)), gcfg)


def hierarchical_ranking(page_scores: torch.Tensor, group_scores: torch.Tensor, config: LocksConfig,
                         groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ranking [..., Pc], scores [..., G, Pc])``: the combined ranking of the full pages
    (``-inf`` outside the candidates) and the page scores a kernel would have read (the
    candidates', ``-inf`` elsewhere; what an exact re-rank starts from).

    page_scores float32 ``[..., G, Pc]`` (Eq. 4 on the page summaries; only the candidates'
    entries are read), group_scores float32 ``[..., G, NG]`` (Eq. 4 on the group summaries,
    NG = Pc // m full groups).
    """
    m, pc, ng = groups.pages, page_scores.shape[-1], group_scores.shape[-1]
    keep = groups.kept(config, ng)
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
                             config: LocksConfig, groups: Groups, *, scale: float, token_mask=None,
                             built: PageSummaries | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(page_scores [..., G, Pc], group_scores [..., G, NG])`` for :func:`hierarchical_ranking`,
    from the page summaries and the group summaries of ``keys [..., N, D]`` (``built``, or built
    here when None)."""
    gs = group_summaries(keys, config, groups) if built is None else built
    size = groups.pages * config.page_size

    def mask(pages: int, tokens: int):
        return None if token_mask is None else token_mask[..., : pages * tokens].unflatten(-1, (pages, tokens))

    group_scores = score_pages_from_summaries(queries, gs, scale=scale, token_mask=mask(gs.num_pages, size))
    pc = summaries.num_pages
    page_scores = score_pages_from_summaries(queries, summaries, scale=scale, token_mask=mask(pc, config.page_size))
    return page_scores, group_scores


class HierSelector:
    """LOCKS with hierarchical scoring: groups of :class:`Groups` pages first, then their pages.

    It ranks the pages itself (``rank_pages``: the combine runs over the candidates' and the other
    groups' scores); an exact re-rank follows where the configuration sets ``rerank``."""

    name = "locks_hier"
    needs_summaries = True
    reads_all_keys = False

    def __init__(self, groups: Groups | None = None) -> None:
        self.groups = Groups() if groups is None else groups
        self._kept: dict = {}  # (layer, group config) -> (the full groups' keys, their summaries)

    def page_scores(self, queries, view, config):
        """The candidates' Eq. 4 page scores, ``-inf`` for the pages of the groups not kept."""
        return self.rank_pages(queries, view, config)[1]

    def rank_pages(self, queries, view, config):
        pages, groups = hierarchical_page_scores(queries, view.keys, view.summaries, config, self.groups,
                                                 scale=view.scale, token_mask=view.token_mask,
                                                 built=self._group_summaries(view, config))
        return hierarchical_ranking(pages, groups, config, self.groups)

    def _group_summaries(self, view, config: LocksConfig) -> PageSummaries:
        """The group summaries of ``view.keys``: the layer's kept ones for the leading groups whose
        keys are unchanged, built for the rest."""
        gcfg = self.groups.config(config)
        size = gcfg.page_size
        ng = view.keys.shape[-2] // size
        full = view.keys[..., : ng * size, :]
        key = (view.layer, gcfg)
        done, kept = 0, self._kept.get(key)
        m = 0 if kept is None else min(kept[0].shape[-2], full.shape[-2]) // size
        if m and kept[0].shape[:-2] == full.shape[:-2] and kept[0].dtype == full.dtype \
                and kept[0].device == full.device:
            same = (kept[0][..., : m * size, :] == full[..., : m * size, :]).unflatten(-2, (m, size))
            same = same.all(-1).all(-1).reshape(-1, m).all(0)  # [m]: the group's keys equal in every row
            done = m if bool(same.all()) else int((~same).nonzero()[0])
        if done == 0:
            summ = group_summaries(full, config, self.groups)
        else:
            summ = kept[1].select_pages(slice(0, done))
            if ng > done:
                summ = summ.cat(build_summaries(full[..., done * size :, :].float().unflatten(-2, (ng - done, size)),
                                                gcfg))
        self._kept[key] = (full.clone(), summ)
        return summ

    def selection_bytes(self, config: LocksConfig, head_dim: int, elem_size: int, full_pages: int) -> float:
        """Per step and KV head: every full group's summary and the candidates' page summaries."""
        gcfg = self.groups.config(config)
        ng = full_pages // self.groups.pages
        read = full_pages - (ng - self.groups.kept(config, ng)) * self.groups.pages
        page = sum(summary_bytes(config.page_size, config.rank, head_dim, config.basis_bits, config.coef_bits))
        group = sum(summary_bytes(gcfg.page_size, gcfg.rank, head_dim, gcfg.basis_bits, gcfg.coef_bits))
        return float(read * page + ng * group)
