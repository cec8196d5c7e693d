"""Weight products of a decode step at small batch (``y = x W^T + b`` for B <= 16 rows), in Triton.

At batch 1 the decode step's weight products are matrix-vector products that only stream their
weights; on the H200 cuBLAS runs them at ~87% of a copy kernel's bandwidth (4.83 ms of a GLM-4-9B
step for 17.7 GB, ``docs/benchmarks.md``), where the split-KV attention streams the K/V at the copy
rate. This kernel is the candidate to close that gap: grid ``cdiv(N, BLOCK_N)``, each program walks
the whole K of its BLOCK_N weight rows ``BLOCK_K`` at a time (software-pipelined loads), multiplies
them with the B activation rows padded to 16 (one ``tl.dot`` per step, so the tensor cores do the
arithmetic and the loads stay the only limit) and accumulates in float32.

Prepared, not used by the engine: ``scripts/device/gemv_probe.py`` times it against cuBLAS at the
shapes of both benchmark models and checks its output, to decide whether it goes into the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # activation rows (the padded M of the dot)
_ROWS = tl.constexpr(MAX_ROWS)  # kernels read module globals only when they are constexpr


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, B, N, K, stride_x, stride_w, stride_y,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, _ROWS)
    mmask = m < B
    acc = tl.zeros([_ROWS, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0).to(w.dtype)  # [16, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc=acc, input_precision="ieee" if w.dtype == tl.float32 else "tf32")
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, block_n: int = 16,
         block_k: int = 256, num_warps: int = 4, num_stages: int = 4, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [B, K] @ weight[N, K]^T (+ bias [N])`` -> ``[B, N]`` in x's dtype, for 1 <= B <= MAX_ROWS.

    Same result as ``torch.nn.functional.linear`` up to float32 summation order. Launch options:
    ``block_n`` weight rows per program (>= 16), ``block_k`` columns per step, warps, pipeline stages.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [B, K] and weight [N, K] needed, got {tuple(x.shape)} and {tuple(weight.shape)}")
    bsz, k = x.shape
    n = weight.shape[0]
    if not 1 <= bsz <= MAX_ROWS:
        raise ValueError(f"x has {bsz} rows: allowed 1 to {MAX_ROWS}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype}, weight {weight.dtype}: they must match")
    if block_n < 16 or block_n & (block_n - 1) or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_n={block_n}, block_k={block_k}: powers of two, at least 16")
    y = out if out is not None else torch.empty(bsz, n, dtype=x.dtype, device=x.device)
    if y.shape != (bsz, n) or y.stride(1) != 1:
        raise ValueError(f"out must be [{bsz}, {n}] with a contiguous last dim")
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, bsz, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return y
