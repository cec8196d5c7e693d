"""Page scoring (Eq. 4) for GQA groups up to 16: the "packed" score kernel (it reads the int4 basis as
packed bytes, two values a byte, and converts them with packed half2 arithmetic: below).

Same inputs, outputs and combine step as :func:`kvlocks.scoring.triton.score_pages_paged`, which
dispatches here on CUDA for half-precision queries, G <= 16 and rank 8 when the CUDA kernel
(:mod:`kvlocks.scoring.cuda_mma`) is not available or does not take the head_dim (256)
(:func:`kvlocks.kernels_support.score_kernel`).
Per step of BLOCK pages:

- the basis tile is ``[BLOCK * R, D / 2]`` bytes (no padded rows) and the projection is two
  float16 tensor-core dots with K = D / 2: low nibbles (even elements) against q's even half,
  high nibbles against its odd half, so no interleave;
- on CUDA the nibbles become float16 by packed half2 arithmetic in inline PTX
  (:func:`_int4_pairs_to_f16`, 1.25 instructions per value instead of ~5; exact); q is scaled by a
  power of two into float16's range first and the scale is undone on the float32 result;
- int8 centroid and coefficients become floats by OR-ing them into the mantissa of 2**23 (no
  int-to-float conversion instructions; exact);
- the query-head dimension is G rounded up to a power of two, not padded to 16;
- the per-page coefficient contraction (K = R = 8, below Triton 3.6's minimum of 16 for a dot)
  takes pages in pairs: block-diagonal ``[2S, 2R]`` coefficients times the pair's stacked
  ``[2R, G]`` projections, two float16 tensor-core dots on an exact hi/lo split (COEF = 3), or
  float32 FMAs on a ``[BLOCK, S, R, G]`` broadcast (COEF = 2, the default for G = 1; it spills
  registers from G = 8). The page-pair dots with a single head (N = 1) gave wrong scores on the
  H200 at 16-32 pages per step (right at 8; the interpreter agrees with the reference; cause not
  found), so they are never run for G = 1 on CUDA.

H200, 1M tokens, batch 1: 456 us (llama3-8b shape, G = 4) and 246 us (glm4-9b-1m, G = 8) against
952 / 498 us for the three-dot kernel; G = 1 (32 KV heads) 1255 vs 3836 us; G = 16 236 vs 275 us
(analysis in ``docs/benchmarks.md``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvlocks.cache.layout import SummaryStore, dot_dtype
from kvlocks.kernels_support import KERNEL_HEAD_DIMS
from kvlocks.scoring.triton_combine import (
    LOG2E, ScoreWorkspace, finish_scores, launch_sizes, row_chunk, store_and_fold,
)


@triton.jit
def _small_int_to_f32(x, bias: tl.constexpr):
    """int32 ``x`` in [0, 2**23) to float32 ``x - bias``, exactly, without an int-to-float
    conversion: OR-ed into the mantissa of 2**23 it reads as 2**23 + x."""
    return (x | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def _int4_pairs_to_f16(by):
    """uint8 bytes (two int4, two's complement) -> (low nibble, high nibble) as float16, four bytes
    per call with packed half2 arithmetic: bytes spread to 16-bit lanes (prmt), each nibble OR-ed
    into the mantissa of 1024 with its sign bit flipped (lop3), then one sub/fma per two values.
    Exact. CUDA only (inline PTX)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, k0, k1, k2;
        mov.b32 k0, 0x64086408;
        mov.b32 k1, 0x2C002C00;
        mov.b32 k2, 0xD480D480;
        prmt.b32 t0, $4, 0, 0x4140;
        prmt.b32 t1, $4, 0, 0x4342;
        lop3.b32 $0, t0, 0x000F000F, 0x64086408, 0x6a;
        lop3.b32 $1, t1, 0x000F000F, 0x64086408, 0x6a;
        lop3.b32 $2, t0, 0x00F000F0, 0x64806480, 0x6a;
        lop3.b32 $3, t1, 0x00F000F0, 0x64806480, 0x6a;
        sub.f16x2 $0, $0, k0;
        sub.f16x2 $1, $1, k0;
        fma.rn.f16x2 $2, $2, k1, k2;
        fma.rn.f16x2 $3, $3, k1, k2;
        }""",
        constraints="=r,=r,=r,=r,r", args=[by], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _score_packed_kernel(q_ptr, stride_qb, stride_qh, basis_ptr, bscale_ptr, coef_ptr, cscale_ptr, cen_ptr,
                     censcale_ptr, bt_ptr, stride_bt, seqlen_ptr, scores_ptr, stats_ptr,
                     Hkv, G, max_pages, n_chunks, pages_per_prog, qk_scale,
                     GQ: tl.constexpr, D: tl.constexpr, S: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr,
                     DOT_DT: tl.constexpr, PREC: tl.constexpr, UNPACK: tl.constexpr,
                     COEF: tl.constexpr = 2):
    pid_c = tl.program_id(0)
    row = tl.program_id(1)  # b * Hkv + h
    b = row // Hkv
    h = row % Hkv
    pc = tl.load(seqlen_ptr + b) // S
    g = tl.arange(0, GQ)
    gm = (g < G)[None, :]
    jj = tl.arange(0, D // 2)
    dd = tl.arange(0, D)
    q_row = q_ptr + b * stride_qb + (h * G + g)[None, :] * stride_qh
    q_even = tl.load(q_row + 2 * jj[:, None], mask=gm, other=0.0).to(tl.float32)  # [D/2, GQ]
    q_odd = tl.load(q_row + 2 * jj[:, None] + 1, mask=gm, other=0.0).to(tl.float32)
    q_all = tl.load(q_row + dd[:, None], mask=gm, other=0.0).to(tl.float32)  # [D, GQ]
    if DOT_DT == tl.float16:  # scale q by a power of two into float16's range (exact), undone below
        qmax = tl.max(tl.max(tl.abs(q_all), axis=1), axis=0)
        e = tl.where(qmax > 0, tl.floor(tl.log2(16384.0 / tl.where(qmax > 0, qmax, 1.0))), 0.0)
        e = tl.minimum(tl.maximum(e, -126.0), 127.0).to(tl.int32)
        q_scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        q_unscale = ((127 - e) << 23).to(tl.float32, bitcast=True)
        q_even = q_even * q_scale
        q_odd = q_odd * q_scale
        q_all = q_all * q_scale
    else:
        q_unscale = 1.0
    q_even = q_even.to(DOT_DT)
    q_odd = q_odd.to(DOT_DT)
    q_all = q_all.to(DOT_DT)
    m = tl.arange(0, BLOCK * R)
    mp = m // R
    mr = m % R
    s_idx = tl.arange(0, S)
    r_idx = tl.arange(0, R)
    pb = tl.arange(0, BLOCK)
    m_run = tl.full([GQ], float("-inf"), tl.float32)
    l_run = tl.zeros([GQ], tl.float32)
    start, end = row_chunk(pc, pid_c, n_chunks, pages_per_prog, BLOCK)
    btr = bt_ptr + b.to(tl.int64) * stride_bt
    basis_u8 = basis_ptr.to(tl.pointer_type(tl.uint8))
    cen_u8 = cen_ptr.to(tl.pointer_type(tl.uint8))
    coef_u8 = coef_ptr.to(tl.pointer_type(tl.uint8))
    for p0 in range(start, end, BLOCK):
        p = p0 + pb
        pmask = p < end
        ph = tl.load(btr + p, mask=pmask, other=0).to(tl.int64) * Hkv + h  # (page, head) record [BLOCK]
        mmask = (p0 + mp) < end
        ph_m = tl.load(btr + p0 + mp, mask=mmask, other=0).to(tl.int64) * Hkv + h  # [BLOCK * R]
        by = tl.load(basis_u8 + (ph_m * R + mr)[:, None] * (D // 2) + jj[None, :], mask=mmask[:, None], other=0)
        if UNPACK == 2:
            lo, hi = _int4_pairs_to_f16(by)
        else:
            by = by.to(tl.int32) ^ 0x88  # nibbles offset-binary: n + 8
            lo = _small_int_to_f32(by & 15, 8.0).to(DOT_DT)
            hi = _small_int_to_f32(by >> 4, 8.0).to(DOT_DT)
        proj = tl.dot(lo, q_even, input_precision=PREC)
        proj = tl.dot(hi, q_odd, acc=proj, input_precision=PREC)  # [BLOCK * R, GQ]
        proj = proj * (tl.load(bscale_ptr + ph_m * R + mr, mask=mmask, other=0.0).to(tl.float32) * q_unscale)[:, None]
        cb = tl.load(cen_u8 + ph[:, None] * D + dd[None, :], mask=pmask[:, None], other=0x80).to(tl.int32) ^ 0x80
        qmu = tl.dot(_small_int_to_f32(cb, 128.0).to(DOT_DT), q_all, input_precision=PREC)  # [BLOCK, GQ]
        qmu = qmu * (tl.load(censcale_ptr + ph, mask=pmask, other=0.0).to(tl.float32) * q_unscale)[:, None]
        if COEF == 2:
            ccb = tl.load(coef_u8 + ph[:, None, None] * (S * R) + s_idx[None, :, None] * R + r_idx[None, None, :],
                          mask=pmask[:, None, None], other=0x80).to(tl.int32) ^ 0x80
            c = _small_int_to_f32(ccb, 128.0)  # [BLOCK, S, R] float32, exact
            p3 = tl.reshape(proj, (BLOCK, R, GQ))
            acc = tl.sum(c[:, :, :, None] * p3[:, None, :, :], axis=2)  # [BLOCK, S, GQ], float32 FMAs
        else:  # pages in pairs: block-diagonal coefficients [2S, 2R] x projections [2R, GQ], K = 2R = 16
            # (Triton 3.6 has no dot with K = R = 8); the projections as an exact float16 hi/lo pair
            ii = tl.arange(0, 2 * S)
            kk = tl.arange(0, 2 * R)
            pair = tl.arange(0, BLOCK // 2)
            pg = 2 * pair[:, None, None] + (ii // S)[None, :, None]  # page of row i within the block
            diag = ((ii // S)[:, None] == (kk // R)[None, :])[None, :, :] & (p0 + pg < end)
            php = tl.load(btr + p0 + pg, mask=diag, other=0).to(tl.int64) * Hkv + h
            ccb = tl.load(coef_u8 + php * (S * R) + ((ii % S) * R)[None, :, None] + (kk % R)[None, None, :],
                          mask=diag, other=0).to(tl.int32) ^ 0x80  # off the diagonal: raw 0 = value 0
            c2 = _small_int_to_f32(ccb, 128.0).to(tl.float16)  # [BLOCK/2, 2S, 2R], exact
            p3 = tl.reshape(proj, (BLOCK // 2, 2 * R, GQ))
            # per (pair, head) power-of-two scale into float16's range, undone on the float32 result
            pmax = tl.max(tl.abs(p3), axis=1)  # [BLOCK/2, GQ]
            pe = tl.where(pmax > 0, tl.floor(tl.log2(16384.0 / tl.where(pmax > 0, pmax, 1.0))), 0.0)
            pe = tl.minimum(tl.maximum(pe, -126.0), 127.0).to(tl.int32)
            p3 = p3 * ((pe + 127) << 23).to(tl.float32, bitcast=True)[:, None, :]
            p_hi = p3.to(tl.float16)
            acc = tl.dot(c2, p_hi)
            acc = tl.dot(c2, (p3 - p_hi.to(tl.float32)).to(tl.float16), acc=acc)  # [BLOCK/2, 2S, GQ]
            acc = acc * ((127 - pe) << 23).to(tl.float32, bitcast=True)[:, None, :]
            acc = tl.reshape(acc, (BLOCK, S, GQ))
        cs = tl.load(cscale_ptr + ph[:, None] * S + s_idx[None, :], mask=pmask[:, None], other=0.0).to(tl.float32)
        logit = (acc * cs[:, :, None] + qmu[:, None, :]) * qk_scale  # log2 units
        mx = tl.max(logit, axis=1)
        lse2 = mx + tl.log2(tl.sum(tl.exp2(logit - mx[:, None, :]), axis=1))  # [BLOCK, GQ]
        m_run, l_run = store_and_fold(lse2, p, pmask, g, row, G, max_pages, scores_ptr, m_run, l_run)
    st = stats_ptr + ((row * n_chunks + pid_c) * 2) * GQ + g
    tl.store(st, m_run)
    tl.store(st + GQ, l_run)


# launch shapes measured best on the H200 (docs/benchmarks.md); tuned once per shape on CUDA
_PACKED_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w, num_stages=st)
                   for b, w, st in ((16, 2, 2), (32, 4, 2), (32, 4, 1), (16, 4, 2))]
_score_packed_tuned = triton.autotune(_PACKED_CONFIGS, key=["Hkv", "G", "D", "R", "pages_per_prog"])(
    _score_packed_kernel)
# head_dim 256: 16 pages per step, so the per-step tiles (basis bytes [BLOCK * R, D / 2], their two
# float16 halves, centroids [BLOCK, D]) are the size of D = 128's at 32 pages; 16 is also the
# smallest M of the centroid dot. 4 or 8 warps: sm_90 cubins (Triton 3.9, G 1-8) spill 48-152 B
# per thread at 4 warps (D = 128's measured best, 32 pages and 4 warps, spills 128 B), none at 8
# (196-206 registers), 520-584 B at 2 warps (tests/test_triton_compile_d256.py prints them).
_PACKED_CONFIGS_256 = [triton.Config({"BLOCK": 16}, num_warps=w, num_stages=st)
                       for w, st in ((4, 2), (4, 1), (8, 2), (8, 1))]
_score_packed_tuned_256 = triton.autotune(_PACKED_CONFIGS_256, key=["Hkv", "G", "D", "R", "pages_per_prog"])(
    _score_packed_kernel)


def tuned_launch(head_dim: int = 128):
    """The launch configuration the packed-score autotuner of ``head_dim`` chose last (None before a
    tuned CUDA call at that head_dim)."""
    return getattr(_score_packed_tuned_256 if head_dim > 128 else _score_packed_tuned, "best_config", None)


def score_pages_packed(queries: torch.Tensor, summaries: SummaryStore, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, *, scale: float | None = None, combine: str = "mean_share",
                   launch: dict | None = None, workspace: ScoreWorkspace | None = None, unpack: int | None = None,
                   dot: str = "auto", coef: int | None = None, rank: bool = True):
    """Same contract as :func:`kvlocks.scoring.triton.score_pages_paged`.

    ``unpack``: 2 = inline-PTX half2 unpacking (CUDA only, the default there), 1 = portable bit
    tricks (the Triton interpreter). ``coef``: 3 = the coefficient contraction as float16 tensor-core
    dots on block-diagonal page pairs (default for G >= 2), 2 = float32 FMAs on a broadcast
    (default for G = 1). ``dot="fp16"`` runs the projection dots in float16 for
    bfloat16 queries too (always so with ``unpack=2``), to test that path in the interpreter.
    """
    bsz, hq, d = queries.shape
    hkv, s, r = summaries.num_kv_heads, summaries.page_size, summaries.rank
    g = hq // hkv
    if d not in KERNEL_HEAD_DIMS:
        raise ValueError(f"head_dim={d}: the packed score kernel supports {KERNEL_HEAD_DIMS}")
    if r not in (8, 16):
        raise ValueError(f"rank={r}: the packed score kernel supports ranks 8 and 16")
    if unpack not in (None, 1, 2) or (unpack == 2 and not queries.is_cuda):
        raise ValueError(f"unpack={unpack!r}: allowed 1 (portable) or 2 (inline PTX, CUDA tensors only)")
    if dot not in ("auto", "fp16"):
        raise ValueError(f"dot={dot!r}: allowed 'auto' or 'fp16'")
    max_pages = block_table.shape[1]
    ws = workspace or ScoreWorkspace.allocate(bsz, hkv, g, max_pages, queries.device,
                                              launch_sizes(max_pages, bsz * hkv, queries.device, 32))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    tuned = queries.is_cuda and not launch
    kernel = (_score_packed_tuned_256 if d > 128 else _score_packed_tuned) if tuned else _score_packed_kernel
    launch = {} if tuned else dict(launch or {"BLOCK": 16})
    half = queries.dtype != torch.float32
    if unpack is None:
        unpack = 2 if half and queries.is_cuda else 1
    gq = triton.next_power_of_2(g)
    if coef is None:
        coef = 3 if gq >= 2 else 2
    if coef not in (2, 3):
        raise ValueError(f"coef={coef!r}: allowed 2 (FMA broadcast) or 3 (block-diagonal page-pair dots)")
    if coef == 3 and gq == 1 and queries.is_cuda:
        raise ValueError("coef=3 with G = 1 gives wrong scores on the H200 (see the module doc); use coef=2")
    dot_dt = tl.float16 if half and (unpack == 2 or dot == "fp16") else dot_dtype(queries.dtype)
    kernel[(ws.n_chunks, bsz * hkv)](
        queries, queries.stride(0), queries.stride(1), summaries.basis, summaries.basis_scale, summaries.coef,
        summaries.coef_scale, summaries.centroid, summaries.centroid_scale, block_table, block_table.stride(0),
        seq_lens, ws.scores, ws.stats, hkv, g, max_pages, ws.n_chunks, ws.ppp, scale * LOG2E,
        GQ=gq, D=d, S=s, R=r, DOT_DT=dot_dt,
        PREC="tf32" if half else "ieee", UNPACK=unpack, COEF=coef, **launch,
    )
    return finish_scores(ws, seq_lens, hkv, g, max_pages, s, combine, rank)
