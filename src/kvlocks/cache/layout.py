"""The paged layout shared by the decode kernels (see ``docs/paged-layout.md``).

K/V live in a vLLM-style paged cache: ``k_cache, v_cache [num_pages, S, Hkv, D]`` (vLLM's
FlashAttention backend layout, ``kv_cache[0]`` / ``kv_cache[1]``; any strides with a contiguous
last dim work). A sequence ``b`` owns the physical pages ``block_table[b, :ceil(seq_lens[b] / S)]``.
LOCKS summaries are stored per *physical* page id, so a vLLM block id indexes them directly.

This module holds the converters between the paged layout and the reference (token-major,
``[..., P, ...]``) layout used by the pure-PyTorch references, and the kernels' ``tl.dot`` operand
type. The summary store by physical page is :class:`kvlocks.summary.store.SummaryStore` (also
importable from here).
"""

from __future__ import annotations

import os

import torch

from kvlocks.pages import num_pages
from kvlocks.summary.store import SummaryStore  # noqa: F401  (the kernels import it from here)


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
