"""One single-token decode step of every sequence, with static shapes and device-side state only.

State (all on the device, allocated once): ``tokens [B]`` int64 (the token to feed), the cache's
``seq_lens [B]`` int32 (tokens already cached) and ``lens_next [B]`` int32. A step: embed the
tokens, RoPE at position ``seq_lens``, and per layer the model's input norm, q/k/v projections and
``apply_rotary_pos_emb``, the new K/V written to slot ``block_table[b, pos // S] * S + pos % S``
by ``index_copy_`` (a device-side index), attention (locks or dense), ``o_proj``, the
post-attention norm and MLP; then the final norm, LM head and greedy argmax, written back into
``tokens``, and ``seq_lens += 1``. Nothing reads a device value on the host (Triton backend), so
the step is captured once in a CUDA graph and replayed: each replay decodes one more token.

With ``compile=True`` the two per-layer pieces around the attention (input norm + q/k/v
projections + RoPE, and o_proj + residuals + post-attention norm + MLP) run through
``torch.compile``: Inductor fuses their chain of small elementwise kernels (norms in float32
pieces, RoPE, residual adds, SiLU-mul: ~2.3 ms of a GLM-4-9B step on the H200,
``scripts/device/step_profile.py``). Parameters are graph inputs, so each piece compiles once
and serves every layer; the attention, the K/V writes and the LM head stay as they are.
"""

from __future__ import annotations

import torch

from kvlocks.engine.attention import make_attention
from kvlocks.engine.cache import StaticPagedCache
from kvlocks.engine.fused import fused_qkv
from kvlocks.engine.parts import ModelParts, finish_layer, project_and_write, project_qkv

# Each layer's q/k/v projections as one product over the three weights laid out in one matrix
# (kvlocks.engine.fused: the modules' parameters become views of it, no memory added): two fewer
# launches per layer. On since session 11 (H200, GLM-4-9B, LOCKS: 11.76 -> 11.08 ms per step at 1M,
# 7.74 -> 7.08 at 32K; scripts/device/select_ab.py --modes skip_idle_builds,fused_qkv).
FUSE_QKV = True
# The new token's K/V written inside the compiled projection piece (parts.project_and_write) instead
# of by two index_copy_ launches per layer after it (session 5's profile, GLM-4-9B at 1M: 80 launches,
# 0.18 ms per step for 1 KB each; on the CPU Inductor writes both rows in place from one fused
# kernel). On since session 11 (H200, GLM-4-9B, LOCKS: 11.76 -> 11.60 ms at 1M, 7.74 -> 7.66 at 32K).
KV_WRITE_IN_PIECE = True
# With KV_WRITE_IN_PIECE the caches are inputs of the compiled piece, and their row count differs
# with every max_context: left static, each size is another compile, and past Dynamo's recompile
# limit (8) the piece runs eagerly (seen on the H200, session 11: the e2e bench's 9th and 10th cache
# sizes were 7% slower dense, 20% LOCKS). Marked dynamic, one graph serves every size; a symbolic
# row count only moves the writes' bounds. Timed against static rows on the H200 (session 12,
# select_ab.py --modes defaults11,static_cache_rows, GLM-4-9B, ms dynamic / static): dense 1M 29.32 /
# 29.33, LOCKS 1M 10.86 / 10.87, dense 32K 6.79 / 6.79, LOCKS 32K 7.01 / 6.89 (one run each; that row's
# run-to-run spread in session 11 was 7.03-7.08).
DYNAMIC_CACHE_ROWS = True
# torch.compile mode of the two pieces on a GPU (on the CPU they compile in the default mode):
# "max-autotune-no-cudagraphs" lets Inductor time its Triton GEMM templates against cuBLAS for each
# weight product at its exact batch (the step's own CUDA graph stays ours), None keeps cuBLAS. Its
# first compile takes longer (each product's candidates are timed once, outside the decode's timing).
# Max-autotune since session 19 (H200, GLM-4-9B, batch 1, PDL on, select_ab.py --modes
# defaults19,max_autotune, ms None -> max-autotune): LOCKS 32K 6.572 / 6.566 -> 6.405 / 6.396, dense 32K
# 6.769 / 6.701 -> 6.385 / 6.378; LOCKS 1M 10.880 -> 10.664, dense 1M 25.253 -> 25.193
# (docs/results/gpu_session19/call3). cuBLAS streams these products' weights at 2.4-4.4 TB/s (the
# 4096 x 4096 o_proj slowest); a hand-written Triton small-batch product beat it by 0.38 ms per
# GLM-4-9B step at batch 1 alone (session 19, call2; removed once Inductor's own templates were in).
# At batch 2-4 the same mode is slower for both methods (GLM-4-9B 256K on one machine, select_ab.py
# --modes defaults19b,max_autotune_all, ms LOCKS / dense, this limit -> max-autotune at every batch:
# batch 2 8.51 / 15.23 -> 9.35 / 16.28, 3 9.38 / 19.83 -> 9.91 / 20.42, 4 10.64 / 24.78 -> 11.08 / 25.26;
# docs/results/gpu_session20/call2), so it applies up to this batch only.
COMPILE_MODE = "max-autotune-no-cudagraphs"
COMPILE_MODE_MAX_BATCH = 1
# Inductor's own programmatic dependent launch for the compiled pieces' Triton kernels
# (``torch._inductor.config.triton.enable_pdl``, where this torch has it), applied while the step
# runs (the pieces compile at its first call), together with kvlocks.pdl for the attention's kernels:
# each compiled kernel waits before reading what the kernel ahead wrote and lets the next launch early.
# On since session 19 (H200, GLM-4-9B, batch 1, with cuda_mma.SCORE_PDL; select_ab.py --modes
# defaults11,inductor_pdl, ms off -> on): LOCKS 32K 6.536 / 6.540 -> 6.500 / 6.509, dense 32K 6.806 /
# 6.732 -> 6.687 / 6.682; LOCKS 1M 10.867 -> 10.760, dense 1M 24.906 -> 24.785 (docs/results/gpu_session19).
INDUCTOR_PDL = True


def compile_mode(device_type: str, batch: int) -> str | None:
    """torch.compile mode of the step's pieces: COMPILE_MODE on a GPU up to COMPILE_MODE_MAX_BATCH
    sequences, else the default (None)."""
    return COMPILE_MODE if device_type == "cuda" and batch <= COMPILE_MODE_MAX_BATCH else None


class DecodeStep:
    """Callable decode step over a :class:`StaticPagedCache` (see the module docstring).

    Parameters
    ----------
    parts : ModelParts of the model
    cache : StaticPagedCache holding the prompt (length set)
    method : ``"locks"`` or ``"dense"``
    backend : ``"triton"`` or ``"torch"``
    compile : run the per-layer pieces around the attention through ``torch.compile``
    """

    def __init__(self, parts: ModelParts, cache: StaticPagedCache, *, method: str, backend: str,
                 compile: bool = False) -> None:
        self.parts, self.cache, self.backend, self.compiled = parts, cache, backend, compile
        self._write_in_piece = KV_WRITE_IN_PIECE
        piece = project_and_write if self._write_in_piece else project_qkv
        self.compile_mode = compile_mode(cache.k.device.type, cache.batch) if compile else None
        self._qkv = torch.compile(piece, dynamic=False, mode=self.compile_mode) if compile else piece
        self._finish = torch.compile(finish_layer, dynamic=False, mode=self.compile_mode) if compile else finish_layer
        self._fused = [fused_qkv(layer.self_attn)[:2] for layer in parts.layers] if FUSE_QKV else None
        dev = cache.k.device
        self.tokens = torch.zeros(cache.batch, dtype=torch.long, device=dev)  # [B] next input token
        self.lens_next = torch.zeros_like(cache.seq_lens)  # [B] int32
        self.attn = make_attention(method, cache, num_q_heads=parts.num_q_heads, scale=parts.scale,
                                   dtype=parts.dtype, backend=backend)
        self.logits = None  # [B, V] of the last step (a graph output when replayed)
        n, s = cache.num_pages, cache.page_size
        self._k_flat = [cache.k[i].view(n * s, *cache.k.shape[-2:]) for i in range(cache.k.shape[0])]
        self._v_flat = [cache.v[i].view(n * s, *cache.v.shape[-2:]) for i in range(cache.v.shape[0])]
        if compile and self._write_in_piece and DYNAMIC_CACHE_ROWS:
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
        if self.compiled and INDUCTOR_PDL:
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
            qkv = self._fused[li] if self._fused is not None else None
            if self._write_in_piece:
                q = self._qkv(p, layer, x, cos, sin, qkv, self._k_flat[li], self._v_flat[li], slot)  # [B, Hq, D]
            else:
                q, k, v = self._qkv(p, layer, x, cos, sin, qkv)  # [B, Hq, 1, D], [B, Hkv, 1, D]
                self._k_flat[li].index_copy_(0, slot, k[:, :, 0])
                self._v_flat[li].index_copy_(0, slot, v[:, :, 0])
                q = q[:, :, 0].contiguous()
            out = self.attn.run(li, q, self.lens_next, build=build)  # [B, Hq, D]
            x = self._finish(layer, x, out.reshape(bsz, 1, hq * d))
        logits = p.lm_head(p.norm(x))[:, 0]  # [B, V]
        torch.argmax(logits, dim=-1, out=self.tokens)
        c.seq_lens.copy_(self.lens_next)
        self.logits = logits
        return logits
