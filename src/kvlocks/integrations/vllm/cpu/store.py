"""LOCKS summaries beside vLLM's paged KV cache, indexed by physical block id, with validity tags.

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

Memory, per layer: one :class:`~kvlocks.summary.store.SummaryStore` over all
``num_blocks * BS / S`` physical pages (``Hkv * bytes_per_page_head``; 498 bytes per (page, KV head)
at S=16, R=8, D=64; 818 at D=128) plus 20 bytes of tags per physical page. See
:func:`summary_bytes_per_token`.
"""

from __future__ import annotations

import hashlib
import logging

import torch

from kvlocks.summary.store import SummaryStore
from kvlocks.config import LocksConfig
from kvlocks.kernels_support import check_config
from kvlocks.summary.build import build_summaries
from kvlocks.summary.types import summary_bytes

log = logging.getLogger(__name__)

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
        check_config(config, head_dim, backend="torch", owner="BlockSummaryStore")
        s = config.page_size
        if block_size % s:
            raise ValueError(
                f"vLLM block_size={block_size} is not a multiple of LocksConfig.page_size={s}; "
                "LOCKS pages must tile vLLM blocks"
            )
        self.config = config
        self.block_size = block_size
        self.pages_per_block = block_size // s
        n = num_blocks * self.pages_per_block
        self.summaries = SummaryStore.empty(n, num_kv_heads, head_dim, config)
        self.write_gen = torch.zeros(n, dtype=torch.int64)
        self.built_gen = torch.full((n,), -1, dtype=torch.int64)
        self.built_page = torch.full((n,), -1, dtype=torch.int32)
        self.builds = 0  # pages built (tests and logs)
        self.ignore_tags = False  # test knob: trust any built summary (shows the tags matter)
        self.fingerprints: torch.Tensor | None = None  # verification: key-bytes hash per built page

    @property
    def num_pages(self) -> int:
        return self.write_gen.shape[0]

    def nbytes(self) -> int:
        tags = sum(t.numel() * t.element_size() for t in (self.write_gen, self.built_gen, self.built_page))
        return self.num_pages * self.summaries.num_kv_heads * self.summaries.bytes_per_page_head() + tags

    def note_writes(self, slot_mapping: torch.Tensor) -> None:
        """vLLM wrote K/V to ``slot_mapping [T]`` (negative = padding): bump those pages' generation."""
        slots = slot_mapping.long()
        slots = slots[slots >= 0]
        if slots.numel():
            pids = slots // self.config.page_size  # physical page of each slot
            self.write_gen.index_add_(0, pids, torch.ones_like(pids))

    def page_ids(self, block_row: torch.Tensor, num_pages: int) -> torch.Tensor:
        """Physical page ids ``[num_pages]`` of logical pages ``0 .. num_pages-1`` of one sequence."""
        s = self.config.page_size
        tok = torch.arange(num_pages, dtype=torch.int64) * s  # first token of each page
        return block_row[tok // self.block_size] * self.pages_per_block + (tok % self.block_size) // s

    def stale(self, pids: torch.Tensor) -> torch.Tensor:
        """Bool ``[P]``: which of logical pages ``0 .. P-1`` (physical ``pids``) need a build."""
        logical = torch.arange(pids.numel(), dtype=torch.int32)
        if self.ignore_tags:
            return self.built_page[pids] < 0
        return (self.built_gen[pids] != self.write_gen[pids]) | (self.built_page[pids] != logical)

    def ensure(self, pids: torch.Tensor, key_cache: torch.Tensor) -> int:
        """Build the summaries of logical pages ``0 .. P-1`` (physical ``pids [P]``) that are not
        valid. ``key_cache [NB, Hkv, BS, D]``. Returns the number of pages built."""
        todo = self.stale(pids).nonzero().flatten()  # logical page numbers
        if not todo.numel():
            return 0
        keys = self.page_keys(pids[todo], key_cache)  # [Hkv, m, S, D]
        built = build_summaries(keys, self.config)  # leading dims [Hkv], m pages
        self.summaries.scatter_(pids[todo], built)
        if self.fingerprints is not None:
            self.fingerprints[pids[todo]] = _fingerprints(keys)
        self.built_gen[pids[todo]] = self.write_gen[pids[todo]]
        self.built_page[pids[todo]] = todo.to(torch.int32)
        self.builds += int(todo.numel())
        return int(todo.numel())

    def page_keys(self, pids: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """Full pages of ``cache [NB, Hkv, BS, D]`` at physical ids ``pids [m]`` -> ``[Hkv, m, S, D]``."""
        s = self.config.page_size
        block = pids // self.pages_per_block
        row0 = (pids % self.pages_per_block) * s
        rows = row0.unsqueeze(-1) + torch.arange(s)  # [m, S]
        x = cache[block.unsqueeze(-1), :, rows]  # [m, S, Hkv, D]
        return x.permute(2, 0, 1, 3)

    def enable_verification(self) -> None:
        """Remember a hash of the keys each summary is built from (see :meth:`check_fresh`)."""
        self.fingerprints = torch.zeros(self.num_pages, dtype=torch.int64)

    def check_fresh(self, pids: torch.Tensor, key_cache: torch.Tensor) -> int:
        """Verification: how many of the summaries about to be used were built from other keys
        than those now in their page (a stale summary). Exact: compares a hash of the key bytes
        at build time with the keys in the cache now. Costly: tests and debugging only."""
        if self.fingerprints is None or not pids.numel():
            return 0
        now = _fingerprints(self.page_keys(pids, key_cache))
        return int((now != self.fingerprints[pids]).sum())


def _fingerprints(keys: torch.Tensor) -> torch.Tensor:
    """int64 ``[m]`` hash of the bytes of each page of ``keys [Hkv, m, S, D]``."""
    pages = keys.transpose(0, 1).contiguous()  # [m, Hkv, S, D]
    out = [int.from_bytes(hashlib.blake2b(pages[i].view(torch.uint8).numpy().tobytes(), digest_size=7).digest(), "little")
           for i in range(pages.shape[0])]
    return torch.tensor(out, dtype=torch.int64)
