"""``locks_centroid`` on the paged layout: a Triton score kernel over the summaries' centroids, then
the product's fused selection of the candidates and its exact re-rank (the GPU path of
:mod:`.locks_centroid`).

A full page p of S tokens scores ``log S + scale * q.mu_p`` per query head, ``mu_p`` its LOCKS
summary's int8 centroid times the float16 scale: Eq. 4 at rank 0. The kernel reads ``D + 2`` bytes
per (page, KV head) of the summary's 818 (D 128, rank 8) and writes what every score kernel writes
(:class:`kvlocks.scoring.triton_combine.ScoreWorkspace`: per-head scores and the per-program
log-sum-exp statistics), so :func:`kvlocks.selection.fused.rank_and_select` picks the
``rerank * (k - sink - recent)`` candidates with the forced pages, and
:func:`kvlocks.selection.triton_rerank.rerank_pages` ranks the candidates by their exact masses
from their keys (the other pages keep their centroid estimates in each head's normaliser).

:class:`CentroidRerankPlan` runs the whole step (score, select, re-rank, attend) on fixed buffers,
as :class:`kvlocks.plan.DecodePlan` runs flat LOCKS; the kernel bench times it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from kvlocks.cache.layout import SummaryStore, dot_dtype
from kvlocks.config import LocksConfig
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


def centroid_workspace(batch: int, num_kv_heads: int, group: int, max_pages: int, device) -> ScoreWorkspace:
    """The score workspace sized for this kernel's programs."""
    device = torch.device(device)
    return ScoreWorkspace.allocate(batch, num_kv_heads, group, max_pages, device,
                                   launch_sizes(max_pages, batch * num_kv_heads, device, BLOCK))


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


def centroid_reference(queries: torch.Tensor, summaries: SummaryStore, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Float64 reference of the kernel's scores: ``[B, Hkv, G, W]``, -inf past each row's full pages."""
    bsz, hq, d = queries.shape
    hkv, s = summaries.num_kv_heads, summaries.page_size
    g, w = hq // hkv, block_table.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.full((bsz, hkv, g, w), float("-inf"), dtype=torch.float64)
    for b in range(bsz):
        pc = int(seq_lens[b]) // s
        ids = block_table[b, :pc].long().cpu()
        mu = summaries.centroid.cpu()[ids].double() * summaries.centroid_scale.cpu()[ids].double()[..., None]
        q = queries[b].cpu().double().view(hkv, g, d)
        out[b, :, :, :pc] = math.log(s) + scale * torch.einsum("hgd,phd->hgp", q, mu)
    return out


class CentroidRerankPlan:
    """One decode step of ``locks_centroid`` on the Triton kernels, buffers allocated once:
    centroid scores, the fused selection of ``config.rerank_candidates`` candidates plus the sink and
    recent pages (the selector's defaults where the configuration leaves ``rerank`` or
    ``rerank_min`` 0), their exact re-rank, sparse attention."""

    def __init__(self, *, batch, num_kv_heads, group, head_dim, max_pages, config: LocksConfig, dtype, device):
        from kvlocks.attention.triton import attention_workspace
        from kvlocks.selection.fused import fused_workspace
        from kvlocks.selection.triton_rerank import rerank_workspace

        from kvlocks_lab.selectors.locks_centroid import LocksCentroidSelector

        config = dataclasses.replace(config, **{f: v for f, v in LocksCentroidSelector.config_defaults.items()
                                                if not getattr(config, f)})
        self.config, self.scale, self.k = config, 1.0 / math.sqrt(head_dim), config.pages_per_step
        self.k_cand = min(max_pages, config.rerank_candidates(max_pages) + config.sink_pages + config.recent_pages)
        self.score_ws = centroid_workspace(batch, num_kv_heads, group, max_pages, device)
        self.select_ws = fused_workspace(batch, num_kv_heads, max_pages, self.k_cand, device)
        self.rerank_ws = rerank_workspace(batch, num_kv_heads, group, self.k_cand, self.k, device)
        self.attend_ws = attention_workspace(batch, num_kv_heads * group, head_dim, self.k, batch * num_kv_heads,
                                             dtype, device)
        self.pages = None

    def select(self, queries, k_cache, summaries, block_table, seq_lens):
        """int32 ``[B, Hkv, k]`` ascending page ids, -1 padded."""
        from kvlocks.selection.fused import rank_and_select
        from kvlocks.selection.triton_rerank import rerank_pages

        c = self.config
        score_pages_centroid(queries, summaries, block_table, seq_lens, scale=self.scale, combine=c.combine,
                             workspace=self.score_ws, rank=False)
        cand = rank_and_select(self.score_ws, seq_lens, page_size=c.page_size, k=self.k_cand, combine=c.combine,
                               sink_pages=c.sink_pages, recent_pages=c.recent_pages, workspace=self.select_ws)
        return rerank_pages(queries, k_cache, block_table, seq_lens, self.score_ws.scores, self.score_ws.lse, cand,
                            c, scale=self.scale, workspace=self.rerank_ws)

    def run(self, queries, k_cache, v_cache, summaries, block_table, seq_lens):
        """queries ``[B, Hq, D]`` -> (out ``[B, Hq, D]``, lse ``[B, Hq]``); also sets ``self.pages``."""
        from kvlocks.attention.triton import paged_decode

        self.pages = self.select(queries, k_cache, summaries, block_table, seq_lens)
        return paged_decode(queries, k_cache, v_cache, block_table, seq_lens, self.pages, scale=self.scale,
                            workspace=self.attend_ws)
