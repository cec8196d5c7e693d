"""Decode-step attention over the static paged cache: ``locks`` (score, select, attend) or dense.

Both are plan/run objects: buffers are allocated in ``__init__`` (one plan shared by every
layer), ``run`` launches fixed-grid kernels with no host sync on the Triton backend, so the whole
decode step can be captured in one CUDA graph. The torch backend runs the PyTorch references
(the spec) for CPU tests.
"""

from __future__ import annotations

import torch

from kvlocks.cache.layout import paged_to_token_major
from kvlocks.config import KernelOptions, default_kernel_options
from kvlocks.engine.cache import StaticPagedCache
from kvlocks.pages import num_pages
from kvlocks.plan import DecodePlan, paged_build_new, paged_decode

DENSE_KERNEL = "triton split-KV paged decode over every page (kvlocks.attention.triton.paged_decode)"
DENSE_REFERENCE = "torch reference dense_decode (kvlocks.attention.reference)"


class LocksAttention:
    """LOCKS decode attention: incremental build of just-filled pages, then DecodePlan.run."""

    name = "locks"

    def __init__(self, cache: StaticPagedCache, *, num_q_heads: int, scale: float, dtype, backend: str,
                 options: KernelOptions) -> None:
        if cache.summaries is None:
            raise ValueError("the locks method needs a cache allocated with summaries")
        hkv, d = cache.k.shape[-2:]
        self.cache, self.backend, self.options = cache, backend, options
        self.plan = DecodePlan(batch=cache.batch, num_kv_heads=hkv, group=num_q_heads // hkv, head_dim=d,
                               max_pages=cache.max_pages, config=cache.config, dtype=dtype,
                               device=cache.k.device, scale=scale, backend=backend, options=options)
        self.kernel = "kvlocks DecodePlan (score -> select -> attend), " + backend
        self.num_q_heads, self.dtype, self.scale = num_q_heads, dtype, scale
        self.tuned = None  # kvlocks.attention.tune.TuneResult of the attention over the selected pages

    def tune(self) -> None:
        """On CUDA (Triton backend), time the split-KV kernel's candidate launches over a budget of
        pages per (sequence, KV head), scattered over the cache's current length as a selection's
        are, and keep the fastest for the plan's attention (the score and selection launches are
        sized from the shapes). Call before a CUDA graph of the step is captured. Elsewhere, or on
        an empty cache, nothing changes."""
        c = self.cache
        if not _can_tune(self.backend, c):
            return
        dev = c.k.device
        total = num_pages(c.length, c.page_size)
        gen = torch.Generator(device=dev).manual_seed(1)
        pages = torch.full((c.batch, c.k.shape[-2], self.plan.k), -1, dtype=torch.int32, device=dev)
        for b in range(c.batch):
            for h in range(pages.shape[1]):
                pick = torch.randperm(total, generator=gen, device=dev)[: self.plan.k]
                pages[b, h, : pick.numel()] = pick.to(torch.int32)
        res = _fastest(self, pages)
        self.plan.attend_ws, self.tuned = res.workspace, res
        self.kernel = f"kvlocks DecodePlan (score -> select -> attend), {self.backend}; attend launch {res.describe()}"

    def run(self, layer: int, q: torch.Tensor, seq_lens: torch.Tensor, *, build: bool = True) -> torch.Tensor:
        """q ``[B, Hq, D]`` (the new token's K/V already written; ``seq_lens`` counts it) -> ``[B, Hq, D]``.
        ``build=False`` skips the incremental build launch: only for steps that fill no page."""
        c = self.cache
        # the page this token filled gets its summary before scoring, as in the HF path
        if build:
            paged_build_new(c.k[layer], c.summaries[layer], c.block_table, seq_lens, c.config, backend=self.backend,
                            options=self.options)
        out, _ = self.plan.run(q, c.k[layer], c.v[layer], c.summaries[layer], c.block_table, seq_lens)
        return out


class DenseAttention:
    """Dense decode attention over every token: the split-KV Triton kernel over the identity page
    list (the fastest dense decode measured on the H200, docs/kernels.md) in its fastest launch for
    this cache (:meth:`tune`), or the reference."""

    name = "dense"

    def __init__(self, cache: StaticPagedCache, *, num_q_heads: int, scale: float, dtype, backend: str,
                 options: KernelOptions) -> None:
        hkv, d = cache.k.shape[-2:]
        self.cache, self.backend, self.scale, self.options = cache, backend, scale, options
        self.group = num_q_heads // hkv
        if backend == "triton":
            from kvlocks.attention.triton import attention_workspace

            dev = cache.k.device
            self.pages = torch.arange(cache.max_pages, dtype=torch.int32, device=dev).expand(
                cache.batch, hkv, cache.max_pages)  # identity list, strides (0, 0, 1)
            self.ws = attention_workspace(cache.batch, num_q_heads, d, cache.max_pages, cache.batch * hkv, dtype, dev,
                                          launch=options.dense_launches[0])
            self.kernel = DENSE_KERNEL
        else:
            self.kernel = DENSE_REFERENCE
        self.num_q_heads, self.dtype = num_q_heads, dtype
        self.tuned = None  # kvlocks.attention.tune.TuneResult once tune() ran

    def tune(self) -> None:
        """On CUDA (Triton backend), time the split-KV kernel's candidate launches on this cache at
        its current length and keep the fastest (:mod:`kvlocks.attention.tune`); ``kernel`` then
        names it. Call before a CUDA graph of the step is captured (the graph keeps the workspace it
        saw). Elsewhere, or on an empty cache, nothing changes."""
        c = self.cache
        if not _can_tune(self.backend, c):
            return
        res = _fastest(self, self.pages)
        self.ws, self.tuned = res.workspace, res
        self.kernel = f"{DENSE_KERNEL}, launch {res.describe()} at {c.length} tokens"

    def run(self, layer: int, q: torch.Tensor, seq_lens: torch.Tensor, *, build: bool = True) -> torch.Tensor:
        """q ``[B, Hq, D]`` -> ``[B, Hq, D]`` over every cached token (``build``: unused, no summaries)."""
        c = self.cache
        if self.backend == "triton":
            out, _ = paged_decode(q, c.k[layer], c.v[layer], c.block_table, seq_lens, self.pages, scale=self.scale,
                                  backend="triton", workspace=self.ws, options=self.options)
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


def _can_tune(backend: str, cache: StaticPagedCache) -> bool:
    return backend == "triton" and cache.k.device.type == "cuda" and cache.length > 0


def _fastest(attn, page_list: torch.Tensor):
    """The fastest split-KV launch of ``attn`` (either class) over ``page_list`` on its cache among
    ``KernelOptions.dense_launches``, timed with random queries of its dtype
    (:func:`kvlocks.attention.tune.fastest_dense`)."""
    from kvlocks.attention.tune import fastest_dense

    c = attn.cache
    gen = torch.Generator(device=c.k.device).manual_seed(0)
    q = torch.randn(c.batch, attn.num_q_heads, c.k.shape[-1], generator=gen, device=c.k.device).to(attn.dtype)
    return fastest_dense(q, list(c.k), list(c.v), c.block_table, c.seq_lens, page_list, scale=attn.scale,
                         options=attn.options)


def make_attention(method: str, cache: StaticPagedCache, *, num_q_heads: int, scale: float, dtype, backend: str,
                   options: KernelOptions | None = None):
    """The decode attention object for ``method`` (``"locks"`` or ``"dense"``); ``options``: its
    kernels' KernelOptions (None: the defaults)."""
    cls = {"locks": LocksAttention, "dense": DenseAttention}.get(method)
    if cls is None:
        raise ValueError(f"method={method!r}: allowed ('locks', 'dense')")
    return cls(cache, num_q_heads=num_q_heads, scale=scale, dtype=dtype, backend=backend,
               options=options or default_kernel_options())
