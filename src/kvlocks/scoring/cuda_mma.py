"""Page scoring (Eq. 4) in CUDA with hand-placed tensor-core fragments (``score_mma.cu``).

Same contract as :func:`kvlocks.scoring.triton.score_pages_paged` (which dispatches here on CUDA
when :func:`supports` says so): it writes the workspace's per-head scores and per-program
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
from kvlocks.cache.layout import PagedSummaries
from kvlocks.pdl import enabled as pdl_enabled

SOURCE = Path(__file__).with_name("score_mma.cu")
HEAD_DIMS = (64, 128)
WARPS = 4
TILE = 16  # pages per warp iteration: pages per program are a multiple of it
# How a row's pages are split among its programs: False, ``ppp`` consecutive pages each (a multiple
# of TILE * warps, about one wave of resident blocks); True, the sequence's tiles in near-equal runs
# over the programs (workspace key ``balanced``; ``pages_per_program(..., balanced=True)`` sizes the
# launch to fill one wave). Same scores either way. Off: on the H200 (session 9,
# scripts/device/score_launch_probe.py, docs/results/gpu_session9/split/) it filled the wave (656-660
# programs instead of 588 / 632) and took the kernel at 1M from 105.0 to 100.9 us (glm4-9b-1m) and
# 173.7 to 170.9 (llama3-8b), but at 256K it was slower (34.6 -> 35.3, 52.2 -> 55.5: more, shorter
# programs), and whole-model GLM-4-9B TPOT moved within noise (1M 11.97 -> 11.95 ms, 32K 7.51 -> 7.58).
BALANCED = False
# Resident blocks per SM asked of the compiler (workspace key ``min_blocks``): 1 (no request: 92
# registers, 5 blocks of 4 warps per SM on sm_90) or 6 (D = 128, G <= 8, 4 warps only: at most 80
# registers and one centroid slot per warp, 24 warps per SM). 1 until 6 is measured on a GPU.
MIN_BLOCKS = 1
# Short contexts, prepared, off: where one tile per warp (the smallest static split) is the launch and
# one tile per program fits a wave, one tile per program instead, its four 4-page groups scored by the
# block's four warps (the kernel's GSPLIT variant, which the library picks for any ppp == TILE launch):
# four times the warps, each a quarter of the dependent instruction chain. At one tile per warp a tile
# costs about four times what its bytes alone do (H200, session 13, ``scripts/device/small_ctx_probe.py``,
# glm4-9b-1m, 32K: 12.5 us at 64 pages per program, 16.5 at 128, 25.7 at 256; load-only 4.8 and
# 7.6), and copying three groups at once instead of one ahead did not help, so the chain, not the
# memory, sets it. Split (session 13, call 6, us, 16 vs 64 pages per program): glm4-9b-1m 16K (256
# programs) 10.54 vs 11.80, but 32K (512) 14.41 vs 12.23 and llama3-8b 16K (512) 13.43 vs 11.40:
# the per-program set-up (queries, shared centroids and page ids per warp) outweighs the chain
# from about 512 programs. One case won, by 1.3 us per layer (0.8% of the GLM-4-9B step at 16K).
GROUP_SPLIT = False
# Launched with programmatic dependent launch (kvlocks.pdl) where that is on: the kernel may then start
# before the one ahead of it (the compiled projection piece, the incremental build) has finished, and
# waits for it first (with or without this, it lets the fused selection launch early). On since
# session 19 with step.INDUCTOR_PDL (H200, GLM-4-9B, batch 1, select_ab.py --modes
# defaults11,score_pdl,inductor_pdl twice, LOCKS ms: 32K 6.536 / 6.540 -> 6.519 / 6.536 alone, within
# the run-to-run spread, and -> 6.500 / 6.509 with Inductor's PDL; docs/results/gpu_session19).
SCORE_PDL = True
_DTYPES = {torch.float16: 0, torch.bfloat16: 1}


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.kvlocks_score_mma.argtypes = [vp, i64, i64, i32, vp, vp, vp, vp, vp, vp, vp, i64, vp, vp, vp,
                                      i32, i32, i32, i32, i32, i32, i32, i32, ctypes.c_float, i32, i32, i32,
                                      i32, vp]
    lib.kvlocks_score_mma.restype = i32
    lib.kvlocks_score_mma_blocks_per_sm.argtypes = [i32, i32, i32, i32, i32]
    lib.kvlocks_score_mma_blocks_per_sm.restype = i32


_SOURCE = CudaSource(SOURCE, "CUDA score kernel", "the Triton kernels score pages", _declare)
_library = _SOURCE.library
available = _SOURCE.available
unavailable_reason = _SOURCE.unavailable_reason


def supports(queries: torch.Tensor, group: int, summaries: PagedSummaries) -> bool:
    """CUDA, float16/bfloat16 queries with unit stride along D, G from 1 to 16, page size 16, rank 8,
    head_dim 64 or 128, and the library compiled."""
    return (queries.is_cuda and queries.dtype in _DTYPES and queries.stride(-1) == 1 and 1 <= group <= 16
            and summaries.page_size == 16 and summaries.rank == 8 and summaries.head_dim in HEAD_DIMS
            and available(queries.device))


def pages_per_program(max_pages: int, rows: int, device, head_dim: int = 128, group: int = 8,
                      warps: int = WARPS, balanced: bool | None = None, min_blocks: int | None = None,
                      group_split: bool | None = None) -> int:
    """Pages per program for about one wave of resident blocks. Static split (``balanced`` False):
    a multiple of ``TILE * warps`` (warps take tiles of 16 pages in turn), or ``TILE`` (one tile per
    program, its groups over the warps: ``group_split``, default GROUP_SPLIT) where that is the
    smallest multiple and the one-tile programs fit one wave. Balanced split: the
    smallest page count that keeps the programs within one wave; the kernel then divides each
    sequence's tiles evenly among the ``ceil(max_pages / ppp)`` programs of its row."""
    balanced = BALANCED if balanced is None else balanced
    device = torch.device(device)
    lib = _library(device)
    mb = variant_min_blocks(head_dim, group, warps, min_blocks)
    nt = 2 if group > 8 else 1
    per_sm = max(1, lib.kvlocks_score_mma_blocks_per_sm(head_dim, nt, warps, mb, 0))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_row = max(1, per_sm * sms // max(rows, 1))
    if balanced:
        return max(1, -(-max_pages // per_row))
    step = TILE * warps
    ppp = max(step, -(-(-(-max_pages // per_row)) // step) * step)
    if (GROUP_SPLIT if group_split is None else group_split) and ppp == step and warps == 4 and mb == 1:
        split_sm = lib.kvlocks_score_mma_blocks_per_sm(head_dim, nt, warps, mb, 1)
        if split_sm > 0 and rows * -(-max_pages // TILE) <= split_sm * sms:
            return TILE
    return ppp


def variant_min_blocks(head_dim: int, group: int, warps: int, min_blocks: int | None = None) -> int:
    """The compiled variant's blocks-per-SM request: ``min_blocks`` (default MIN_BLOCKS) where that
    variant exists (6: D = 128, G <= 8, 4 warps), else 1."""
    mb = MIN_BLOCKS if min_blocks is None else int(min_blocks)
    if mb not in (1, 6):
        raise ValueError(f"min_blocks={mb}: allowed 1 or 6")
    return 6 if mb == 6 and head_dim == 128 and group <= 8 and warps == 4 else 1


def score_pages_mma(queries: torch.Tensor, summaries: PagedSummaries, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, *, scale: float | None = None, combine: str = "mean_share",
                    workspace: dict | None = None, warps: int = WARPS, rank: bool = True):
    """Same contract as :func:`kvlocks.scoring.triton.score_pages_paged`."""
    from kvlocks.scoring.triton import LOG2E, finish_scores, score_workspace  # noqa: PLC0415 (cycle)

    bsz, hq, d = queries.shape
    hkv = summaries.num_kv_heads
    g = hq // hkv
    if not supports(queries, g, summaries):
        raise ValueError(
            f"the CUDA score kernel needs CUDA float16/bfloat16 queries, G in 1..16 (got {g}), page size 16, "
            f"rank 8, head_dim in {HEAD_DIMS} (got S={summaries.page_size}, R={summaries.rank}, D={d}); "
            f"library: {unavailable_reason(queries.device) or 'ok'}")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_table.stride(-1) != 1:
        raise ValueError("block_table and seq_lens must be int32, the block table with unit stride along pages")
    for name in ("basis", "basis_scale", "coef", "coef_scale", "centroid", "centroid_scale"):
        t = getattr(summaries, name)
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"summaries.{name} must be contiguous and 16-byte aligned (the kernel copies 16-byte chunks)")
    max_pages = block_table.shape[1]
    ws = workspace or score_workspace(bsz, hkv, g, max_pages, queries.device,
                                      pages_per_program=pages_per_program(max_pages, bsz * hkv, queries.device,
                                                                          d, g, warps))  # sized for `warps`
    balanced = bool(ws.get("balanced", BALANCED))
    if ws["ppp"] % TILE and not balanced:
        raise ValueError(f"workspace pages per program {ws['ppp']} is not a multiple of {TILE} (needed unless "
                         "the workspace's split is balanced)")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    lib = _library(queries.device)
    st = summaries
    err = lib.kvlocks_score_mma(
        queries.data_ptr(), queries.stride(0), queries.stride(1), _DTYPES[queries.dtype], st.basis.data_ptr(),
        st.basis_scale.data_ptr(), st.coef.data_ptr(), st.coef_scale.data_ptr(), st.centroid.data_ptr(),
        st.centroid_scale.data_ptr(), block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
        ws["scores"].data_ptr(), ws["stats"].data_ptr(), bsz, hkv, g, ws["stats"].shape[-1], max_pages,
        ws["n_chunks"], ws["ppp"], int(balanced), scale * LOG2E, d, warps,
        variant_min_blocks(d, g, warps, ws.get("min_blocks")), int(SCORE_PDL and pdl_enabled(queries.device)),
        torch.cuda.current_stream(queries.device).cuda_stream)
    if err:
        reason = "unsupported head_dim/group/warps" if err == -1 else _SOURCE.error(queries.device, err)
        raise RuntimeError(f"CUDA score kernel launch failed: {reason} (D={d}, G={g}, warps={warps})")
    return finish_scores(ws, seq_lens, hkv, g, max_pages, summaries.page_size, combine, rank)
