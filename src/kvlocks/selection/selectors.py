"""Selectors: how per-head page scores are obtained. Combine and top-k are shared by all.

A selector maps a decode step's queries and one layer's cache state to per-head page scores
``[..., G, Pc]`` over the full pages; :func:`choose_pages` then applies the configured GQA
combine rule and the sink + recent + top-(k-2) rule.

The product's selectors are ``locks`` and ``oracle`` (both here). Other packages add selectors
by name through the ``kvlocks.selectors`` entry-point group (``name = "module:Class"``, a class
whose no-argument instance uses its defaults): the lab registers its baselines that way
(``oracle_per_head``, ``quest``, ``loki``, ``shadowkv``, ``centroid``, ``streaming``, ``random``:
:mod:`kvlocks_lab.selectors`). To use other settings (a Loki calibration, a rank, a seed), pass an
instance instead of a name, e.g. ``LocksCache(model.config, method=selector)``.

A selector may define ``prepare(model, tokenizer, prompt) -> Selector``: the CLI calls it before a
run, for selectors that must be fitted on other text than the prompt (Loki's calibration).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Protocol

import torch

from kvlocks.config import LocksConfig
from kvlocks.pages import full_pages, num_pages
from kvlocks.scoring.reference import (
    combine_group, exact_page_lse, score_pages_from_centroids, score_pages_from_summaries,
)
from kvlocks.selection.pages import page_mask
from kvlocks.selection.rerank import rerank_ranking
from kvlocks.selection.topk import select_top_pages
from kvlocks.summary.types import PageSummaries


@dataclass
class LayerView:
    """What a selector may look at for one layer at one decode step.

    keys : ``[..., N, D]`` token-major post-RoPE keys (only the oracle reads them)
    summaries : PageSummaries of the ``N // S`` full pages, or ``None``
    token_mask : bool ``[..., N]`` (True = real token) or ``None`` (no padding)
    scale : softmax scale of the model (``1/sqrt(D)`` for most models)
    layer : index of the layer in the model, or ``None`` (selectors with per-layer state, such as
        Loki's calibration, need it; the HF decode path sets it)
    """

    keys: torch.Tensor
    summaries: PageSummaries | None
    token_mask: torch.Tensor | None
    scale: float
    layer: int | None = None


class Selector(Protocol):
    """What every selector provides.

    ``needs_summaries``: the cache must build LOCKS :class:`PageSummaries` for it.
    ``reads_all_keys``: scoring reads every key (byte accounting counts all keys).

    Optional members:

    - ``per_head`` (default False): each query head selects its own pages; :func:`choose_pages`
      then returns ``[..., G, K]`` (see :mod:`kvlocks_lab.selectors.oracle_per_head`);
    - ``rank_pages(queries, view, config) -> (ranking [..., Pc], scores [..., G, Pc])``: a selector
      that combines the query heads its own way (see :mod:`kvlocks_lab.selectors.hier`) returns
      its ranking and the per-head scores an exact re-rank starts from, as :func:`rank_pages` does;
    - ``bytes_per_page(config, head_dim, elem_size) -> (payload, scales)`` and
      ``selection_bytes(config, head_dim, elem_size, full_pages) -> float``: the bytes a selector
      with its own resident summary reads per page and per step (one KV head).
    """

    name: str
    needs_summaries: bool
    reads_all_keys: bool

    def page_scores(self, queries: torch.Tensor, view: LayerView, config: LocksConfig) -> torch.Tensor:
        """queries ``[..., G, D]`` -> float32 ``[..., G, Pc]`` log-mass scores of the full pages."""


def _page_mask(view: LayerView, page_size: int, pc: int) -> torch.Tensor | None:
    return page_mask(view.token_mask, page_size, pc)  # [..., Pc, S] or None


class LocksSelector:
    """Eq. 4 scores from the quantized page summaries only (from their centroids alone with
    ``config.rerank_scores == "centroid"``, where they only choose the re-rank's candidates)."""

    name = "locks"
    needs_summaries = True
    reads_all_keys = False

    def page_scores(self, queries, view, config):
        s = view.summaries
        score = score_pages_from_centroids if config.rerank_scores == "centroid" else score_pages_from_summaries
        return score(queries, s, scale=view.scale, token_mask=_page_mask(view, config.page_size, s.num_pages))


class OracleSelector:
    """Exact per-page log-sum-exp mass (reads every key): the selection ceiling."""

    name = "oracle"
    needs_summaries = False
    reads_all_keys = True

    def page_scores(self, queries, view, config):
        pc = full_pages(view.keys.shape[-2], config.page_size)
        return exact_page_lse(
            queries, view.keys, config.page_size, scale=view.scale,
            token_mask=_page_mask(view, config.page_size, pc),
        )


SELECTORS: dict[str, Selector] = {s.name: s for s in (LocksSelector(), OracleSelector())}
ENTRY_POINT_GROUP = "kvlocks.selectors"


@lru_cache(maxsize=1)
def _registered() -> dict:
    """Entry points of the ``kvlocks.selectors`` group by name (not loaded)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in SELECTORS}


def selector_names() -> tuple[str, ...]:
    """Every selector name :func:`get_selector` knows: the product's and the registered ones."""
    return tuple(sorted({*SELECTORS, *_registered()}))


@lru_cache(maxsize=None)
def _load(name: str) -> Selector:
    ep = _registered()[name]
    try:
        cls = ep.load()
    except ImportError as exc:
        raise ValueError(f"selector {name!r} ({ep.value}) cannot be imported: {exc}; "
                         "the lab's selectors need: pip install kvlocks-lab") from None
    return cls()


def get_selector(name: str) -> Selector:
    """The selector registered as ``name`` (with its defaults); ValueError naming the allowed ones."""
    if name in SELECTORS:
        return SELECTORS[name]
    if name in _registered():
        return _load(name)
    raise ValueError(f"unknown selector {name!r}; allowed {list(selector_names())}")


def rank_pages(queries: torch.Tensor, view: LayerView, config: LocksConfig, selector: Selector):
    """The combined ranking of the full pages and the per-head scores an exact re-rank starts from.

    queries ``[..., G, D]`` -> ``(ranking [..., Pc], scores [..., G, Pc] or None)``: float32; a page no
    query head can score (padding only) ranks ``-inf``; ``scores`` is None where the re-rank does not
    apply (:func:`reranks`). Not for ``per_head`` selectors.
    The decode plan takes both (:meth:`kvlocks.plan.DecodePlan.run_ranked`); :func:`choose_pages` is
    the token-major reference.
    """
    own = getattr(selector, "rank_pages", None)
    if own is not None:  # a selector with its own combine
        ranking, scores = own(queries, view, config)
    else:
        scores = selector.page_scores(queries, view, config)  # [..., G, Pc]
        ranking = combine_group(scores, config.combine)  # [..., Pc]
        ranking = torch.where(torch.isneginf(scores).all(dim=-2), float("-inf"), ranking)
    return ranking, (scores if reranks(config, selector) else None)


def reranks(config: LocksConfig, selector: Selector) -> bool:
    """Whether the exact re-rank runs after ``selector``: ``config.rerank`` on and a selector that
    does not read every key; for a selector other than LOCKS only where the configuration set the
    re-rank (a baseline runs as published unless asked: the default rule is LOCKS's)."""
    if not config.rerank or selector.reads_all_keys:
        return False
    return isinstance(selector, LocksSelector) or not config.rerank_auto


def choose_pages(queries: torch.Tensor, view: LayerView, config: LocksConfig, selector: Selector) -> torch.Tensor:
    """Pages to attend at this step: int64 ``[..., K]`` ascending, ``K = min(k, total pages)``.

    For a ``per_head`` selector, each query head ranks its own scores (no combine rule) and the
    result is int64 ``[..., G, K]``.
    """
    n = view.keys.shape[-2]
    s = config.page_size
    pc, total = full_pages(n, s), num_pages(n, s)
    per_head = getattr(selector, "per_head", False)
    lead = queries.shape[:-1] if per_head else queries.shape[:-2]  # [..., G] or [...]
    sink_start = None
    if view.token_mask is not None:
        sink_start = view.token_mask.float().argmax(dim=-1) // s  # first real token's page
        sink_start = sink_start.unsqueeze(-1).expand(lead) if per_head else sink_start
    scores = None
    if pc == 0:
        ranking = queries.new_zeros((*lead, 0), dtype=torch.float32)
    elif per_head:
        ranking = selector.page_scores(queries, view, config)  # [..., G, Pc]
    else:
        ranking, scores = rank_pages(queries, view, config, selector)
    if scores is not None:  # exact masses of the candidates
        ranking = rerank_ranking(queries, view.keys, scores, ranking, config, scale=view.scale, total_pages=total,
                                 token_mask=view.token_mask, sink_start=sink_start)
    return select_top_pages(
        ranking, total, config.pages_per_step,
        sink_pages=config.sink_pages, recent_pages=config.recent_pages, sink_start=sink_start,
    )
