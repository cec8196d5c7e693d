"""LOCKS summaries beside vLLM's paged KV cache, indexed by physical block id, with validity tags,
and the CPU backend's decode step over that cache (:func:`decode_rows`).

Pages and blocks. A LOCKS page is ``S = page_size`` tokens (16); a vLLM CPU block is
``BS = block_size`` tokens (128 by default; the CPU kernels need a multiple of 32, so a block of 16
is not possible there). ``BS`` must be a multiple of ``S``: each block holds ``BS / S`` pages, and
the *physical page id* of sub-page ``j`` of block ``b`` is ``b * (BS / S) + j``. Logical page ``p``
of a sequence with block table row ``bt`` is physical page
``bt[p * S // BS] * (BS / S) + (p * S % BS) // S``.

Validity. vLLM frees and reuses blocks, and shares them between sequences (prefix caching). A
summary is used only when its tag matches the current state of its physical page:

- ``write_gen[pid]``: bumped every time vLLM writes any slot of the page (from the slot mapping of
  every cache write, see :meth:`BlockSummaryStore.note_writes`); a freed block that is reused for
  other tokens is necessarily rewritten, so its generation moves on;
- ``built_gen[pid]`` and ``built_page[pid]``: the write generation and the logical page index the
  summary was built from.

A summary is valid for logical page ``p`` iff ``built_gen == write_gen`` and ``built_page == p``.
A block shared through prefix caching is not rewritten and sits at the same logical position, so
its summary stays valid for every sharer (same keys, same summary). Anything else is rebuilt from
the keys in the paged cache before it is scored.

The step. :func:`decode_rows` makes the rows' summaries valid and runs
:class:`~kvlocks.plan.DecodePlan` (every selection mode it runs) over the cache read through
:class:`PagedBlocks`: vLLM's CPU layouts (:mod:`kvlocks.integrations.vllm.compat`) interleave keys
and values per (block, KV head), so no view with one page stride exists; reads gather pages.

Memory, per layer: one :class:`~kvlocks.summary.store.SummaryStore` over all
``num_blocks * BS / S`` physical pages (``Hkv * bytes_per_page_head``; 498 bytes per (page, KV head)
at S=16, R=8, D=64; 818 at D=128) plus 20 bytes of tags per physical page. See
:func:`summary_bytes_per_token`.
"""

from __future__ import annotations

import hashlib

import torch

from kvlocks.config import LocksConfig
from kvlocks.integrations.vllm.sinks import apply_sinks
from kvlocks.pages import full_pages, num_pages
from kvlocks.plan import DecodePlan
from kvlocks.summary.build import build_summaries
from kvlocks.summary.store import SummaryStore
from kvlocks.summary.types import summary_bytes

TAG_BYTES_PER_PAGE = 8 + 8 + 4  # write_gen int64, built_gen int64, built_page int32


def summary_bytes_per_token(config: LocksConfig, num_kv_heads: int, head_dim: int) -> float:
    """Summary + tag bytes per cached token per layer (compare: K+V bytes per token per layer
    ``2 * Hkv * D * dtype_size``)."""
    per_page_head = sum(summary_bytes(config.page_size, config.rank, head_dim, 4, 8))  # the store's int4/int8
    return (num_kv_heads * per_page_head + TAG_BYTES_PER_PAGE) / config.page_size


class BlockSummaryStore:
    """Summaries and validity tags for every physical page of one layer's paged cache.

    Parameters
    ----------
    config : LocksConfig (int4 basis, int8 coefficients: the paged store's format)
    num_blocks, block_size : the layer's paged cache geometry
    num_kv_heads, head_dim : Hkv, D
    """

    def __init__(self, config: LocksConfig, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int) -> None:
        if block_size % config.page_size:
            raise ValueError(f"vLLM block_size={block_size} is not a multiple of LocksConfig.page_size="
                             f"{config.page_size}; LOCKS pages must tile vLLM blocks")
        self.config, self.block_size, self.pages_per_block = config, block_size, block_size // config.page_size
        n = num_blocks * self.pages_per_block
        self.summaries = SummaryStore.empty(n, num_kv_heads, head_dim, config)
        self.write_gen = torch.zeros(n, dtype=torch.int64)
        self.built_gen = torch.full((n,), -1, dtype=torch.int64)
        self.built_page = torch.full((n,), -1, dtype=torch.int32)
        self.ignore_tags = False  # test knob: trust any built summary (shows the tags matter)
        self.fingerprints: torch.Tensor | None = None  # verification: key-bytes hash per built page

    def nbytes(self) -> int:
        tags = sum(t.numel() * t.element_size() for t in (self.write_gen, self.built_gen, self.built_page))
        return self.summaries.num_pages * self.summaries.num_kv_heads * self.summaries.bytes_per_page_head() + tags

    def note_writes(self, slot_mapping: torch.Tensor) -> None:
        """vLLM wrote K/V to ``slot_mapping [T]`` (negative = padding): bump those pages' generation."""
        slots = slot_mapping.long()
        slots = slots[slots >= 0]
        if slots.numel():
            pids = slots // self.config.page_size  # physical page of each slot
            self.write_gen.index_add_(0, pids, torch.ones_like(pids))

    def page_table(self, block_table: torch.Tensor, width: int) -> torch.Tensor:
        """int64 ``[R, width]``: the physical page id of logical pages ``0 .. width-1`` of each row of
        ``block_table [R, max_blocks]`` (vLLM's physical block ids)."""
        s = self.config.page_size
        tok = torch.arange(width, dtype=torch.int64) * s  # first token of each page
        return block_table.long()[:, tok // self.block_size] * self.pages_per_block + (tok % self.block_size) // s

    def stale(self, pids: torch.Tensor) -> torch.Tensor:
        """Bool ``[P]``: which of logical pages ``0 .. P-1`` (physical ``pids``) need a build."""
        logical = torch.arange(pids.numel(), dtype=torch.int32)
        if self.ignore_tags:
            return self.built_page[pids] < 0
        return (self.built_gen[pids] != self.write_gen[pids]) | (self.built_page[pids] != logical)

    def ensure(self, pids: torch.Tensor, keys: PagedBlocks) -> int:
        """Build the summaries of logical pages ``0 .. P-1`` (physical ``pids [P]``) that are not
        valid, from ``keys`` (the key half of the cache). Returns the number of pages built."""
        todo = self.stale(pids).nonzero().flatten()  # logical page numbers
        if not todo.numel():
            return 0
        pages = keys.index_select(0, pids[todo])  # [m, S, Hkv, D]
        self.summaries.scatter_(pids[todo], build_summaries(pages.permute(2, 0, 1, 3), self.config))
        if self.fingerprints is not None:
            self.fingerprints[pids[todo]] = _fingerprints(pages)
        self.built_gen[pids[todo]] = self.write_gen[pids[todo]]
        self.built_page[pids[todo]] = todo.to(torch.int32)
        return int(todo.numel())

    def enable_verification(self) -> None:
        """Remember a hash of the keys each summary is built from (see :meth:`check_fresh`)."""
        self.fingerprints = torch.zeros(self.summaries.num_pages, dtype=torch.int64)

    def check_fresh(self, pids: torch.Tensor, keys: PagedBlocks) -> int:
        """Verification: how many of the summaries about to be used were built from other keys
        than those now in their page (a stale summary). Exact: compares a hash of the key bytes
        at build time with the keys in the cache now. Costly: tests and debugging only."""
        if self.fingerprints is None or not pids.numel():
            return 0
        now = _fingerprints(keys.index_select(0, pids))
        return int((now != self.fingerprints[pids]).sum())


class PagedBlocks:
    """One half of vLLM's CPU cache read as the plan's paged cache ``[num_pages, S, Hkv, D]``
    (physical page ``p``: rows ``(p % (BS / S)) * S ...`` of block ``p // (BS / S)``).

    ``tokens``: that half indexed token-major as ``[NB, Hkv, BS, D]`` (a strided view or
    :class:`~kvlocks.integrations.vllm.compat.PackedTokens`: :func:`~kvlocks.integrations.vllm.compat.split_kv_cache`).
    The reads of the plan's ``cpu`` and ``torch`` backends gather the named pages only:
    ``index_select(0, pages [m])`` -> ``[m, S, Hkv, D]``; ``x[pages, :, heads]`` -> ``[*broadcast, S, D]``.
    """

    def __init__(self, tokens, page_size: int) -> None:
        nb, h, bs, d = tokens.shape
        self.tokens, self.page_size, self.pages_per_block = tokens, page_size, bs // page_size
        self.shape, self.dtype = (nb * self.pages_per_block, page_size, h, d), tokens.dtype

    def _rows(self, pages) -> tuple[torch.Tensor, torch.Tensor]:
        """pages int ``[...]`` -> block ``[..., 1]`` and row within it ``[..., S]``."""
        pages = torch.as_tensor(pages).long()
        row0 = (pages % self.pages_per_block) * self.page_size
        return (pages // self.pages_per_block).unsqueeze(-1), row0.unsqueeze(-1) + torch.arange(self.page_size)

    def index_select(self, dim: int, pages: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise ValueError(f"PagedBlocks.index_select: dim={dim}: pages are selected along dim 0 only")
        block, row = self._rows(pages)
        return self.tokens[block, :, row]  # [m, S, Hkv, D]

    def __getitem__(self, index) -> torch.Tensor:
        if not (isinstance(index, tuple) and len(index) == 3 and index[1] == slice(None)):
            raise IndexError(f"PagedBlocks: index {index!r}: allowed x[pages, :, heads] with integer tensors")
        block, row = self._rows(index[0])
        return self.tokens[block, torch.as_tensor(index[2]).long().unsqueeze(-1), row]


def decode_rows(store: BlockSummaryStore, keys: PagedBlocks, values: PagedBlocks, queries: torch.Tensor,
                block_table: torch.Tensor, seq_lens: torch.Tensor, *, scale: float, sinks: torch.Tensor | None = None,
                verify: bool = False, backend: str = "cpu"):
    """LOCKS attention of one-token decode rows.

    queries ``[R, Hq, D]``; block_table int ``[R, max_blocks]`` (vLLM's physical blocks); seq_lens
    int ``[R]`` (tokens including this step's); sinks float ``[Hq]`` (learned sink logits) or None.
    Returns ``(out, pages, built, stale)``: out float32 ``[R, Hq, D]``, pages int32 ``[R, Hkv, k]``
    (the plan's ascending logical pages, -1 padded), per row the number of summaries built and,
    with ``verify``, of stale summaries used (:meth:`BlockSummaryStore.check_fresh`; else None).
    ``backend``: the plan's, ``"cpu"`` (batched) or ``"torch"`` (the references: the spec).
    """
    r, hq, d = queries.shape
    hkv, lens = keys.shape[2], seq_lens.long()
    table = store.page_table(block_table, int(num_pages(lens, store.config.page_size).max()))  # [R, W]
    full = [table[i, : int(n)] for i, n in enumerate(full_pages(lens, store.config.page_size))]
    built = [store.ensure(pids, keys) for pids in full]
    stale = [store.check_fresh(pids, keys) for pids in full] if verify else None
    plan = DecodePlan(batch=r, num_kv_heads=hkv, group=hq // hkv, head_dim=d, max_pages=table.shape[1],
                      config=store.config, dtype=torch.float32, device=queries.device, scale=scale, backend=backend)
    out, lse = plan.run(queries.float(), keys, values, store.summaries, table, lens)
    if sinks is not None:
        apply_sinks(out, lse, sinks)
    return out, plan.pages, built, stale


def _fingerprints(pages: torch.Tensor) -> torch.Tensor:
    """int64 ``[m]`` hash of the bytes of each page of ``pages [m, S, Hkv, D]``."""
    out = [int.from_bytes(hashlib.blake2b(page.view(torch.uint8).numpy().tobytes(), digest_size=7).digest(), "little")
           for page in pages.contiguous()]
    return torch.tensor(out, dtype=torch.int64)
