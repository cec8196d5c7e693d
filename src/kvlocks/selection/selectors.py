"""Selectors: how per-head page scores are obtained. Combine and top-k are shared by all.

A selector maps a decode step's queries and one layer's cache state to per-head page scores
``[..., G, Pc]`` over the full pages; :func:`choose_pages` then applies the configured GQA
combine rule and the sink + recent + top-(k-2) rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvlocks.config import LocksConfig
from kvlocks.scoring.reference import combine_group, exact_page_lse, score_pages_from_summaries
from kvlocks.selection.topk import select_top_pages
from kvlocks.summary.types import PageSummaries


@dataclass
class LayerView:
    """What a selector may look at for one layer at one decode step.

    keys : ``[..., N, D]`` token-major post-RoPE keys (only the oracle reads them)
    summaries : PageSummaries of the ``N // S`` full pages, or ``None``
    token_mask : bool ``[..., N]`` (True = real token) or ``None`` (no padding)
    scale : softmax scale of the model (``1/sqrt(D)`` for most models)
    """

    keys: torch.Tensor
    summaries: PageSummaries | None
    token_mask: torch.Tensor | None
    scale: float


class Selector(Protocol):
    name: str
    needs_summaries: bool
    reads_all_keys: bool

    def page_scores(self, queries: torch.Tensor, view: LayerView, config: LocksConfig) -> torch.Tensor:
        """queries ``[..., G, D]`` -> float32 ``[..., G, Pc]`` log-mass scores of the full pages."""


def _page_mask(view: LayerView, page_size: int, pc: int) -> torch.Tensor | None:
    if view.token_mask is None:
        return None
    return view.token_mask[..., : pc * page_size].unflatten(-1, (pc, page_size))  # [..., Pc, S]


class LocksSelector:
    """Eq. 4 scores from the quantized page summaries only."""

    name = "locks"
    needs_summaries = True
    reads_all_keys = False

    def page_scores(self, queries, view, config):
        s = view.summaries
        return score_pages_from_summaries(
            queries, s, scale=view.scale, token_mask=_page_mask(view, config.page_size, s.num_pages)
        )


class OracleSelector:
    """Exact per-page log-sum-exp mass (reads every key): the selection ceiling."""

    name = "oracle"
    needs_summaries = False
    reads_all_keys = True

    def page_scores(self, queries, view, config):
        pc = view.keys.shape[-2] // config.page_size
        return exact_page_lse(
            queries, view.keys, config.page_size, scale=view.scale,
            token_mask=_page_mask(view, config.page_size, pc),
        )


SELECTORS: dict[str, Selector] = {s.name: s for s in (LocksSelector(), OracleSelector())}


def get_selector(name: str) -> Selector:
    try:
        return SELECTORS[name]
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; allowed {sorted(SELECTORS)}") from None


def choose_pages(queries: torch.Tensor, view: LayerView, config: LocksConfig, selector: Selector) -> torch.Tensor:
    """Pages to attend at this step: int64 ``[..., K]`` ascending, ``K = min(k, total pages)``."""
    n = view.keys.shape[-2]
    s = config.page_size
    pc, total = n // s, -(-n // s)
    sink_start = None
    if pc == 0:
        ranking = queries.new_zeros((*queries.shape[:-2], 0), dtype=torch.float32)
    else:
        scores = selector.page_scores(queries, view, config)  # [..., G, Pc]
        ranking = combine_group(scores, config.combine)  # [..., Pc]
        ranking = torch.where(torch.isneginf(scores).all(dim=-2), float("-inf"), ranking)
    if view.token_mask is not None:
        sink_start = view.token_mask.float().argmax(dim=-1) // s  # first real token's page
    return select_top_pages(
        ranking, total, config.pages_per_step,
        sink_pages=config.sink_pages, recent_pages=config.recent_pages, sink_start=sink_start,
    )
