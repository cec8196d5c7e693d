"""LOCKS summaries beside vLLM's paged KV cache by physical page, with validity tags
(:class:`TaggedSummaryStore`): the summary store of both vLLM backends, one per layer.

A LOCKS page is ``S`` tokens; vLLM's cache slot ``s`` lies in physical page ``s // S`` (a CPU block
holds ``BS / S`` pages, :mod:`~kvlocks.integrations.vllm.cpu.store`; a CUDA block one). vLLM frees,
reuses and shares blocks (prefix caching), so a summary is used only when its tags (int32, on the
cache's device) match the current state of its page:

- ``write_gen[p]``: bumped by every cache write to page ``p`` (:meth:`~TaggedSummaryStore.note_writes`);
  a freed block reused for other tokens is rewritten, so its generation moves on;
- ``built_gen[p]``, ``built_page[p]``: the generation and the logical page the summary was built
  from (``EXTERNAL`` for pages a KV connector wrote whole: position not recorded).

A summary serves logical page ``j`` iff ``built_gen == write_gen`` and ``built_page`` is ``j`` or
``EXTERNAL``: a block shared through prefix caching is not rewritten and sits at the same logical
position, so its summary serves every sharer. Entry ``num_pages`` is a trash slot for writes of
masked-out rows. With ``verify`` (debug) a hash of the key bits each summary was built from is kept
(linear, odd random int64 weights: a change of any one element changes it), for
:meth:`~TaggedSummaryStore.stale_used`.
"""

from __future__ import annotations

import torch

from kvlocks.config import LocksConfig
from kvlocks.pages import full_pages
from kvlocks.plan import paged_build, resolve_backend
from kvlocks.summary.store import SummaryStore
from kvlocks.summary.types import summary_bytes

EXTERNAL = -2  # built_page of a page built right after a connector wrote it whole
TAG_BYTES_PER_PAGE = 3 * 4  # write_gen, built_gen, built_page: int32


def summary_bytes_per_token(config: LocksConfig, num_kv_heads: int, head_dim: int) -> float:
    """Summary + tag bytes per cached token per layer (compare: K+V bytes per token per layer
    ``2 * Hkv * D * dtype_size``)."""
    per_page_head = sum(summary_bytes(config.page_size, config.rank, head_dim, 4, 8))  # the store's int4/int8
    return (num_kv_heads * per_page_head + TAG_BYTES_PER_PAGE) / config.page_size


class TaggedSummaryStore:
    """Summaries and validity tags for every physical page of one layer's paged cache.

    Parameters
    ----------
    config : LocksConfig (int4 basis, int8 coefficients: the paged store's format)
    num_pages : physical pages of the layer's cache
    num_kv_heads, head_dim : Hkv, D (this worker's heads)
    device : the cache's device
    backend : ``"triton"`` / ``"torch"`` / None (Triton for CUDA tensors): how summaries are built
    verify : keep a hash of the keys each summary was built from (:meth:`stale_used`; slow)
    ignore_tags : trust any summary once built (negative control for the tests)

    ``keys`` arguments: the key half of the cache as the plan's paged cache ``[num_pages, S, Hkv, D]``,
    a tensor or an object with ``shape``, ``dtype``, ``device`` and ``index_select(0, pages [m])``
    (:class:`~kvlocks.integrations.vllm.cpu.store.PagedBlocks`).
    """

    def __init__(self, config: LocksConfig, num_pages: int, num_kv_heads: int, head_dim: int, device="cpu", *,
                 backend: str | None = None, verify: bool = False, ignore_tags: bool = False) -> None:
        self.config, self.num_pages, self.device = config, num_pages, torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        self.summaries = SummaryStore.empty(num_pages, num_kv_heads, head_dim, config, device=self.device)
        n, i32 = num_pages + 1, dict(dtype=torch.int32, device=self.device)
        self.trash = num_pages
        self.write_gen = torch.zeros(n, **i32)
        self.built_gen = torch.full((n,), -1, **i32)
        self.built_page = torch.full((n,), -1, **i32)
        self.ignore_tags = ignore_tags
        self.builds = 0  # pages built by ensure / external_write (host count)
        self.fingerprints = self.weights = None
        if verify:
            self.enable_verification()

    def nbytes(self) -> int:
        s = self.summaries
        n = s.num_pages * s.num_kv_heads * s.bytes_per_page_head()
        return n + sum(t.numel() * t.element_size() for t in (self.write_gen, self.built_gen, self.built_page))

    def enable_verification(self) -> None:
        """From now on, remember a hash of the keys each summary is built from (:meth:`stale_used`)."""
        s = self.summaries
        self.fingerprints = torch.zeros(self.num_pages + 1, dtype=torch.int64, device=self.device)
        gen = torch.Generator().manual_seed(0)
        w = torch.randint(1, 2**40, (s.page_size * s.num_kv_heads * s.head_dim,), generator=gen) * 2 + 1
        self.weights = w.to(self.device)  # odd int64 weights of a linear hash over the key bits

    # ------------------------------------------------------------ tags (no host sync)

    def note_writes(self, slot_mapping: torch.Tensor) -> None:
        """vLLM wrote K/V at ``slot_mapping [T]`` (int, negative = padding): bump those pages' generation."""
        slots = slot_mapping.to(self.device).long()
        pids = torch.where(slots >= 0, slots // self.config.page_size, self.trash)
        self.write_gen.index_add_(0, pids, (slots >= 0).to(torch.int32))

    def invalid(self, pid: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        """Bool: the summary of physical page ``pid`` (int64, any shape) cannot serve logical page
        ``logical`` (int32, broadcast with ``pid``)."""
        bp = self.built_page[pid]
        return (self.built_gen[pid] != self.write_gen[pid]) | ((bp != logical) & (bp != EXTERNAL))

    def _full(self, table: torch.Tensor, lens: torch.Tensor, width: int):
        """``(full bool [B, W], pid int64 [B, W], logical int32 [1, W])`` of the first ``width``
        logical pages of ``table [B, >= W]`` (physical page ids) for rows of ``lens [B]`` tokens."""
        logical = torch.arange(width, device=table.device, dtype=torch.int32)  # [W]
        full = logical[None, :] < full_pages(lens, self.config.page_size)[:, None]  # [B, W]
        return full, table[:, :width].long(), logical[None, :]

    def stale_used(self, keys, table: torch.Tensor, lens: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """Verification: per row (int64 ``[B]``, on the device), the full pages of ``table [B, W]``
        whose keys changed since their summary was built (zeros without verification). Reads every
        page of the table's first ``width`` columns (static shapes: usable inside a graph)."""
        if self.fingerprints is None:
            return torch.zeros(table.shape[0], dtype=torch.int64, device=self.device)
        full, pid, _ = self._full(table, lens, table.shape[1] if width is None else width)
        now = self._hash(keys, pid.clamp(0, self.num_pages - 1))
        return (full & (now != self.fingerprints[pid])).sum(1)

    def _hash(self, keys, pids: torch.Tensor) -> torch.Tensor:
        """int64 hash of the key bits of pages ``pids`` (any shape)."""
        x = keys.index_select(0, pids.flatten())  # [m, S, Hkv, D]
        bits = x.view(torch.int16 if x.element_size() == 2 else torch.int32).to(torch.int64).flatten(1)
        return (bits * self.weights).sum(-1).view(pids.shape)

    # ------------------------------------------------------------ builds (host sync allowed)

    def stale_pages(self, table: torch.Tensor, lens: torch.Tensor, max_len: int):
        """``(stale bool [B, W], pid int64 [B, W], logical int32 [1, W])`` over the rows' first ``W``
        logical pages (``W``: the full pages of ``max_len`` tokens, host; at most the table's width):
        full pages whose summary is not valid (with ``ignore_tags``: never built); None when
        ``W`` is 0. No host sync."""
        width = min(full_pages(max_len, self.config.page_size), table.shape[1])
        if width == 0:
            return None
        full, pid, logical = self._full(table, lens, width)
        return full & ((self.built_page[pid] == -1) if self.ignore_tags else self.invalid(pid, logical)), pid, logical

    def ensure(self, keys, table: torch.Tensor, lens: torch.Tensor, max_len: int) -> torch.Tensor:
        """Rebuild every full page of every row whose summary is not valid. ``table [B, W]``: the
        rows' physical page ids by logical page; ``lens [B]``: their tokens; ``max_len``: the
        longest row (host int). Returns the pages built per row (int64 ``[B]``, host; a page two
        rows share is built once, counted at the first)."""
        b = lens.shape[0]
        found = self.stale_pages(table, lens, max_len)
        if found is None:
            return torch.zeros(b, dtype=torch.int64)
        stale, pid, _ = found
        idx = stale.nonzero()  # [m, 2] (row, logical page): the host sync
        if not idx.shape[0]:
            return torch.zeros(b, dtype=torch.int64)
        ids, first = _unique_first(pid[idx[:, 0], idx[:, 1]])
        self._build(keys, ids, idx[first, 1].to(torch.int32))
        return torch.bincount(idx[first, 0], minlength=b).cpu()

    def external_write(self, keys, slot_mapping: torch.Tensor) -> int:
        """After a write outside a forward pass (a KV connector's load): build the pages it wrote
        whole (tagged ``EXTERNAL``). Returns their number."""
        slots = slot_mapping.to(self.device).long()
        slots = slots[slots >= 0]
        if not slots.numel():
            return 0
        pages, counts = torch.unique(slots // self.config.page_size, return_counts=True)
        whole = pages[counts == self.config.page_size]
        if whole.numel():
            self._build(keys, whole, torch.full_like(whole, EXTERNAL, dtype=torch.int32))
        return int(whole.numel())

    def _build(self, keys, ids: torch.Tensor, logical: torch.Tensor) -> None:
        """Build physical pages ``ids [m]`` and tag them as built from logical pages ``logical [m]``."""
        paged_build(keys, self.summaries, ids.to(torch.int32), self.config, backend=self.backend)
        ids = ids.long()
        self.built_gen[ids] = self.write_gen[ids]
        self.built_page[ids] = logical
        if self.fingerprints is not None:
            self.fingerprints[ids] = self._hash(keys, ids)
        self.builds += int(ids.numel())


def _unique_first(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct values of ``x [m]`` and the index of one occurrence of each (the first)."""
    uniq, inverse = torch.unique(x, return_inverse=True)
    first = torch.full((uniq.numel(),), x.numel(), dtype=torch.long, device=x.device)
    first.scatter_reduce_(0, inverse, torch.arange(x.numel(), device=x.device), reduce="amin")
    return uniq, first
