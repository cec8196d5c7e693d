"""LOCKS summaries of a paged cache, indexed by physical page id (:class:`SummaryStore`).

The per-sequence reference layout is :class:`kvlocks.summary.types.PageSummaries`; the paged
cache's layout and the converters between the two are in :mod:`kvlocks.cache.layout`
(``docs/paged-layout.md``). Every path's store builds on this one: the Hugging Face cache's
summaries viewed as one (:mod:`kvlocks.integrations.hf.step`), the engine's static cache and the
vLLM backends' tagged store (:mod:`kvlocks.integrations.vllm.store`: this store plus validity tags).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlocks.config import LocksConfig
from kvlocks.kernels_support import check_config
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
