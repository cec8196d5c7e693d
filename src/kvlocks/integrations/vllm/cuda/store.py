"""LOCKS summaries beside one layer's FlashAttention paged cache, with device-side validity tags.

A vLLM kernel block is a LOCKS page (block_size 16 = page_size), so the physical page id of a
summary is the block id. The tags are those of :mod:`kvlocks.integrations.vllm.cpu.store`, kept on the
device so that the decode path never reads them on the host:

- ``write_gen[p]`` int32: bumped by every cache write to block ``p`` (:meth:`note_writes`, from the
  slot mapping of every ``do_kv_cache_update``); a freed block reused for other tokens is rewritten,
  so its generation moves on;
- ``built_gen[p]``, ``built_page[p]`` int32: the generation and the logical page the summary was
  built from (``EXTERNAL`` for pages a KV connector wrote whole: position not recorded).

A summary serves logical page ``j`` iff ``built_gen == write_gen`` and ``built_page`` is ``j`` or
``EXTERNAL``. Entry ``num_blocks`` is a trash slot for writes of masked-out rows.

Building. Eager steps (prefill, mixed batches, any step outside a CUDA graph) call :meth:`ensure`:
every full page of every row of the batch whose tags do not match is rebuilt (one host sync). Steps
inside a captured graph call :meth:`build_new`: the page each row's new token filled is built and
tagged, on the device. Together they keep the invariant that, before scoring, every full page of
every row has a valid summary; :meth:`check_tags` (debug) counts the pages that break it, and
:meth:`verify_used` (debug) compares a hash of the keys a summary was built from with the keys in
its page now (``counters``: tag mismatches, stale summaries used, pages checked, LOCKS rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlocks.summary.store import SummaryStore
from kvlocks.config import LocksConfig
from kvlocks.pages import full_pages
from kvlocks.plan import paged_build, paged_build_new, resolve_backend

EXTERNAL = -2  # built_page of a page built right after a connector wrote it whole
COUNTERS = ("tag_mismatches", "stale_used", "pages_checked", "locks_rows")
_BLOCK = 256


@triton.jit
def _note_writes_kernel(slot_ptr, n, S: tl.constexpr, gen_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    slot = tl.load(slot_ptr + offs, mask=ok, other=-1).to(tl.int64)
    ok = ok & (slot >= 0)
    tl.atomic_add(gen_ptr + tl.where(ok, slot // S, 0), tl.full([BLOCK], 1, tl.int32), mask=ok)


@triton.jit
def _mark_new_kernel(lens_ptr, bt_ptr, stride_bt, n_rows, S: tl.constexpr, wg_ptr, bg_ptr, bp_ptr,
                     BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n_rows
    n = tl.load(lens_ptr + rows, mask=ok, other=0)
    filled = ok & (n > 0) & (n % S == 0)
    page = tl.maximum(n // S - 1, 0)
    phys = tl.load(bt_ptr + rows.to(tl.int64) * stride_bt + page, mask=filled, other=0).to(tl.int64)
    gen = tl.load(wg_ptr + phys, mask=filled, other=0)
    tl.store(bg_ptr + phys, gen, mask=filled)
    tl.store(bp_ptr + phys, page, mask=filled)


@triton.jit
def _check_kernel(lens_ptr, bt_ptr, stride_bt, width, S: tl.constexpr, wg_ptr, bg_ptr, bp_ptr, cnt_ptr,
                  EXT: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(lens_ptr + b)
    full = (p < n // S) & (p < width)
    phys = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + p, mask=full, other=0).to(tl.int64)
    wg = tl.load(wg_ptr + phys, mask=full, other=0)
    bg = tl.load(bg_ptr + phys, mask=full, other=0)
    bp = tl.load(bp_ptr + phys, mask=full, other=0)
    bad = full & ((bg != wg) | ((bp != p) & (bp != EXT)))
    tl.atomic_add(cnt_ptr, tl.sum(bad.to(tl.int64), axis=0))
    tl.atomic_add(cnt_ptr + 2, tl.sum(full.to(tl.int64), axis=0))


class CudaSummaryStore:
    """Summaries and validity tags for every block of one layer's paged cache.

    Parameters
    ----------
    config : LocksConfig (page_size must equal the kernel block size)
    num_blocks, block_size : the layer's cache geometry (``block_size == config.page_size``)
    num_kv_heads, head_dim : Hkv, D (this worker's heads)
    device : the cache's device
    backend : ``"triton"`` / ``"torch"`` / None (Triton for CUDA tensors)
    verify : keep a hash of the keys each summary was built from (:meth:`verify_used`; slow)
    ignore_tags : trust any summary once built (negative control for the tests)
    """

    def __init__(self, config: LocksConfig, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device, *, backend: str | None = None, verify: bool = False, ignore_tags: bool = False) -> None:
        if block_size != config.page_size:
            raise ValueError(f"vLLM kernel block_size={block_size}: the LOCKS CUDA backend needs block_size == "
                             f"LocksConfig.page_size={config.page_size} (one block per page)")
        self.config, self.num_blocks, self.device = config, num_blocks, torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        self.summaries = SummaryStore.empty(num_blocks, num_kv_heads, head_dim, config, device=self.device)
        n, i32 = num_blocks + 1, dict(dtype=torch.int32, device=self.device)
        self.trash = num_blocks
        self.write_gen = torch.zeros(n, **i32)
        self.built_gen = torch.full((n,), -1, **i32)
        self.built_page = torch.full((n,), -1, **i32)
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=self.device)
        self.ignore_tags = ignore_tags
        self.builds = 0  # pages built by eager steps (host count)
        self.fingerprints = self.weights = None
        if verify:
            self.fingerprints = torch.zeros(n, dtype=torch.int64, device=self.device)
            gen = torch.Generator().manual_seed(0)
            w = torch.randint(1, 2**40, (config.page_size * num_kv_heads * head_dim,), generator=gen) * 2 + 1
            self.weights = w.to(self.device)  # odd int64 weights of a linear hash over the key bits

    def nbytes(self) -> int:
        s = self.summaries
        n = s.num_pages * s.num_kv_heads * s.bytes_per_page_head()
        return n + sum(t.numel() * t.element_size() for t in (self.write_gen, self.built_gen, self.built_page))

    # ------------------------------------------------------------ tags (no host sync)

    def note_writes(self, slot_mapping: torch.Tensor) -> None:
        """vLLM wrote K/V at ``slot_mapping [T]`` (int64, -1 = padding): bump those pages' generation."""
        t = slot_mapping.shape[0]
        if t == 0:
            return
        if self.backend == "triton":
            _note_writes_kernel[(triton.cdiv(t, _BLOCK),)](slot_mapping, t, self.config.page_size, self.write_gen,
                                                          BLOCK=_BLOCK)
            return
        slots = slot_mapping.long()
        pids = torch.where(slots >= 0, slots // self.config.page_size, self.trash)
        self.write_gen.index_add_(0, pids, (slots >= 0).to(torch.int32))

    def build_new(self, k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Build and tag the page each row's last token filled (``seq_lens % S == 0``); device only.
        ``k_cache [NB, S, Hkv, D]``, ``block_table`` int32 ``[B, W]``, ``seq_lens`` int32 ``[B]``."""
        b = seq_lens.shape[0]
        paged_build_new(k_cache, self.summaries, block_table, seq_lens, self.config, backend=self.backend)
        if self.backend == "triton":
            _mark_new_kernel[(triton.cdiv(b, _BLOCK),)](seq_lens, block_table, block_table.stride(0), b,
                                                       self.config.page_size, self.write_gen, self.built_gen,
                                                       self.built_page, BLOCK=_BLOCK)
        else:
            target, page = self._filled(block_table, seq_lens)
            self.built_gen.index_copy_(0, target, self.write_gen[target])
            self.built_page.index_copy_(0, target, page.to(torch.int32))
        if self.fingerprints is not None:
            target, _ = self._filled(block_table, seq_lens)
            self.fingerprints.index_copy_(0, target, self._hash(k_cache, target.clamp_max(self.num_blocks - 1)))

    def _filled(self, block_table, seq_lens):
        """Physical page each row filled (trash where none) and its logical page."""
        s = self.config.page_size
        filled = (seq_lens > 0) & (seq_lens % s == 0)
        page = (full_pages(seq_lens, s) - 1).clamp_min(0).long()
        phys = block_table.gather(1, page[:, None])[:, 0].long()
        return torch.where(filled, phys, self.trash), page

    def check_tags(self, block_table: torch.Tensor, lens: torch.Tensor) -> None:
        """Debug: count, into ``counters``, full pages of rows with ``lens > 0`` whose tags do not match."""
        b, width = block_table.shape
        if self.backend == "triton":
            _check_kernel[(b, triton.cdiv(width, _BLOCK))](lens, block_table, block_table.stride(0), width,
                                                           self.config.page_size, self.write_gen, self.built_gen,
                                                           self.built_page, self.counters, EXT=EXTERNAL,
                                                           BLOCK=_BLOCK)
        else:
            full, pid, logical = self._full(block_table, lens, width)
            bp = self.built_page[pid]
            bad = full & ((self.built_gen[pid] != self.write_gen[pid]) | ((bp != logical) & (bp != EXTERNAL)))
            self.counters[0] += bad.sum()
            self.counters[2] += full.sum()
        self.counters[3] += (lens > 0).sum()

    def _full(self, block_table, lens, width):
        logical = torch.arange(width, device=block_table.device, dtype=torch.int32)  # [W]
        full = logical[None, :] < full_pages(lens, self.config.page_size)[:, None]  # [B, W]
        return full, block_table[:, :width].long(), logical[None, :]

    def verify_used(self, k_cache: torch.Tensor, block_table: torch.Tensor, lens: torch.Tensor,
                    width: int | None = None) -> None:
        """Debug: count full pages (of rows with ``lens > 0``) whose keys changed since their
        summary was built. Reads every such page (static shapes: usable inside a graph)."""
        if self.fingerprints is None:
            return
        full, pid, _ = self._full(block_table, lens, block_table.shape[1] if width is None else width)
        now = self._hash(k_cache, pid.clamp(0, self.num_blocks - 1))
        self.counters[1] += (full & (now != self.fingerprints[pid])).sum()

    def _hash(self, k_cache, pids):
        """int64 hash of the key bits of pages ``pids`` (any shape)."""
        x = k_cache[pids.flatten()]  # [m, S, Hkv, D]
        bits = x.view(torch.int16 if x.element_size() == 2 else torch.int32).to(torch.int64).flatten(1)
        return (bits * self.weights).sum(-1).view(pids.shape)

    # ------------------------------------------------------------ eager builds (host sync allowed)

    def ensure(self, k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               max_len: int) -> torch.Tensor:
        """Rebuild every full page of every row whose summary is not valid. ``max_len``: the
        longest row (host int). Returns the pages built per row (int64 ``[B]``, host)."""
        s, b = self.config.page_size, seq_lens.shape[0]
        width = min(full_pages(max_len, s), block_table.shape[1])
        if width == 0:
            return torch.zeros(b, dtype=torch.int64)
        full, pid, logical = self._full(block_table, seq_lens, width)
        if self.ignore_tags:
            stale = full & (self.built_page[pid] == -1)
        else:
            bp = self.built_page[pid]
            stale = full & ((self.built_gen[pid] != self.write_gen[pid]) | ((bp != logical) & (bp != EXTERNAL)))
        idx = stale.nonzero()  # [m, 2] (row, logical page): the host sync
        if not idx.shape[0]:
            return torch.zeros(b, dtype=torch.int64)
        ids, first = _unique_first(pid[idx[:, 0], idx[:, 1]])  # a page shared by two rows is built once
        self._build(k_cache, ids, idx[first, 1].to(torch.int32))
        return torch.bincount(idx[first, 0], minlength=b).cpu()  # pages built, counted at one row each

    def external_write(self, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> int:
        """After a write outside a forward pass (a KV connector's load): build the pages it wrote whole."""
        slots = slot_mapping.to(self.device).long()
        slots = slots[slots >= 0]
        if not slots.numel():
            return 0
        pages, counts = torch.unique(slots // self.config.page_size, return_counts=True)
        whole = pages[counts == self.config.page_size]
        if whole.numel():
            self._build(k_cache, whole, torch.full_like(whole, EXTERNAL, dtype=torch.int32))
        return int(whole.numel())

    def _build(self, k_cache, ids: torch.Tensor, logical: torch.Tensor) -> None:
        paged_build(k_cache, self.summaries, ids.to(torch.int32), self.config, backend=self.backend)
        ids = ids.long()
        self.built_gen[ids] = self.write_gen[ids]
        self.built_page[ids] = logical
        if self.fingerprints is not None:
            self.fingerprints[ids] = self._hash(k_cache, ids)
        self.builds += int(ids.numel())


def _unique_first(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct values of ``x [m]`` and the index of one occurrence of each."""
    uniq, inverse = torch.unique(x, return_inverse=True)
    first = torch.full((uniq.numel(),), x.numel(), dtype=torch.long, device=x.device)
    first.scatter_reduce_(0, inverse, torch.arange(x.numel(), device=x.device), reduce="amin")
    return uniq, first
