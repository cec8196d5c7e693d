"""Page-aligned K/V storage for one layer, with its LOCKS summaries kept up to date.

Keys and values live in buffers ``[B, Hkv, capacity, D]`` whose token axis is a whole number of
pages (``[B, Hkv, capacity / S, S, D]`` viewed page-major). Appends write in place; capacity
doubles when full, so a decode step costs O(1) amortised copies. Whenever pages become full,
their summaries are built in one batch (all prompt pages at the end of prefill, then one page at
a time as decode fills them). The partial last page is never summarised.
"""

from __future__ import annotations

import torch

from kvlocks._checks import check_finite
from kvlocks.config import LocksConfig
from kvlocks.pages import full_pages, num_pages
from kvlocks.summary.build import build_summaries
from kvlocks.summary.types import PageSummaries


class PagedLayerStore:
    """K/V pages and summaries of one layer for a batch of sequences.

    Parameters
    ----------
    config : LocksConfig
    build : bool
        Whether to maintain summaries (only selectors that read them need it).
    """

    def __init__(self, config: LocksConfig, *, build: bool) -> None:
        self.config = config
        self.build = build
        self._k: torch.Tensor | None = None  # [B, Hkv, capacity, D]
        self._v: torch.Tensor | None = None
        self.length = 0
        self.summaries: PageSummaries | None = None  # leading dims [B, Hkv], P = length // S
        self.build_calls = 0

    @property
    def keys(self) -> torch.Tensor:
        """``[B, Hkv, N, D]`` view of the stored keys."""
        return self._k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, :, : self.length]

    def paged_view(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The whole K/V buffers as a paged cache with one (sequence, KV head) per row: ``k_cache,
        v_cache [B * Hkv * width, S, 1, D]`` (views: the buffers are contiguous) and ``width``, the
        page slots per row (row ``r`` owns pages ``r * width .. r * width + width - 1``)."""
        b, hkv, cap, d = self._k.shape
        s = self.config.page_size
        width = cap // s
        return self._k.view(b * hkv * width, s, 1, d), self._v.view(b * hkv * width, s, 1, d), width

    def _ensure_capacity(self, k_new: torch.Tensor, v_new: torch.Tensor, need: int) -> None:
        s = self.config.page_size
        if self._k is None:
            cap = max(num_pages(need, s) * s, 4 * s)
            shape = (*k_new.shape[:2], cap, k_new.shape[-1])
            self._k = k_new.new_empty(shape)
            self._v = v_new.new_empty((*v_new.shape[:2], cap, v_new.shape[-1]))
            return
        if need <= self._k.shape[2]:
            return
        cap = max(need, 2 * self._k.shape[2])
        cap = num_pages(cap, s) * s
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], cap, old.shape[-1]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Append ``[B, Hkv, L, D]`` keys/values; build summaries of pages that became full."""
        if self._k is not None and (k_new.shape[:2] != self._k.shape[:2] or k_new.shape[-1] != self._k.shape[-1]):
            raise ValueError(f"new keys {tuple(k_new.shape)} do not match the cache's {tuple(self._k.shape)}")
        n_new = self.length + k_new.shape[2]
        self._ensure_capacity(k_new, v_new, n_new)
        self._k[:, :, self.length : n_new] = k_new
        self._v[:, :, self.length : n_new] = v_new
        self.length = n_new
        if self.build:
            self._build_new_pages()

    def _build_new_pages(self) -> None:
        s = self.config.page_size
        done = 0 if self.summaries is None else self.summaries.num_pages
        full = self.length // s
        if full <= done:
            return
        pages = self._k[:, :, done * s : full * s].unflatten(2, (full - done, s))  # [B, Hkv, p, S, D]
        check_finite("keys", pages)
        new = self._summarize(pages)
        self.summaries = new if self.summaries is None else self.summaries.cat(new)
        self.build_calls += 1

    def _summarize(self, pages: torch.Tensor) -> PageSummaries:
        """Summaries of full pages ``[B, Hkv, p, S, D]`` (a subclass may run a kernel)."""
        return build_summaries(pages, self.config)

    def _empty(self, config: LocksConfig, build: bool, **kwargs) -> "PagedLayerStore":
        return PagedLayerStore(config, build=build)

    def fork(self, config: LocksConfig, *, build: bool, **kwargs) -> "PagedLayerStore":
        """An independent copy (K/V cloned) for another method or config (``kwargs``: what a
        subclass's constructor takes besides).

        Summaries are shared when the summary settings match (they are never modified in place:
        appends concatenate), rebuilt from the keys when they differ, dropped when not needed.
        """
        new = self._empty(config, build, **kwargs)
        if self._k is not None:
            new._k, new._v = self._k.clone(), self._v.clone()
            new.length = self.length
        fields = ("page_size", "rank", "basis_bits", "coef_bits")
        same = self.summaries is not None and all(getattr(config, f) == getattr(self.config, f) for f in fields)
        if build:
            if same:
                new.summaries = self.summaries
            elif new.length:
                new._build_new_pages()
        return new

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (and the summaries of pages still full)."""
        self.length = min(self.length, length)
        if self.summaries is not None:
            keep = full_pages(self.length, self.config.page_size)
            self.summaries = self.summaries.select_pages(slice(0, keep))

    def index_batch(self, index: torch.Tensor) -> None:
        """Reorder / select / repeat sequences: row i becomes old row ``index[i]``."""
        if self._k is None:
            return
        self._k = self._k.index_select(0, index.to(self._k.device))
        self._v = self._v.index_select(0, index.to(self._v.device))
        if self.summaries is not None:
            self.summaries = self.summaries.index_lead(index)
