"""GQA combine (Eq. 5) and page selection in one launch, in Triton: the decode step's path.

The unfused path runs three kernels after the score kernel: the combine pass (per-head LSE over
all pages, then the ranking), the selection's chunk pass and its merge. Each is short, so at every
context their fixed cost (launch, ramp-up, drain) weighs as much as their work. Here one kernel,
grid ``(chunks, B * Hkv)``, does all three:

1. each program reduces the score programs' per-head statistics to each head's log-sum-exp
   (:func:`kvlocks.scoring.triton.row_lse2`), turns the per-head scores of its CH pages into the
   combined ranking in registers (one pass over the G heads), stores it (for diagnostics), and
   radix-selects its chunk's winners (:func:`kvlocks.selection.triton.chunk_winners`); a program
   whose chunk lies past its row's full pages (a plan sized for longer rows) only records that it
   has none;
2. then it takes a ticket from a per-row arrival counter (``atomic_add``, acquire-release at GPU
   scope, after a CTA barrier so every thread's winners are written first); the program that
   arrives last resets the counter and runs the merge for its row
   (:func:`kvlocks.selection.triton.merge_row`; it skips the radix passes when the winners are
   no more than the pages to choose, as with a single chunk). No program waits on another, so
   the order in which programs run does not matter (the CPU interpreter runs them in turn).

Same selection as :func:`kvlocks.plan.paged_select` applied to the ranking that
:func:`kvlocks.scoring.triton.score_pages_paged` returns (up to float rounding of the ranking:
the heads are summed in a different order). Static grid, no host synchronisation: graph-capturable.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kvlocks.config import KernelOptions, default_kernel_options
from kvlocks.pdl import enabled as pdl_enabled
from kvlocks.scoring.triton_combine import _LN2, _LOG2E, RULES, ScoreWorkspace, check_rule, row_lse2, stats_block
from kvlocks.selection.triton import SelectWorkspace, check_select_args, merge_meta, merge_row, select_workspace
from kvlocks.selection.triton_radix import _forced, _orderkey, chunk_winners

SINGLE_MAX = 1536  # rows of at most this many pages are selected by one program (no merge radix)


def default_warps(chunk: int, n_chunks: int = 2) -> int:
    """Warps per program: 16 from 2048 pages per program when a row has several programs, else 8.
    On the H200 (docs/benchmarks.md; glm4-9b-1m shape, batch 1, right after the score
    kernel, so the per-head scores come from DRAM): 1M tokens (4096 pages per program) 63 us at 8
    warps, 38 at 16, 121 at 4; 256K (2048) 26 -> 21. A row's single program of 2048 (16K tokens
    plus decode room) is faster at 8 (8.14 vs 8.80 us)."""
    return 16 if chunk >= 2048 and n_chunks > 1 else 8


@triton.jit
def _fold_head(acc, mx, sc_ptr, g, offs, pmask, lse2, gi, max_pages, RULE: tl.constexpr):
    """Fold head ``g``'s scores of pages ``offs`` into the running ranking state (acc, mx)."""
    s2 = tl.load(sc_ptr + g * max_pages + offs, mask=pmask, other=-1e30) * _LOG2E
    if RULE == 2:  # sum_mass: online log2-sum-exp over the heads
        m_new = tl.maximum(mx, s2)
        acc = acc * tl.exp2(mx - m_new) + tl.exp2(s2 - m_new)
        mx = m_new
    else:
        l2 = tl.sum(tl.where(gi == g, lse2, 0.0), axis=0)  # head g's log2-sum-exp
        share = tl.where(l2 > float("-inf"), tl.exp2(s2 - tl.where(l2 > float("-inf"), l2, 0.0)), 0.0)
        if RULE == 0:
            acc += share
        else:
            acc = tl.maximum(acc, share)
    return acc, mx


@triton.jit
def _rank_chunk(sc_ptr, offs, pmask, lse2, G, max_pages, CH: tl.constexpr, GP: tl.constexpr, RULE: tl.constexpr,
                GU: tl.constexpr):
    """Combined ranking of pages ``offs`` from the per-head scores at ``sc_ptr`` (``[G, max_pages]``,
    natural log), one head at a time, the same rules as the combine kernel. The loop over the heads
    is unrolled at compile time (``GU == G``), so the G loads can be in flight at once (timed against
    a runtime loop on the H200, score + fused selection, glm4-9b-1m: 1M 131.1 vs 131.1 us, 32K 22.1
    vs 22.0)."""
    gi = tl.arange(0, GP)
    acc = tl.zeros([CH], tl.float32)
    mx = tl.full([CH], float("-inf"), tl.float32)
    for g in tl.static_range(GU):
        acc, mx = _fold_head(acc, mx, sc_ptr, g, offs, pmask, lse2, gi, max_pages, RULE)
    if RULE == 2:
        return (mx + tl.log2(acc)) * _LN2
    if RULE == 0:
        return acc / G
    return acc


@triton.jit
def _rank_select_kernel(scores_ptr, stats_ptr, n_sc, seqlen_ptr, ss_ptr, ranking_ptr, lse_ptr, ckey_ptr, cidx_ptr,
                        ccnt_ptr, done_ptr, out_ptr, Hkv, G, max_pages, n_chunks, lo_pages, hi_pages,
                        S: tl.constexpr, K: tl.constexpr,
                        SINK: tl.constexpr, RECENT: tl.constexpr, CH: tl.constexpr, M: tl.constexpr,
                        GP: tl.constexpr, RULE: tl.constexpr, BLOCK_K: tl.constexpr, TILE: tl.constexpr,
                        KP: tl.constexpr, SP: tl.constexpr, RP: tl.constexpr, CP: tl.constexpr,
                        HAS_SS: tl.constexpr, GU: tl.constexpr, REGS: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched early (kvlocks.pdl): wait for the score kernel, then let the attention launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // Hkv
    n = tl.load(seqlen_ptr + b)
    pc = n // S
    if (pc > lo_pages) & (pc <= hi_pages):  # this launch's rows (fused_workspace's short launch)
        ss = 0
        if HAS_SS:
            ss = tl.load(ss_ptr + b)
        total, s_lo, s_hi, r_lo, f = _forced(n, ss, S, SINK, RECENT)
        slot = (row * n_chunks + c).to(tl.int64)
        if (c == 0) | (c * CH < pc):
            lse2 = row_lse2(stats_ptr, row, n_sc, GP, BLOCK_K)
            if c == 0:
                g = tl.arange(0, GP)
                tl.store(lse_ptr + row * G + g, lse2 * _LN2, mask=g < G)
            offs = c * CH + tl.arange(0, CH)
            rank = _rank_chunk(scores_ptr + row.to(tl.int64) * G * max_pages, offs, offs < pc, lse2, G, max_pages,
                               CH, GP, RULE, GU)
            tl.store(ranking_ptr + row.to(tl.int64) * max_pages + offs, rank, mask=offs < pc)
            forced = ((offs >= s_lo) & (offs < s_hi)) | (offs >= r_lo)
            limit = tl.where(total > K, pc, 0)  # candidates: full pages, and only if not all pages fit
            valid = (offs < limit) & ~forced
            need = tl.minimum(K - f, tl.sum(valid.to(tl.int32), axis=0))
            chunk_winners(_orderkey(tl.where(valid, rank, 0.0)), valid, offs, need, slot, ckey_ptr, cidx_ptr,
                          ccnt_ptr, M)
        else:  # a chunk past the row's full pages (a plan sized for longer rows): no winners, no passes
            tl.store(ccnt_ptr + slot, 0)
        tl.debug_barrier()  # every thread's winners are written before the ticket is taken
        ticket = tl.atomic_add(done_ptr + row, 1, sem="acq_rel", scope="gpu")
        if ticket == n_chunks - 1:  # the last program of the row to arrive merges it
            tl.atomic_xchg(done_ptr + row, 0, sem="relaxed", scope="gpu")
            merge_row(row, n, ss, ckey_ptr, cidx_ptr, ccnt_ptr, out_ptr, n_chunks, S, K, SINK, RECENT, M, TILE,
                      KP, SP, RP, CP, REGS)


LARGE_K = 512  # from this many pages to choose, rows of >= 2 * LARGE_K_CHUNK pages use LARGE_K_CHUNK
LARGE_K_CHUNK = 8192


def default_fused_chunk(max_pages: int, k: int = 0) -> int:
    """Pages per program. One program per row up to SINGLE_MAX pages, 512 up to 5120 (80K tokens),
    2048 below 32768, then 4096. On the H200, batch 1, the selection alone after the score kernel
    (docs/benchmarks.md, us glm4-9b-1m / llama3-8b): 16K (1024 pages)
    one program 8.11 / 7.96, 512 per program 8.97 / 8.31; 32K (2048) one program 10.96 / 10.04,
    1024 10.61 / 9.79, 512 9.43 / 8.78; 64K (4096) 2048 12.63 / 11.77, 1024 11.47 / 10.27, 512
    10.31 / 10.30. From 128K, end to end (GLM-4-9B shape, against the unfused path): 2048 at 64K
    -2.7%, 128K -1.8% (1024 there +2.3/+3.2%), 256K -0.3%; 4096 at 1M -2.2/-3.4%.

    Choosing ``k >= LARGE_K`` pages (the centroid mode's re-rank candidates) from rows of at least
    two LARGE_K_CHUNK chunks: LARGE_K_CHUNK. Each chunk keeps up to k winners, so at large k more
    chunks mostly grow the merge. On the H100, k = 1010, batch 1 (us llama3-8b / glm4-9b-1m,
    docs/results/2026-12-06-h100-kernels-centroid-chunk/): 1M 8192 a chunk 47.7 / 47.2 against
    63.4 / 60.3 at 4096 (2048: 108.3 / 97.7, 16384: 54.8 / 60.7); 128K, where 8192 is one chunk,
    2048 stays best (19.8 / 20.9; 8192: 22.1 / 26.3)."""
    if k >= LARGE_K and max_pages >= 2 * LARGE_K_CHUNK:
        return LARGE_K_CHUNK
    if max_pages <= SINGLE_MAX:
        return max(16, triton.next_power_of_2(max_pages))
    if max_pages <= 5120:
        return 512
    return 2048 if max_pages < 32768 else 4096


def fused_workspace(batch: int, num_kv_heads: int, max_pages: int, k: int, device,
                    chunk: int | None = None, short_pages: int = 0) -> SelectWorkspace:
    """Buffers for :func:`rank_and_select` (a :func:`select_workspace` with the fused chunk size).

    ``short_pages`` > 0: rows of at most that many full pages get a launch of their own, sized as a
    plan for rows that long would be (:func:`default_fused_chunk` of ``short_pages``), and the
    launch sized by ``max_pages`` takes the longer rows. A plan as wide as a long-context engine's
    block table otherwise gives a short row one program of 2,048 or 4,096 pages where a narrow plan
    spreads it over several (docs/results/2026-12-07-h200-plan-width-probe/). Only where the two
    launches would differ (``short_pages < max_pages`` and a smaller chunk for the short rows)."""
    if short_pages < 0:
        raise ValueError(f"short_pages={short_pages}: must be >= 0 (0: one launch for every row)")
    ws = select_workspace(batch, num_kv_heads, max_pages, k, device,
                          chunk=default_fused_chunk(max_pages, k) if chunk is None else chunk)
    if 0 < short_pages < max_pages and default_fused_chunk(short_pages, k) < ws.chunk:
        short = select_workspace(batch, num_kv_heads, short_pages, k, device,
                                 chunk=default_fused_chunk(short_pages, k))
        ws = dataclasses.replace(ws, short=dataclasses.replace(short, out=ws.out), short_pages=short_pages)
    return ws


def rank_and_select(score_ws: ScoreWorkspace, seq_lens: torch.Tensor, *, page_size: int, k: int,
                    combine: str = "mean_share", sink_pages: int = 1, recent_pages: int = 1,
                    sink_start: torch.Tensor | None = None, workspace: SelectWorkspace | None = None,
                    options: KernelOptions | None = None) -> torch.Tensor:
    """Pages to attend per (sequence, KV head), from a score pass run with ``rank=False``.

    Parameters
    ----------
    score_ws : the score workspace (:func:`kvlocks.scoring.triton.score_workspace`) after
        ``score_pages_paged(..., rank=False)``: its ``scores`` and ``stats`` are read, its ``lse``
        and ``ranking`` written (as the combine pass would)
    seq_lens : int32 ``[B]``; sink_start : int32 ``[B]`` or None
    k, sink_pages, recent_pages, combine : as :func:`kvlocks.plan.paged_select` and Eq. 5's rule
    workspace : from :func:`fused_workspace` (allocated here when omitted)
    options : KernelOptions (None: the defaults); ``pdl`` is read

    Returns
    -------
    int32 ``[B, Hkv, k]`` ascending logical page ids, -1 padded (the workspace's buffer).
    """
    check_select_args(k, sink_pages, recent_pages)
    check_rule(combine)
    scores = score_ws.scores
    bsz, hkv, g, max_pages = scores.shape
    if seq_lens.shape != (bsz,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{bsz}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    ws = workspace or fused_workspace(bsz, hkv, max_pages, k, scores.device)
    if ws.out.shape != (bsz, hkv, k):
        raise ValueError(f"workspace is for output {tuple(ws.out.shape)}, not {(bsz, hkv, k)}")
    ss = sink_start if sink_start is not None else seq_lens
    pdl = pdl_enabled(scores.device, (options or default_kernel_options()).pdl)
    every = 2**31 - 1
    launches = ((ws.short, -1, ws.short_pages), (ws, ws.short_pages, every)) if ws.short else ((ws, -1, every),)
    for w, lo, hi in launches:  # each launch selects the rows with lo < full pages <= hi
        _rank_select_kernel[(w.n_chunks, bsz * hkv)](
            scores, score_ws.stats, score_ws.n_chunks, seq_lens, ss, score_ws.ranking, score_ws.lse,
            w.keys, w.idx, w.count, w.done, ws.out, hkv, g, max_pages, w.n_chunks, lo, hi,
            S=page_size, K=k, SINK=sink_pages, RECENT=recent_pages, CH=w.chunk, GP=score_ws.stats.shape[-1],
            RULE=RULES[combine], BLOCK_K=stats_block(score_ws), HAS_SS=sink_start is not None, GU=g,
            **merge_meta(w, k, sink_pages, recent_pages), num_warps=default_warps(w.chunk, w.n_chunks), PDL=pdl,
            **({"launch_pdl": True} if pdl else {}),
        )
    return ws.out
