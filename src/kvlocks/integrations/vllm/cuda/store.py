"""The CUDA backend's summary store (:class:`CudaSummaryStore`): the tagged store of
:mod:`kvlocks.integrations.vllm.store` over one layer's FlashAttention cache, where a block is a
page (block_size 16 = page_size) and a block table is the rows' page table. For CUDA tensors the
tag updates and checks are the Triton kernels below; the decode path never reads tags on the host.

Eager steps (prefill, mixed batches, any step outside a CUDA graph) call :meth:`ensure_async`:
every full page of every row whose tags do not match is rebuilt, on the device and without a host
sync (one build launch over the rows' pages up to the step's longest row, the valid ones skipped);
:meth:`ensure` does the same with a host sync and counts the builds per row (traces). Steps inside a captured graph
call :meth:`build_new`: the page each row's new token filled is built and tagged, on the device.
Together they keep every full page of every row valid before scoring; :meth:`check_tags` (debug)
counts the pages that break it, :meth:`verify_used` (debug) the summaries whose keys changed since
their build (``counters``: tag mismatches, stale summaries used, pages checked, LOCKS rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlocks.config import LocksConfig
from kvlocks.integrations.vllm.store import EXTERNAL, TaggedSummaryStore
from kvlocks.pages import full_pages
from kvlocks.plan import paged_build, paged_build_new

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


class CudaSummaryStore(TaggedSummaryStore):
    """Summaries and validity tags for every block of one layer's paged cache.

    Parameters
    ----------
    config : LocksConfig (page_size must equal the kernel block size)
    num_blocks, block_size : the layer's cache geometry (``block_size == config.page_size``)
    num_kv_heads, head_dim : Hkv, D (this worker's heads)
    device, backend, verify, ignore_tags : as :class:`~kvlocks.integrations.vllm.store.TaggedSummaryStore`
    """

    def __init__(self, config: LocksConfig, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device, *, backend: str | None = None, verify: bool = False, ignore_tags: bool = False) -> None:
        if block_size != config.page_size:
            raise ValueError(f"vLLM kernel block_size={block_size}: the LOCKS CUDA backend needs block_size == "
                             f"LocksConfig.page_size={config.page_size} (one block per page)")
        super().__init__(config, num_blocks, num_kv_heads, head_dim, device, backend=backend, verify=verify,
                         ignore_tags=ignore_tags)
        self.num_blocks = num_blocks
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=self.device)
        self.async_builds = torch.zeros((), dtype=torch.int64, device=self.device)  # ensure_async's builds

    def ensure_async(self, k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     max_len: int) -> None:
        """:meth:`ensure` without a host sync: ``max_len`` (host) bounds the rows' lengths, and the
        build launch covers every full page of the rows' first ``ceil(max_len / S)`` logical pages,
        those whose tags match skipped by the kernel. A page two rows share is built by both (the
        same summary); ``async_builds`` counts (row, page) builds on the device."""
        found = self.stale_pages(block_table, seq_lens, max_len)
        if found is None:
            return
        stale, pid, logical = found
        paged_build(k_cache, self.summaries, torch.where(stale, pid, -1).flatten().to(torch.int32), self.config,
                    backend=self.backend)
        target = torch.where(stale, pid, self.trash).flatten()  # tags of the pages built; the rest to trash
        self.built_gen[target] = self.write_gen[target]
        self.built_page[target] = logical.expand_as(pid).flatten()
        if self.fingerprints is not None:
            self.fingerprints[target] = self._hash(k_cache, target.clamp_max(self.num_blocks - 1))
        self.async_builds += stale.sum()

    def note_writes(self, slot_mapping: torch.Tensor) -> None:
        """vLLM wrote K/V at ``slot_mapping [T]`` (int64, -1 = padding): bump those pages' generation."""
        if self.backend != "triton":
            return super().note_writes(slot_mapping)
        t = slot_mapping.shape[0]
        if t:
            _note_writes_kernel[(triton.cdiv(t, _BLOCK),)](slot_mapping, t, self.config.page_size, self.write_gen,
                                                          BLOCK=_BLOCK)

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
            self.counters[0] += (full & self.invalid(pid, logical)).sum()
            self.counters[2] += full.sum()
        self.counters[3] += (lens > 0).sum()

    def verify_used(self, k_cache: torch.Tensor, block_table: torch.Tensor, lens: torch.Tensor,
                    width: int | None = None) -> None:
        """Debug: count, into ``counters``, full pages (of rows with ``lens > 0``) whose keys changed
        since their summary was built (:meth:`stale_used`; usable inside a graph)."""
        if self.fingerprints is not None:
            self.counters[1] += self.stale_used(k_cache, block_table, lens, width).sum()
