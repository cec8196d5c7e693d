"""Decode-step attention over the static paged cache: ``locks`` (score, select, attend) or dense.

Both are plan/run objects: buffers are allocated in ``__init__`` (one plan shared by every
layer), ``run`` launches fixed-grid kernels with no host sync on the Triton backend, so the whole
decode step can be captured in one CUDA graph. The torch backend runs the PyTorch references
(the spec) for CPU tests.
"""

from __future__ import annotations

import torch

from kvlocks.cache.layout import paged_to_token_major
from kvlocks.dispatch import DecodePlan, build_new_pages, paged_decode
from kvlocks.engine.cache import StaticPagedCache

DENSE_KERNEL = "triton split-KV paged decode over every page (kvlocks.attention.triton.paged_decode)"
DENSE_REFERENCE = "torch reference dense_decode (kvlocks.attention.reference)"


class LocksAttention:
    """LOCKS decode attention: incremental build of just-filled pages, then DecodePlan.run."""

    name = "locks"

    def __init__(self, cache: StaticPagedCache, *, num_q_heads: int, scale: float, dtype, backend: str) -> None:
        if cache.summaries is None:
            raise ValueError("the locks method needs a cache allocated with summaries")
        hkv, d = cache.k.shape[-2:]
        self.cache, self.backend = cache, backend
        self.plan = DecodePlan(batch=cache.batch, num_kv_heads=hkv, group=num_q_heads // hkv, head_dim=d,
                               max_pages=cache.max_pages, config=cache.config, dtype=dtype,
                               device=cache.k.device, scale=scale, backend=backend)
        self.kernel = "kvlocks DecodePlan (score -> select -> attend), " + backend

    def run(self, layer: int, q: torch.Tensor, seq_lens: torch.Tensor, *, build: bool = True) -> torch.Tensor:
        """q ``[B, Hq, D]`` (the new token's K/V already written; ``seq_lens`` counts it) -> ``[B, Hq, D]``.
        ``build=False`` skips the incremental build launch: only for steps that fill no page."""
        c = self.cache
        # the page this token filled gets its summary before scoring, as in the HF path
        if build:
            build_new_pages(c.k[layer], c.summaries[layer], c.block_table, seq_lens, c.config, backend=self.backend)
        out, _ = self.plan.run(q, c.k[layer], c.v[layer], c.summaries[layer], c.block_table, seq_lens)
        return out


class DenseAttention:
    """Dense decode attention over every token: the split-KV Triton kernel over the identity page
    list (the fastest dense decode measured on the H200, docs/kernels.md), or the reference."""

    name = "dense"

    def __init__(self, cache: StaticPagedCache, *, num_q_heads: int, scale: float, dtype, backend: str) -> None:
        hkv, d = cache.k.shape[-2:]
        self.cache, self.backend, self.scale = cache, backend, scale
        self.group = num_q_heads // hkv
        if backend == "triton":
            from kvlocks.attention.triton import attention_workspace

            dev = cache.k.device
            self.pages = torch.arange(cache.max_pages, dtype=torch.int32, device=dev).expand(
                cache.batch, hkv, cache.max_pages)  # identity list, strides (0, 0, 1)
            self.ws = attention_workspace(cache.batch, num_q_heads, d, cache.max_pages, cache.batch * hkv, dtype, dev)
            self.kernel = DENSE_KERNEL
        else:
            self.kernel = DENSE_REFERENCE

    def run(self, layer: int, q: torch.Tensor, seq_lens: torch.Tensor, *, build: bool = True) -> torch.Tensor:
        """q ``[B, Hq, D]`` -> ``[B, Hq, D]`` over every cached token (``build``: unused, no summaries)."""
        c = self.cache
        if self.backend == "triton":
            out, _ = paged_decode(q, c.k[layer], c.v[layer], c.block_table, seq_lens, self.pages, scale=self.scale,
                                  backend="triton", workspace=self.ws)
            return out
        from kvlocks.attention.reference import dense_decode

        bsz, hq, d = q.shape
        hkv = hq // self.group
        out = torch.empty_like(q)
        for b in range(bsz):  # host loop: reference path only
            n = int(seq_lens[b])
            keys = paged_to_token_major(c.k[layer], c.block_table[b], n)  # [Hkv, n, D]
            values = paged_to_token_major(c.v[layer], c.block_table[b], n)
            o, _ = dense_decode(q[b].view(hkv, self.group, d), keys, values, scale=self.scale)
            out[b] = o.reshape(hq, d)
        return out


def make_attention(method: str, cache: StaticPagedCache, *, num_q_heads: int, scale: float, dtype, backend: str):
    """The decode attention object for ``method`` (``"locks"`` or ``"dense"``)."""
    cls = {"locks": LocksAttention, "dense": DenseAttention}.get(method)
    if cls is None:
        raise ValueError(f"method={method!r}: allowed ('locks', 'dense')")
    return cls(cache, num_q_heads=num_q_heads, scale=scale, dtype=dtype, backend=backend)
