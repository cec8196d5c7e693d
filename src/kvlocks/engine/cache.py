"""A preallocated, static paged cache for every layer of a model (the layout of docs/paged-layout.md).

Per layer: ``k[l], v[l] [num_pages, S, Hkv, D]`` and a :class:`SummaryStore`; shared by
the layers: ``block_table [B, max_pages]`` int32 and ``seq_lens [B]`` int32, all on the device.
Sequence ``b`` owns the physical pages ``b * max_pages .. (b + 1) * max_pages - 1``, so its tokens
are also one contiguous ``[max_pages * S, Hkv, D]`` run: the dense prefill reads and writes them
as plain token-major views (no gather), while the decode kernels go through the block table as
they would for any vLLM-style allocation.
"""

from __future__ import annotations

import torch

from kvlocks.summary.store import SummaryStore
from kvlocks.config import KernelOptions, LocksConfig
from kvlocks.kernels_support import check_config
from kvlocks.pages import full_pages, num_pages
from kvlocks.plan import paged_build


class StaticPagedCache:
    """K/V pages, LOCKS summaries, block table and lengths for ``layers`` layers, allocated once.

    Parameters
    ----------
    layers, batch, num_kv_heads, head_dim : L, B, Hkv, D
    max_context : tokens per sequence at most (rounded up to whole pages)
    config : LocksConfig (page_size S; summary settings)
    dtype, device : of K/V
    summaries : allocate the summary stores (the ``locks`` method needs them)
    """

    def __init__(self, *, layers: int, batch: int, num_kv_heads: int, head_dim: int, max_context: int,
                 config: LocksConfig, dtype: torch.dtype, device, summaries: bool = True) -> None:
        check_config(config, head_dim, backend="torch", owner="StaticPagedCache")  # the store's format
        s = config.page_size
        self.config, self.batch, self.page_size = config, batch, s
        self.max_pages = num_pages(max_context, s)
        self.num_pages = batch * self.max_pages
        shape = (layers, self.num_pages, s, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, num_pages, S, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.summaries = [SummaryStore.empty(self.num_pages, num_kv_heads, head_dim, config, device=device)
                          for _ in range(layers)] if summaries else None
        self.block_table = torch.arange(self.num_pages, dtype=torch.int32, device=device).view(batch, self.max_pages)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.length = 0  # host copy of the common length after prefill / fill (decode updates only the device)

    @property
    def capacity(self) -> int:
        """Tokens per sequence the cache holds."""
        return self.max_pages * self.page_size

    @staticmethod
    def nbytes(*, layers: int, batch: int, num_kv_heads: int, head_dim: int, max_context: int,
               config: LocksConfig, dtype: torch.dtype, summaries: bool = True) -> dict:
        """Bytes the cache will allocate: ``{"kv": ..., "summaries": ..., "total": ...}``."""
        s = config.page_size
        pages = batch * num_pages(max_context, s)
        elem = torch.empty(0, dtype=dtype).element_size()
        kv = 2 * layers * pages * s * num_kv_heads * head_dim * elem
        r, d = config.rank, head_dim
        per_page_head = r * d // 2 + 2 * r + s * r + 2 * s + d + 2  # basis, scales, coef, scales, centroid, scale
        summ = layers * pages * num_kv_heads * per_page_head if summaries else 0
        return {"kv": kv, "summaries": summ, "total": kv + summ}

    def token_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-major views ``[B, capacity, Hkv, D]`` of one layer's K and V (no copy)."""
        shape = (self.batch, self.capacity, *self.k.shape[-2:])
        return self.k[layer].view(shape), self.v[layer].view(shape)

    def set_length(self, n: int) -> None:
        """Every sequence holds ``n`` tokens (after a prefill or a random fill)."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"length {n} outside [0, capacity={self.capacity}]")
        self.seq_lens.fill_(n)
        self.length = n

    def random_fill(self, n: int, *, generator: torch.Generator | None = None, std: float = 1.0) -> None:
        """Fill the first ``n`` tokens of every sequence and layer with random normal K/V.

        For long-context speed benchmarks where a real prefill would take too long: the decode
        step's cost does not depend on the values. Summaries are not built (see :meth:`build`).
        """
        if not 1 <= n <= self.capacity:
            raise ValueError(f"random_fill: n={n} outside [1, capacity={self.capacity}]")
        for layer in range(self.k.shape[0]):
            for t in self.token_view(layer):
                t[:, :n].normal_(0.0, std, generator=generator)
        self.set_length(n)

    def full_page_ids(self) -> torch.Tensor:
        """Physical ids of every full page at the current (common) length: int32 ``[B * (n // S)]``."""
        full = full_pages(self.length, self.page_size)
        return self.block_table[:, :full].reshape(-1).contiguous()

    def build(self, *, backend: str | None = None, layers: range | None = None,
              options: KernelOptions | None = None) -> None:
        """Build the summaries of every full page of every layer (after prefill or fill); ``options``:
        the build's KernelOptions (``build_solver``)."""
        if self.summaries is None:
            raise ValueError("this cache was allocated without summaries")
        ids = self.full_page_ids()
        if ids.numel() == 0:
            return
        for layer in layers if layers is not None else range(self.k.shape[0]):
            paged_build(self.k[layer], self.summaries[layer], ids, self.config, backend=backend, options=options)
