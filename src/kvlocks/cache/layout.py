"""The paged layout shared by the decode kernels (see ``docs/paged-layout.md``).

K/V live in a vLLM-style paged cache: ``k_cache, v_cache [num_pages, S, Hkv, D]`` (vLLM's
FlashAttention backend layout, ``kv_cache[0]`` / ``kv_cache[1]``; any strides with a contiguous
last dim work). A sequence ``b`` owns the physical pages ``block_table[b, :ceil(seq_lens[b] / S)]``.
LOCKS summaries are stored per *physical* page id, so a vLLM block id indexes them directly.

This module holds the summary store (:class:`SummaryStore`, per physical page; the per-sequence
reference layout is :class:`kvlocks.summary.types.PageSummaries`) and the converters between the
paged layout and the reference (token-major, ``[..., P, ...]``) layout used by the pure-PyTorch
references.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvlocks.config import LocksConfig
from kvlocks.kernels_support import check_config
from kvlocks.pages import num_pages
from kvlocks.summary.types import PageSummaries


@dataclass
class SummaryStore:
    """LOCKS summaries indexed by physical page id (int4 basis, int8 coefficients/centroid).

    - ``basis``: uint8 ``[num_pages, Hkv, R, D / 2]``; element ``2i`` in the low nibble of byte
      ``i``, ``2i + 1`` in the high nibble (two's complement, ``[-7, 7]``).
    - ``basis_scale``: float16 ``[num_pages, Hkv, R]`` (one per basis vector).
    - ``coef``: int8 ``[num_pages, Hkv, S, R]``; ``coef_scale`` float16 ``[num_pages, Hkv, S]``.
    - ``centroid``: int8 ``[num_pages, Hkv, D]``; ``centroid_scale`` float16 ``[num_pages, Hkv]``.

    818 bytes per (page, KV head) at S=16, R=8, D=128 (768 payload + 50 scales). All tensors are
    contiguous. A page whose summary was never built holds garbage; only full pages are read.
    """

    basis: torch.Tensor
    basis_scale: torch.Tensor
    coef: torch.Tensor
    coef_scale: torch.Tensor
    centroid: torch.Tensor
    centroid_scale: torch.Tensor

    @classmethod
    def empty(cls, num_pages: int, num_kv_heads: int, head_dim: int, config: LocksConfig,
              device=None) -> "SummaryStore":
        """Allocate an (uninitialised) store for ``num_pages`` physical pages (ValueError for a
        configuration the store cannot hold: :func:`kvlocks.kernels_support.kernel_support`)."""
        check_config(config, head_dim, backend="torch", owner="SummaryStore")
        n, h, s, r, d = num_pages, num_kv_heads, config.page_size, config.rank, head_dim
        return cls(
            basis=torch.empty(n, h, r, d // 2, dtype=torch.uint8, device=device),
            basis_scale=torch.empty(n, h, r, dtype=torch.float16, device=device),
            coef=torch.empty(n, h, s, r, dtype=torch.int8, device=device),
            coef_scale=torch.empty(n, h, s, dtype=torch.float16, device=device),
            centroid=torch.empty(n, h, d, dtype=torch.int8, device=device),
            centroid_scale=torch.empty(n, h, dtype=torch.float16, device=device),
        )

    @property
    def num_pages(self) -> int:
        return self.coef.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.coef.shape[1]

    @property
    def page_size(self) -> int:
        return self.coef.shape[2]

    @property
    def rank(self) -> int:
        return self.coef.shape[3]

    @property
    def head_dim(self) -> int:
        return self.centroid.shape[2]

    def bytes_per_page_head(self) -> int:
        """Bytes a decode step reads per (page, KV head): payload + float16 scales."""
        return sum(t[0, 0].numel() * t.element_size() for t in self._fields())

    def to(self, device) -> "SummaryStore":
        return SummaryStore(*(t.to(device) for t in self._fields()))

    def _fields(self):
        return (self.basis, self.basis_scale, self.coef, self.coef_scale, self.centroid, self.centroid_scale)

    def gather(self, page_ids: torch.Tensor) -> PageSummaries:
        """Reference-layout summaries of physical pages ``page_ids [P]``: leading dims ``[Hkv]``."""
        idx = page_ids.long()

        def take(t):  # [num_pages, Hkv, ...] -> [Hkv, P, ...]
            return t.index_select(0, idx).transpose(0, 1).contiguous()

        p, h = idx.numel(), self.num_kv_heads
        return PageSummaries(
            page_size=self.page_size, rank=self.rank, head_dim=self.head_dim, basis_bits=4, coef_bits=8,
            basis=take(self.basis), basis_scale=take(self.basis_scale), coef=take(self.coef),
            coef_scale=take(self.coef_scale), centroid=take(self.centroid),
            centroid_scale=take(self.centroid_scale),
            tau=torch.zeros(h, p, device=idx.device),
            sigma=torch.zeros(h, p, min(self.page_size, self.rank + 1), device=idx.device),
        )

    def scatter_(self, page_ids: torch.Tensor, summaries: PageSummaries) -> None:
        """Write reference summaries with leading dims ``[Hkv]`` and P pages to ``page_ids [P]``."""
        if (summaries.basis_bits, summaries.coef_bits) != (4, 8):
            raise ValueError("the paged store holds int4 basis / int8 coefficient summaries only")
        idx = page_ids.long()
        for dst, src in zip(self._fields(), (summaries.basis, summaries.basis_scale, summaries.coef,
                                             summaries.coef_scale, summaries.centroid,
                                             summaries.centroid_scale)):
            dst.index_copy_(0, idx, src.transpose(0, 1).to(dst.dtype))


def token_major_to_paged(x: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """View token-major ``x [L, N, D]`` as a paged cache with one sequence per row and Hkv = 1.

    Returns ``cache [L * P, S, 1, D]`` (a copy, zero-padded to whole pages) and the block table
    ``[L, P]`` int32 (row ``l`` owns pages ``l * P .. l * P + P - 1``).
    """
    lead, n, d = x.shape
    p = num_pages(n, page_size)
    cache = x.new_zeros(lead, p * page_size, d)
    cache[:, :n] = x
    table = torch.arange(lead * p, device=x.device, dtype=torch.int32).view(lead, p)
    return cache.view(lead * p, page_size, 1, d), table


def paged_to_token_major(cache: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    """Keys/values of one sequence: ``cache [num_pages, S, Hkv, D]``, ``pages [>= ceil(n/S)]``
    -> ``[Hkv, n, D]``."""
    s = cache.shape[1]
    used = pages[: num_pages(n, s)].long()
    x = cache.index_select(0, used)  # [P, S, Hkv, D]
    return x.permute(2, 0, 1, 3).flatten(1, 2)[:, :n]


def dot_dtype(dtype: torch.dtype):
    """Triton dtype for ``tl.dot`` operands of this storage dtype.

    The Triton 3.9 interpreter mis-converts bfloat16 inside ``tl.dot`` (and int -> bfloat16
    casts), so under ``TRITON_INTERPRET=1`` bfloat16 operands are widened to float32: the same
    products, accumulated in float32 either way.
    """
    import triton.language as tl

    if dtype == torch.bfloat16:
        return tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
