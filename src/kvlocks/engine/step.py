"""One single-token decode step of every sequence, with static shapes and device-side state only.

State (all on the device, allocated once): ``tokens [B]`` int64 (the token to feed), the cache's
``seq_lens [B]`` int32 (tokens already cached) and ``lens_next [B]`` int32. A step: embed the
tokens, RoPE at position ``seq_lens``, and per layer the model's input norm, q/k/v projections and
``apply_rotary_pos_emb``, the new K/V written to slot ``block_table[b, pos // S] * S + pos % S``
by ``index_copy_`` (a device-side index), attention (locks or dense), ``o_proj``, the
post-attention norm and MLP; then the final norm, LM head and greedy argmax, written back into
``tokens``, and ``seq_lens += 1``. Nothing reads a device value on the host (Triton backend), so
the step is captured once in a CUDA graph and replayed: each replay decodes one more token.

Each layer's q/k/v projections are one product over the three weights laid out in one matrix
(:mod:`kvlocks.engine.fused`: the modules' parameters become views of it, no memory added), and the
new token's K/V are written inside the projection piece (:func:`~kvlocks.engine.parts.project_and_write`)
instead of by two ``index_copy_`` launches after it. H200, GLM-4-9B, LOCKS, ms per step, each
against the separate launches (docs/benchmarks.md): one product 1M 11.76 -> 11.08, 32K 7.74 ->
7.08; the writes inside the piece 1M 11.76 -> 11.60, 32K 7.74 -> 7.66.

With ``compile=True`` the two per-layer pieces around the attention (input norm + q/k/v
projections + RoPE + K/V writes, and o_proj + residuals + post-attention norm + MLP) run through
``torch.compile``: Inductor fuses their chain of small elementwise kernels (norms in float32
pieces, RoPE, residual adds, SiLU-mul: ~2.3 ms of a GLM-4-9B step on the H200). Parameters are
graph inputs, so each piece compiles once and serves every layer; the attention and the LM head
stay as they are. The caches' row count is marked dynamic, so one graph serves every cache size
(left static, each size is another compile and past Dynamo's recompile limit the piece runs
eagerly; timed against static rows on the H200, GLM-4-9B, ms: dense 1M 29.32 / 29.33, LOCKS 1M
10.86 / 10.87, dense 32K 6.79 / 6.79, LOCKS 32K 7.01 / 6.89, within the run-to-run spread).
"""

from __future__ import annotations

import torch

from kvlocks.config import KernelOptions, default_kernel_options
from kvlocks.engine.attention import make_attention
from kvlocks.engine.cache import StaticPagedCache
from kvlocks.engine.fused import fused_qkv
from kvlocks.engine.parts import ModelParts, finish_layer, project_and_write

# torch.compile mode of the two pieces on a GPU up to KernelOptions.compile_mode_max_batch sequences
# (on the CPU, and above that batch, the default mode): Inductor times its Triton GEMM templates
# against cuBLAS for each weight product at its exact batch (the step's own CUDA graph stays ours).
# H200, GLM-4-9B, PDL on, ms default mode -> max-autotune: batch 1 LOCKS 32K 6.572 / 6.566 -> 6.405 /
# 6.396, dense 32K 6.769 / 6.701 -> 6.385 / 6.378, LOCKS 1M 10.880 -> 10.664, dense 1M 25.253 ->
# 25.193; at 256K, batch 2 / 3 / 4, LOCKS 8.51 / 9.38 / 10.64 -> 9.35 / 9.91 / 11.08, dense 15.23 /
# 19.83 / 24.78 -> 16.28 / 20.42 / 25.26 (docs/benchmarks.md).
COMPILE_MODE = "max-autotune-no-cudagraphs"


def compile_mode(device_type: str, batch: int, max_batch: int) -> str | None:
    """torch.compile mode of the step's pieces: COMPILE_MODE on a GPU up to ``max_batch`` sequences
    (``KernelOptions.compile_mode_max_batch``), else the default (None)."""
    return COMPILE_MODE if device_type == "cuda" and batch <= max_batch else None


class DecodeStep:
    """Callable decode step over a :class:`StaticPagedCache` (see the module docstring).

    Parameters
    ----------
    parts : ModelParts of the model
    cache : StaticPagedCache holding the prompt (length set)
    method : ``"locks"`` or ``"dense"``
    backend : ``"triton"`` or ``"torch"``
    compile : run the per-layer pieces around the attention through ``torch.compile``
    options : KernelOptions (None: the defaults): ``compile_mode_max_batch``; ``pdl`` for the
        attention's kernels and Inductor's (``torch._inductor.config.triton.enable_pdl``, where this
        torch has it, applied while the step runs: the pieces compile at its first call)
    """

    def __init__(self, parts: ModelParts, cache: StaticPagedCache, *, method: str, backend: str,
                 compile: bool = False, options: KernelOptions | None = None) -> None:
        self.parts, self.cache, self.backend, self.compiled = parts, cache, backend, compile
        self.options = options or default_kernel_options()
        self.compile_mode = (compile_mode(cache.k.device.type, cache.batch, self.options.compile_mode_max_batch)
                             if compile else None)
        self._qkv = torch.compile(project_and_write, dynamic=False, mode=self.compile_mode) if compile \
            else project_and_write
        self._finish = torch.compile(finish_layer, dynamic=False, mode=self.compile_mode) if compile else finish_layer
        self._fused = [fused_qkv(layer.self_attn)[:2] for layer in parts.layers]
        dev = cache.k.device
        self.tokens = torch.zeros(cache.batch, dtype=torch.long, device=dev)  # [B] next input token
        self.lens_next = torch.zeros_like(cache.seq_lens)  # [B] int32
        self.attn = make_attention(method, cache, num_q_heads=parts.num_q_heads, scale=parts.scale,
                                   dtype=parts.dtype, backend=backend, options=self.options)
        self.logits = None  # [B, V] of the last step (a graph output when replayed)
        n, s = cache.num_pages, cache.page_size
        self._k_flat = [cache.k[i].view(n * s, *cache.k.shape[-2:]) for i in range(cache.k.shape[0])]
        self._v_flat = [cache.v[i].view(n * s, *cache.v.shape[-2:]) for i in range(cache.v.shape[0])]
        if compile:
            from torch._dynamo import maybe_mark_dynamic

            for t in (*self._k_flat, *self._v_flat):
                maybe_mark_dynamic(t, 0)

    def fills_page(self, length: int) -> bool:
        """Whether the step taken at common length ``length`` fills a page whose summary LOCKS must
        build (dense keeps no summaries)."""
        return self.attn.name == "locks" and (length + 1) % self.cache.page_size == 0

    @torch.no_grad()
    def __call__(self, *, build: bool = True) -> torch.Tensor:
        """Decode one token per sequence; returns logits ``[B, V]`` (model dtype). ``build=False``
        leaves out the incremental summary builds (one launch per layer), for a step that fills no
        page (:meth:`fills_page`); with ``build=True`` they run and build only what filled."""
        if self.compiled and self.options.pdl:
            import torch._inductor.config as inductor_config  # noqa: PLC0415

            if hasattr(inductor_config.triton, "enable_pdl"):
                with inductor_config.patch({"triton.enable_pdl": True}):
                    return self._step(build)
        return self._step(build)

    def _step(self, build: bool) -> torch.Tensor:
        p, c = self.parts, self.cache
        bsz, s = c.batch, c.page_size
        torch.add(c.seq_lens, 1, out=self.lens_next)
        pos = c.seq_lens.long()  # [B] position of the new token
        page = c.block_table.gather(1, (pos // s).unsqueeze(1)).squeeze(1).long()  # [B] physical page
        slot = page * s + pos % s  # [B] row of the flattened [num_pages * S, Hkv, D] cache
        x = p.embed(self.tokens.unsqueeze(1))  # [B, 1, H]
        cos, sin = p.rotary(x, pos.unsqueeze(1))
        hq, d = p.num_q_heads, p.head_dim
        for li, layer in enumerate(p.layers):
            q = self._qkv(p, layer, x, cos, sin, self._fused[li], self._k_flat[li], self._v_flat[li],
                          slot)  # [B, Hq, D], the new K/V written
            out = self.attn.run(li, q, self.lens_next, build=build)  # [B, Hq, D]
            x = self._finish(layer, x, out.reshape(bsz, 1, hq * d))
        logits = p.lm_head(p.norm(x))[:, 0]  # [B, V]
        torch.argmax(logits, dim=-1, out=self.tokens)
        c.seq_lens.copy_(self.lens_next)
        self.logits = logits
        return logits
