"""The CPU backend's summary store (:class:`BlockSummaryStore`: the tagged store of
:mod:`kvlocks.integrations.vllm.store` over the pages of vLLM's CPU blocks) and its decode step over
that cache (:func:`decode_rows`).

Pages and blocks. A LOCKS page is ``S = page_size`` tokens (16); a vLLM CPU block is
``BS = block_size`` tokens (128 by default; the CPU kernels need a multiple of 32, so a block of 16
is not possible there). ``BS`` must be a multiple of ``S``: each block holds ``BS / S`` pages, and
the *physical page id* of sub-page ``j`` of block ``b`` is ``b * (BS / S) + j``. Logical page ``p``
of a sequence with block table row ``bt`` is physical page
``bt[p * S // BS] * (BS / S) + (p * S % BS) // S``.

The step. :func:`decode_rows` makes the rows' summaries valid (:meth:`~BlockSummaryStore.ensure`:
every full page whose tags do not match is rebuilt from the keys in the paged cache) and runs
:class:`~kvlocks.plan.DecodePlan` (every selection mode it runs) over the cache read through
:class:`PagedBlocks`: vLLM's CPU layouts (:mod:`kvlocks.integrations.vllm.compat`) interleave keys
and values per (block, KV head), so no view with one page stride exists; reads gather pages.

Memory, per layer: one :class:`~kvlocks.summary.store.SummaryStore` over all
``num_blocks * BS / S`` physical pages (``Hkv * bytes_per_page_head``; 498 bytes per (page, KV head)
at S=16, R=8, D=64; 818 at D=128) plus 12 bytes of tags per physical page. See
:func:`~kvlocks.integrations.vllm.store.summary_bytes_per_token`.
"""

from __future__ import annotations

import torch

from kvlocks.config import LocksConfig
from kvlocks.integrations.vllm.sinks import apply_sinks
from kvlocks.integrations.vllm.store import TaggedSummaryStore
from kvlocks.pages import num_pages
from kvlocks.plan import DecodePlan


class BlockSummaryStore(TaggedSummaryStore):
    """Summaries and validity tags for every physical page of one layer's paged CPU cache.

    Parameters
    ----------
    config : LocksConfig (int4 basis, int8 coefficients: the paged store's format)
    num_blocks, block_size : the layer's paged cache geometry (``block_size`` a multiple of ``S``)
    num_kv_heads, head_dim : Hkv, D
    verify, ignore_tags : as :class:`~kvlocks.integrations.vllm.store.TaggedSummaryStore`
    """

    def __init__(self, config: LocksConfig, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, *, verify: bool = False, ignore_tags: bool = False) -> None:
        if block_size % config.page_size:
            raise ValueError(f"vLLM block_size={block_size} is not a multiple of LocksConfig.page_size="
                             f"{config.page_size}; LOCKS pages must tile vLLM blocks")
        self.block_size, self.pages_per_block = block_size, block_size // config.page_size
        super().__init__(config, num_blocks * self.pages_per_block, num_kv_heads, head_dim, "cpu",
                         verify=verify, ignore_tags=ignore_tags)

    def page_table(self, block_table: torch.Tensor, width: int) -> torch.Tensor:
        """int64 ``[R, width]``: the physical page id of logical pages ``0 .. width-1`` of each row of
        ``block_table [R, max_blocks]`` (vLLM's physical block ids)."""
        s = self.config.page_size
        tok = torch.arange(width, dtype=torch.int64) * s  # first token of each page
        return block_table.long()[:, tok // self.block_size] * self.pages_per_block + (tok % self.block_size) // s


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
        self.device = torch.device("cpu")  # vLLM's CPU cache

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
    with ``verify``, of stale summaries used (:meth:`BlockSummaryStore.stale_used`; else None).
    ``backend``: the plan's, ``"cpu"`` (batched) or ``"torch"`` (the references: the spec).
    """
    r, hq, d = queries.shape
    hkv, lens = keys.shape[2], seq_lens.long()
    table = store.page_table(block_table, int(num_pages(lens, store.config.page_size).max()))  # [R, W]
    built = store.ensure(keys, table, lens, int(lens.max())).tolist()
    stale = store.stale_used(keys, table, lens).tolist() if verify else None
    plan = DecodePlan(batch=r, num_kv_heads=hkv, group=hq // hkv, head_dim=d, max_pages=table.shape[1],
                      config=store.config, dtype=torch.float32, device=queries.device, scale=scale, backend=backend)
    out, lse = plan.run(queries.float(), keys, values, store.summaries, table, lens)
    if sinks is not None:
        apply_sinks(out, lse, sinks)
    return out, plan.pages, built, stale

