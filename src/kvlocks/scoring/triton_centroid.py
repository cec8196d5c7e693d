"""Centroid page scores on the paged layout (``LocksConfig.rerank_scores = "centroid"``): a Triton kernel.

A full page p of S tokens scores ``log S + scale * q.mu_p`` per query head, ``mu_p`` its LOCKS
summary's int8 centroid times the float16 scale: Eq. 4 at rank 0
(:func:`kvlocks.scoring.reference.score_pages_from_centroids`). The kernel reads ``D + 2`` bytes
per (page, KV head) of the summary's 818 (D 128, rank 8) and writes what every score kernel writes
(:class:`kvlocks.scoring.triton_combine.ScoreWorkspace`: per-head scores and the per-program
log-sum-exp statistics), so :func:`kvlocks.selection.fused.rank_and_select` picks the
``rerank * (k - sink - recent)`` candidates with the forced pages and
:func:`kvlocks.selection.triton_rerank.rerank_pages` ranks them by their exact masses from their
keys (the other pages keep their centroid estimates in each head's normaliser):
:class:`kvlocks.plan.DecodePlan` runs that step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvlocks.cache.layout import SummaryStore, dot_dtype
from kvlocks.scoring.triton_combine import (
    LOG2E, ScoreWorkspace, finish_scores, launch_sizes, row_chunk, store_and_fold,
)

BLOCK = 64  # pages per step of a score program


@triton.jit
def _centroid_score_kernel(q_ptr, stride_qb, stride_qh, cen_ptr, censcale_ptr, bt_ptr, stride_bt, seqlen_ptr,
                           scores_ptr, stats_ptr, Hkv, G, max_pages, n_chunks, pages_per_prog, qk_scale, log2_s,
                           GQ: tl.constexpr, D: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr,
                           DOT_DT: tl.constexpr, PREC: tl.constexpr):
    pid_c = tl.program_id(0)
    row = tl.program_id(1)  # b * Hkv + h
    b = row // Hkv
    h = row % Hkv
    pc = tl.load(seqlen_ptr + b) // S
    g = tl.arange(0, GQ)
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + (h * G + g)[None, :] * stride_qh + dd[:, None], mask=(g < G)[None, :],
                other=0.0).to(DOT_DT)  # [D, GQ]
    pb = tl.arange(0, BLOCK)
    m_run = tl.full([GQ], float("-inf"), tl.float32)
    l_run = tl.zeros([GQ], tl.float32)
    start, end = row_chunk(pc, pid_c, n_chunks, pages_per_prog, BLOCK)
    btr = bt_ptr + b.to(tl.int64) * stride_bt
    for p0 in range(start, end, BLOCK):
        p = p0 + pb
        pmask = p < end
        ph = tl.load(btr + p, mask=pmask, other=0).to(tl.int64) * Hkv + h  # (page, head) record [BLOCK]
        cen = tl.load(cen_ptr + ph[:, None] * D + dd[None, :], mask=pmask[:, None], other=0)  # int8 [BLOCK, D]
        qmu = tl.dot(cen.to(tl.float32).to(DOT_DT), q, input_precision=PREC)  # [BLOCK, GQ]; int8 exact in bf16
        cs = tl.load(censcale_ptr + ph, mask=pmask, other=0.0).to(tl.float32)
        lse2 = qmu * (cs * qk_scale)[:, None] + log2_s  # log2 units
        m_run, l_run = store_and_fold(lse2, p, pmask, g, row, G, max_pages, scores_ptr, m_run, l_run)
    st = stats_ptr + ((row * n_chunks + pid_c) * 2) * GQ + g
    tl.store(st, m_run)
    tl.store(st + GQ, l_run)


def centroid_workspace(batch: int, num_kv_heads: int, group: int, max_pages: int, device,
                       split_batch: int | None = None) -> ScoreWorkspace:
    """The score workspace sized for this kernel's programs (for ``split_batch`` rows, default
    ``batch``: :func:`kvlocks.scoring.triton.score_workspace`)."""
    device = torch.device(device)
    return ScoreWorkspace.allocate(batch, num_kv_heads, group, max_pages, device,
                                   launch_sizes(max_pages, (split_batch or batch) * num_kv_heads, device, BLOCK))


def score_pages_centroid(queries: torch.Tensor, summaries: SummaryStore, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, *, scale: float | None = None, combine: str = "mean_share",
                         workspace: ScoreWorkspace | None = None, rank: bool = True):
    """Centroid page scores with the contract of :func:`kvlocks.scoring.triton.score_pages_paged`:
    queries ``[B, Hq, D]`` -> (scores float32 ``[B, Hkv, G, W]``, lse ``[B, Hkv, G]``, ranking
    ``[B, Hkv, W]``); lse and ranking None with ``rank=False`` (the fused selection makes them)."""
    bsz, hq, d = queries.shape
    hkv, s = summaries.num_kv_heads, summaries.page_size
    if hq % hkv or d != summaries.head_dim or d & (d - 1) or d < 16:
        raise ValueError(f"queries {tuple(queries.shape)} do not fit summaries of {hkv} KV heads, head_dim "
                         f"{summaries.head_dim} (a power of two >= 16)")
    if summaries.centroid.dtype != torch.int8:
        raise ValueError(f"centroids must be int8 (coef_bits 8), got {summaries.centroid.dtype}")
    if queries.stride(-1) != 1:
        raise ValueError("queries need a contiguous last dim")
    g, max_pages = hq // hkv, block_table.shape[1]
    ws = workspace or centroid_workspace(bsz, hkv, g, max_pages, queries.device)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    half = queries.dtype != torch.float32
    _centroid_score_kernel[(ws.n_chunks, bsz * hkv)](
        queries, queries.stride(0), queries.stride(1), summaries.centroid, summaries.centroid_scale, block_table,
        block_table.stride(0), seq_lens, ws.scores, ws.stats, hkv, g, max_pages, ws.n_chunks, ws.ppp,
        scale * LOG2E, math.log2(s), GQ=triton.next_power_of_2(g), D=d, S=s, BLOCK=BLOCK,
        DOT_DT=dot_dtype(queries.dtype),
        PREC="tf32" if half else "ieee", num_warps=4)
    return finish_scores(ws, seq_lens, hkv, g, max_pages, s, combine, rank)
