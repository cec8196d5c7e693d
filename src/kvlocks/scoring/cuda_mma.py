"""Page scoring (Eq. 4) in CUDA with hand-placed tensor-core fragments (``score_mma.cu``; mma: the
tensor cores' warp-level matrix multiply-accumulate instruction, ``mma.sync``).

Same contract as :func:`kvlocks.scoring.triton.score_pages_paged` (which dispatches here on CUDA
where :func:`kvlocks.kernels_support.score_kernel` picks it): it writes the workspace's per-head scores and per-program
statistics, then the same Triton combine kernel turns them into the ranking. How the kernel works
is described at the top of ``score_mma.cu``; measurements are in ``docs/benchmarks.md``.

The source is compiled by nvcc at first use on a GPU and cached (:mod:`kvlocks._nvcc`); where nvcc
is missing or the compile fails, :func:`available` is False (with the reason in
:func:`unavailable_reason`) and the Triton kernels run instead. The launch is asynchronous on the
current stream with no host synchronisation, so it is captured by CUDA graphs like the Triton
kernels.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch

from kvlocks._nvcc import CudaSource
from kvlocks.cache.layout import SummaryStore
from kvlocks.kernels_support import CUDA_HEAD_DIMS, CUDA_TILE, score_kernel
from kvlocks.pdl import enabled as pdl_enabled
from kvlocks.scoring.triton_combine import LOG2E, ScoreWorkspace, finish_scores

SOURCE = Path(__file__).with_name("score_mma.cu")
# warps per block; 2 timed on the H200 (glm4-9b-1m): 1M 101.0 vs 102.8 us, 32K 14.5 vs 12.2 (docs/benchmarks.md)
WARPS = 4
TILE = CUDA_TILE  # pages per warp iteration: pages per program are a multiple of it
_DTYPES = {torch.float16: 0, torch.bfloat16: 1}
# Launch variants timed on the H200 and not kept (docs/benchmarks.md): each sequence's tiles split
# evenly over its row's programs (1M 105.0 -> 100.9 us, 256K 34.6 -> 35.3, GLM-4-9B TPOT within
# noise); 6 resident blocks per SM (GLM-4-9B TPOT at 1M 11.82 -> 12.20 ms); one tile per program
# with its groups over the warps (glm4-9b-1m 16K 10.5 vs 11.8 us, but 32K 14.4 vs 12.2).


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.kvlocks_score_mma.argtypes = [vp, i64, i64, i32, vp, vp, vp, vp, vp, vp, vp, i64, vp, vp, vp,
                                      i32, i32, i32, i32, i32, i32, i32, ctypes.c_float, i32, i32, vp]
    lib.kvlocks_score_mma.restype = i32
    lib.kvlocks_score_mma_blocks_per_sm.argtypes = [i32, i32]
    lib.kvlocks_score_mma_blocks_per_sm.restype = i32


_SOURCE = CudaSource(SOURCE, "CUDA score kernel", "the Triton kernels score pages", _declare)
_library = _SOURCE.library
available = _SOURCE.available
unavailable_reason = _SOURCE.unavailable_reason


def pages_per_program(max_pages: int, rows: int, device, head_dim: int = 128, group: int = 8) -> int:
    """Pages per program for about one wave of resident blocks: a multiple of ``TILE * WARPS``
    (the warps take tiles of 16 pages in turn)."""
    device = torch.device(device)
    nt = 2 if group > 8 else 1
    per_sm = max(1, _library(device).kvlocks_score_mma_blocks_per_sm(head_dim, nt))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_row = max(1, per_sm * sms // max(rows, 1))
    step = TILE * WARPS
    return max(step, -(-(-(-max_pages // per_row)) // step) * step)


def score_pages_mma(queries: torch.Tensor, summaries: SummaryStore, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, *, scale: float | None = None, combine: str = "mean_share",
                    workspace: ScoreWorkspace | None = None, rank: bool = True, pdl: bool = True):
    """Same contract as :func:`kvlocks.scoring.triton.score_pages_paged`; ``pdl``: launched with
    programmatic dependent launch where the device supports it (:mod:`kvlocks.pdl`)."""
    bsz, hq, d = queries.shape
    hkv = summaries.num_kv_heads
    g = hq // hkv
    max_pages = block_table.shape[1]
    score_kernel(queries, g, summaries.rank, workspace.ppp if workspace is not None else TILE, choice="cuda",
                 cuda_library=lambda: available(queries.device))
    ws = workspace or ScoreWorkspace.allocate(bsz, hkv, g, max_pages, queries.device,
                                              pages_per_program(max_pages, bsz * hkv, queries.device, d, g))
    if summaries.page_size != TILE or d not in CUDA_HEAD_DIMS:
        raise ValueError(f"the CUDA score kernel needs page size {TILE} and head_dim in {CUDA_HEAD_DIMS}, got "
                         f"S={summaries.page_size}, D={d}")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_table.stride(-1) != 1:
        raise ValueError("block_table and seq_lens must be int32, the block table with unit stride along pages")
    for name in ("basis", "basis_scale", "coef", "coef_scale", "centroid", "centroid_scale"):
        t = getattr(summaries, name)
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"summaries.{name} must be contiguous and 16-byte aligned (the kernel copies 16-byte chunks)")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    lib = _library(queries.device)
    st = summaries
    err = lib.kvlocks_score_mma(
        queries.data_ptr(), queries.stride(0), queries.stride(1), _DTYPES[queries.dtype], st.basis.data_ptr(),
        st.basis_scale.data_ptr(), st.coef.data_ptr(), st.coef_scale.data_ptr(), st.centroid.data_ptr(),
        st.centroid_scale.data_ptr(), block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
        ws.scores.data_ptr(), ws.stats.data_ptr(), bsz, hkv, g, ws.stats.shape[-1], max_pages,
        ws.n_chunks, ws.ppp, scale * LOG2E, d, int(pdl_enabled(queries.device, pdl)),
        torch.cuda.current_stream(queries.device).cuda_stream)
    if err:
        reason = "unsupported head_dim/group" if err == -1 else _SOURCE.error(queries.device, err)
        raise RuntimeError(f"CUDA score kernel launch failed: {reason} (D={d}, G={g})")
    return finish_scores(ws, seq_lens, hkv, g, max_pages, summaries.page_size, combine, rank)
