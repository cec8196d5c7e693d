"""GQA combine (Eq. 5) and page selection in one CUDA launch (``select_rank.cu``).

Same contract and the same pages as the Triton kernel of :mod:`kvlocks.selection.fused` (which
dispatches here on CUDA where :func:`supports` says so): from a score pass run with ``rank=False``
it writes each head's LSE, the combined ranking and the selected pages. Its radix passes count
digits with shared-memory atomics into 256 bins (8-bit digits), where the Triton kernel's
histograms and reductions go through block-wide ``tl.histogram`` / ``tl.sum`` steps; how it works
is described at the top of ``select_rank.cu``, measurements in ``docs/benchmarks.md``.

Compiled by nvcc at first use on a GPU and cached (:mod:`kvlocks._nvcc`); where that is impossible
the Triton kernel runs. Asynchronous on the current stream, no host synchronisation: graph-capturable.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvlocks._nvcc import CudaSource

SOURCE = Path(__file__).with_name("select_rank.cu")
MAX_G = 16
MAX_FORCED = 64  # sink + recent pages
MAX_ENTRIES = 16384  # shared-memory keys per block: a chunk's pages, or a row's gathered winners
MAX_CHUNKS = 511


def _declare(lib: ctypes.CDLL) -> None:
    i32, vp = ctypes.c_int, ctypes.c_void_p
    lib.kvlocks_rank_select.argtypes = [vp] * 11 + [i32] * 16 + [vp]
    lib.kvlocks_rank_select.restype = i32


_SOURCE = CudaSource(SOURCE, "CUDA selection kernel", "the Triton selection runs", _declare)
available = _SOURCE.available
unavailable_reason = _SOURCE.unavailable_reason


def default_threads(chunk: int) -> int:
    """Threads per block: a quarter of the chunk (each thread ranks four pages per step), 128 to 512."""
    return max(128, min(512, chunk // 4))


def entries(ws: dict, k: int) -> int:
    """Shared-memory keys a block of this workspace needs: its chunk, or the row's gathered winners."""
    return max(ws["chunk"], ws["n_chunks"] * min(ws["m"], k) if ws["n_chunks"] > 1 else 0)


def supports(score_ws: dict, ws: dict, k: int, sink_pages: int, recent_pages: int) -> bool:
    """CUDA buffers, G <= 16, a chunk that is a multiple of 4, at most MAX_CHUNKS chunks per row and
    the threads of a block, sink + recent <= MAX_FORCED, the keys within MAX_ENTRIES, and the library compiled."""
    scores = score_ws["scores"]
    threads = ws.get("threads") or default_threads(ws["chunk"])
    return (scores.is_cuda and scores.shape[2] <= MAX_G and ws["chunk"] % 4 == 0
            and ws["n_chunks"] <= min(MAX_CHUNKS, threads) and sink_pages + recent_pages <= MAX_FORCED
            and entries(ws, k) <= MAX_ENTRIES and available(scores.device))


def rank_and_select_cuda(score_ws: dict, seq_lens: torch.Tensor, ws: dict, *, page_size: int, k: int, rule: int,
                         sink_pages: int, recent_pages: int, sink_start: torch.Tensor | None) -> torch.Tensor:
    """The launch behind :func:`kvlocks.selection.fused.rank_and_select` (arguments checked there)."""
    scores, stats = score_ws["scores"], score_ws["stats"]
    bsz, hkv, g, max_pages = scores.shape
    threads = int(ws.get("threads") or default_threads(ws["chunk"]))
    if threads % 32 or not 32 <= threads <= 512:
        raise ValueError(f"threads={threads}: allowed a multiple of 32 from 32 to 512")
    for name, t in (("scores", scores), ("stats", stats), ("ranking", score_ws["ranking"]), ("lse", score_ws["lse"])):
        if not t.is_contiguous():
            raise ValueError(f"score workspace {name} must be contiguous")
    dev = scores.device
    err = _SOURCE.library(dev).kvlocks_rank_select(
        scores.data_ptr(), stats.data_ptr(), seq_lens.data_ptr(), 0 if sink_start is None else sink_start.data_ptr(),
        score_ws["ranking"].data_ptr(), score_ws["lse"].data_ptr(), ws["keys"].data_ptr(), ws["idx"].data_ptr(),
        ws["count"].data_ptr(), ws["done"].data_ptr(), ws["out"].data_ptr(), bsz, hkv, g, stats.shape[-1],
        score_ws["n_chunks"], max_pages, ws["n_chunks"], ws["chunk"], ws["m"], page_size, k, sink_pages,
        recent_pages, rule, entries(ws, k), threads, torch.cuda.current_stream(dev).cuda_stream)
    if err:
        raise RuntimeError(f"CUDA selection kernel launch failed: {_SOURCE.error(dev, err)}")
    return ws["out"]
