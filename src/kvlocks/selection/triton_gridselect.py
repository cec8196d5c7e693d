"""Combine + selection of many pages (the re-rank's candidates) as a grid-wide radix select.

:func:`kvlocks.selection.fused.rank_and_select` radix-selects each chunk's top k and lets the
last program of a row merge every chunk's winners alone. For k in the hundreds or thousands
(``LocksConfig.rerank_scores = "centroid"`` picks 8·(k − 2) candidates) that merge is one
program per row over ``chunks × k`` keys, and the step's longest launch. Here every program of a
row takes part in every digit instead:

1. ``_rank_kernel``: each program ranks its chunk of pages from the per-head scores (the combine
   of :mod:`kvlocks.selection.fused`), stores each page's order key (0 for a page that cannot be
   chosen: forced, partial, past the row) and adds the histogram of the keys' top 11 bits to the
   row's histogram; the last program of the row to arrive picks the digit that holds the
   ``need``-th largest key.
2. ``_digit_kernel`` twice (the next 11 bits, then the last 10), over the keys that match the
   digits fixed so far, the same way; a row whose threshold digit holds no more keys than are
   left to choose returns at once.
3. ``_count_kernel``: each program counts its keys above the threshold and equal to it.
4. ``_place_kernel``: from the counts of the chunks before it, each program writes its chosen
   pages and the forced pages of its range to their slots in ascending page order (ties to the
   lower page, as the reference).

Same output contract and pages as :func:`~kvlocks.selection.fused.rank_and_select` (ascending
page ids, -1 padded); five short launches, none serial over a row. Static grids, no host
synchronisation: graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvlocks.config import KernelOptions, default_kernel_options
from kvlocks.pdl import enabled as pdl_enabled
from kvlocks.scoring.triton_combine import _LN2, RULES, ScoreWorkspace, check_rule, row_lse2, stats_block
from kvlocks.selection.fused import _rank_chunk
from kvlocks.selection.triton import check_select_args
from kvlocks.selection.triton_radix import _below, _forced, _orderkey

NB = 2048  # bins of a digit's histogram (11 bits; the last digit uses 10)
_NB = tl.constexpr(NB)
META = 8  # per row: prefix, kmask, remaining, keys matching the prefix, need, all-pages flag, spare
DEFAULT_CHUNK = 2048


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    if PDL:  # launched early (kvlocks.pdl): wait for the launch before, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _arrive(done_ptr, row, n_chunks):
    """True in the last program of ``row`` to arrive (which also resets the row's counter)."""
    tl.debug_barrier()  # every thread's stores and atomics are issued before the ticket is taken
    ticket = tl.atomic_add(done_ptr + row, 1, sem="acq_rel", scope="gpu")
    last = ticket == n_chunks - 1
    if last:
        tl.atomic_xchg(done_ptr + row, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _add_hist(hist_ptr, row, key, match, shift: tl.constexpr, dmask: tl.constexpr):
    d = ((key >> shift) & dmask).to(tl.int32)
    h = tl.histogram(d, _NB, mask=match)
    b = tl.arange(0, _NB)
    tl.atomic_add(hist_ptr + row * _NB + b, h, mask=h > 0, sem="relaxed", scope="gpu")


@triton.jit
def _decide(hist_ptr, meta_ptr, row, shift: tl.constexpr, dmask: tl.constexpr, prefix, kmask, remaining):
    """The last program of a row: the digit at ``shift`` holding the ``remaining``-th largest of the
    keys that match ``prefix`` (their histogram), written to the row's meta; the histogram zeroed."""
    b = tl.arange(0, _NB)
    h = tl.load(hist_ptr + row * _NB + b, cache_modifier=".cg")
    tl.store(hist_ptr + row * _NB + b, tl.zeros([_NB], tl.int32))
    ge = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys with digit >= b
    dstar = tl.max(tl.where(ge >= remaining, b, -1), axis=0)
    above = tl.sum(tl.where(b > dstar, h, 0), axis=0)
    n_in = tl.sum(tl.where(b == dstar, h, 0), axis=0)
    m = meta_ptr + row * 8
    tl.store(m, (prefix | (dstar.to(tl.uint32) << shift)).to(tl.int32, bitcast=True))
    tl.store(m + 1, (kmask | (tl.full([], dmask, tl.uint32) << shift)).to(tl.int32, bitcast=True))
    tl.store(m + 2, remaining - above)
    tl.store(m + 3, n_in)


@triton.jit
def _rank_kernel(scores_ptr, stats_ptr, n_sc, seqlen_ptr, ss_ptr, ranking_ptr, lse_ptr, keys_ptr, hist_ptr,
                 meta_ptr, done_ptr, Hkv, G, max_pages, n_chunks, S: tl.constexpr, K: tl.constexpr,
                 SINK: tl.constexpr, RECENT: tl.constexpr, CH: tl.constexpr, GP: tl.constexpr, RULE: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_SS: tl.constexpr, GU: tl.constexpr, PDL: tl.constexpr):
    _pdl_start(PDL)
    c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // Hkv
    n = tl.load(seqlen_ptr + b)
    ss = 0
    if HAS_SS:
        ss = tl.load(ss_ptr + b)
    total, s_lo, s_hi, r_lo, f = _forced(n, ss, S, SINK, RECENT)
    pc = n // S
    offs = c * CH + tl.arange(0, CH)
    key = tl.zeros([CH], tl.uint32)
    valid = offs < 0
    if (c == 0) | (c * CH < pc):
        lse2 = row_lse2(stats_ptr, row, n_sc, GP, BLOCK_K)
        if c == 0:
            g = tl.arange(0, GP)
            tl.store(lse_ptr + row * G + g, lse2 * _LN2, mask=g < G)
        rank = _rank_chunk(scores_ptr + row.to(tl.int64) * G * max_pages, offs, offs < pc, lse2, G, max_pages, CH,
                           GP, RULE, GU)
        tl.store(ranking_ptr + row.to(tl.int64) * max_pages + offs, rank, mask=offs < pc)
        forced = ((offs >= s_lo) & (offs < s_hi)) | (offs >= r_lo)
        valid = (offs < tl.where(total > K, pc, 0)) & ~forced  # candidates: only if not all pages fit
        key = tl.where(valid, _orderkey(rank), 0)
        _add_hist(hist_ptr, row, key, valid, 21, 0x7FF)
    tl.store(keys_ptr + row.to(tl.int64) * n_chunks * CH + offs, key.to(tl.int32, bitcast=True))
    if _arrive(done_ptr, row, n_chunks):
        n_valid = tl.sum(tl.load(hist_ptr + row * _NB + tl.arange(0, _NB), cache_modifier=".cg"), axis=0)
        need = tl.minimum(K - f, n_valid)
        tl.store(meta_ptr + row * 8 + 4, need)
        tl.store(meta_ptr + row * 8 + 5, (total <= K).to(tl.int32))
        _decide(hist_ptr, meta_ptr, row, 21, 0x7FF, tl.full([], 0, tl.uint32), tl.full([], 0, tl.uint32),
                tl.maximum(need, 1))
        if need == 0:  # nothing to choose: no key can match
            tl.store(meta_ptr + row * 8 + 2, 0)
            tl.store(meta_ptr + row * 8 + 3, 0)


@triton.jit
def _load_meta(meta_ptr, row):
    m = meta_ptr + row * 8
    prefix = tl.load(m, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    kmask = tl.load(m + 1, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    return prefix, kmask, tl.load(m + 2, cache_modifier=".cg"), tl.load(m + 3, cache_modifier=".cg")


@triton.jit
def _chunk_keys(keys_ptr, row, c, n_chunks, CH: tl.constexpr):
    offs = c * CH + tl.arange(0, CH)
    key = tl.load(keys_ptr + row.to(tl.int64) * n_chunks * CH + offs, cache_modifier=".cg").to(tl.uint32,
                                                                                                bitcast=True)
    return offs, key, key != 0


@triton.jit
def _digit_kernel(keys_ptr, hist_ptr, meta_ptr, done_ptr, n_chunks, SHIFT: tl.constexpr, DMASK: tl.constexpr,
                  CH: tl.constexpr, PDL: tl.constexpr):
    _pdl_start(PDL)
    c = tl.program_id(0)
    row = tl.program_id(1)
    prefix, kmask, remaining, n_in = _load_meta(meta_ptr, row)
    if n_in > remaining:  # the threshold digit holds more keys than are left to choose
        _, key, valid = _chunk_keys(keys_ptr, row, c, n_chunks, CH)
        _add_hist(hist_ptr, row, key, valid & ((key & kmask) == prefix), SHIFT, DMASK)
        if _arrive(done_ptr, row, n_chunks):
            _decide(hist_ptr, meta_ptr, row, SHIFT, DMASK, prefix, kmask, remaining)


@triton.jit
def _count_kernel(keys_ptr, meta_ptr, counts_ptr, n_chunks, CH: tl.constexpr, PDL: tl.constexpr):
    _pdl_start(PDL)
    c = tl.program_id(0)
    row = tl.program_id(1)
    prefix, kmask, remaining, n_in = _load_meta(meta_ptr, row)
    _, key, valid = _chunk_keys(keys_ptr, row, c, n_chunks, CH)
    km = key & kmask
    slot = counts_ptr + (row * n_chunks + c) * 2
    tl.store(slot, tl.sum((valid & (km > prefix)).to(tl.int32), axis=0))
    tl.store(slot + 1, tl.sum((valid & (km == prefix)).to(tl.int32), axis=0))


@triton.jit
def _place_kernel(keys_ptr, meta_ptr, counts_ptr, seqlen_ptr, ss_ptr, out_ptr, Hkv, n_chunks, S: tl.constexpr,
                  K: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, CH: tl.constexpr, KP: tl.constexpr,
                  SP: tl.constexpr, RP: tl.constexpr, CP: tl.constexpr, HAS_SS: tl.constexpr, PDL: tl.constexpr):
    _pdl_start(PDL)
    c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // Hkv
    n = tl.load(seqlen_ptr + b)
    ss = 0
    if HAS_SS:
        ss = tl.load(ss_ptr + b)
    total, s_lo, s_hi, r_lo, f = _forced(n, ss, S, SINK, RECENT)
    out = out_ptr + row.to(tl.int64) * K
    kk = tl.arange(0, KP)
    if tl.load(meta_ptr + row * 8 + 5, cache_modifier=".cg") != 0:  # every page is attended
        if c == 0:
            tl.store(out + kk, tl.where(kk < total, kk, -1), mask=kk < K)
    else:
        prefix, kmask, remaining, n_in = _load_meta(meta_ptr, row)
        need = tl.load(meta_ptr + row * 8 + 4, cache_modifier=".cg")
        cp = tl.arange(0, CP)
        before = (cp < c) & (cp < n_chunks)
        strict_before = tl.sum(tl.load(counts_ptr + (row * n_chunks + cp) * 2, mask=before, other=0), axis=0)
        ties_before = tl.sum(tl.load(counts_ptr + (row * n_chunks + cp) * 2 + 1, mask=before, other=0), axis=0)
        n_before = strict_before + tl.minimum(ties_before, tl.maximum(remaining, 0))
        offs, key, valid = _chunk_keys(keys_ptr, row, c, n_chunks, CH)
        km = key & kmask
        is_t = valid & (km == prefix)
        tie_rank = ties_before + tl.cumsum(is_t.to(tl.int32), axis=0) - 1
        sel = valid & ((km > prefix) | (is_t & (tie_rank < remaining)))
        pos = n_before + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(out + pos + _below(offs, s_lo, s_hi, r_lo, total), offs, mask=sel)
        # the forced pages of this program's range: their slot counts the chosen pages below them
        sp = s_lo + tl.arange(0, SP)
        sp_ok = (sp < s_hi) & (sp >= c * CH) & (sp < (c + 1) * CH)
        rp = r_lo + tl.arange(0, RP)
        rp_ok = (rp < total) & ~((rp >= s_lo) & (rp < s_hi)) & (rp >= c * CH) & (rp < (c + 1) * CH)
        below_s = n_before + tl.sum((sel[None, :] & (offs[None, :] < sp[:, None])).to(tl.int32), axis=1)
        below_r = n_before + tl.sum((sel[None, :] & (offs[None, :] < rp[:, None])).to(tl.int32), axis=1)
        tl.store(out + below_s + _below(sp, s_lo, s_hi, r_lo, total), sp, mask=sp_ok)
        tl.store(out + below_r + _below(rp, s_lo, s_hi, r_lo, total), rp, mask=rp_ok)
        if c == 0:
            tl.store(out + kk, tl.full([KP], -1, tl.int32), mask=(kk >= need + f) & (kk < K))


@dataclass
class GridSelectWorkspace:
    """Buffers of :func:`grid_rank_and_select` for one launch shape (:func:`grid_select_workspace`).

    chunk : pages per program; n_chunks : programs per row (``chunk * n_chunks >= max_pages``);
    keys : int32 ``[B * Hkv, n_chunks * chunk]`` (uint32 order keys, 0 = not a candidate);
    hist : int32 ``[B * Hkv, NB]`` (zero between launches); meta : int32 ``[B * Hkv, 8]``;
    counts : int32 ``[B * Hkv, n_chunks, 2]``; done : int32 ``[B * Hkv]`` arrival counters (zero
    between launches); out : int32 ``[B, Hkv, k]``
    """

    chunk: int
    n_chunks: int
    keys: torch.Tensor
    hist: torch.Tensor
    meta: torch.Tensor
    counts: torch.Tensor
    done: torch.Tensor
    out: torch.Tensor


def grid_select_workspace(batch: int, num_kv_heads: int, max_pages: int, k: int, device,
                          chunk: int = DEFAULT_CHUNK) -> GridSelectWorkspace:
    """Buffers for :func:`grid_rank_and_select` (``chunk``: pages per program, a power of two)."""
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk}: need a power of two >= 16")
    chunk = min(chunk, max(16, triton.next_power_of_2(max_pages)))
    n_chunks = max(1, -(-max_pages // chunk))
    rows = batch * num_kv_heads
    i32 = dict(dtype=torch.int32, device=device)
    return GridSelectWorkspace(chunk=chunk, n_chunks=n_chunks, keys=torch.zeros(rows, n_chunks * chunk, **i32),
                               hist=torch.zeros(rows, NB, **i32), meta=torch.zeros(rows, META, **i32),
                               counts=torch.zeros(rows, n_chunks, 2, **i32), done=torch.zeros(rows, **i32),
                               out=torch.empty(batch, num_kv_heads, k, **i32))


def grid_rank_and_select(score_ws: ScoreWorkspace, seq_lens: torch.Tensor, *, page_size: int, k: int,
                         combine: str = "mean_share", sink_pages: int = 1, recent_pages: int = 1,
                         sink_start: torch.Tensor | None = None, workspace: GridSelectWorkspace | None = None,
                         options: KernelOptions | None = None) -> torch.Tensor:
    """:func:`kvlocks.selection.fused.rank_and_select` (same arguments, outputs and side effects on
    ``score_ws``) by the grid-wide radix select; ``workspace`` from :func:`grid_select_workspace`."""
    check_select_args(k, sink_pages, recent_pages)
    check_rule(combine)
    scores = score_ws.scores
    bsz, hkv, g, max_pages = scores.shape
    if seq_lens.shape != (bsz,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{bsz}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    ws = workspace or grid_select_workspace(bsz, hkv, max_pages, k, scores.device)
    if ws.out.shape != (bsz, hkv, k) or ws.n_chunks * ws.chunk < max_pages:
        raise ValueError(f"workspace is for output {tuple(ws.out.shape)} and {ws.n_chunks * ws.chunk} pages, not "
                         f"{(bsz, hkv, k)} and {max_pages}")
    ss = sink_start if sink_start is not None else seq_lens
    pdl = pdl_enabled(scores.device, (options or default_kernel_options()).pdl)
    grid = (ws.n_chunks, bsz * hkv)
    launch = dict(num_warps=8, PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    common = dict(S=page_size, K=k, SINK=sink_pages, RECENT=recent_pages, CH=ws.chunk, HAS_SS=sink_start is not None)
    _rank_kernel[grid](scores, score_ws.stats, score_ws.n_chunks, seq_lens, ss, score_ws.ranking, score_ws.lse,
                       ws.keys, ws.hist, ws.meta, ws.done, hkv, g, max_pages, ws.n_chunks,
                       GP=score_ws.stats.shape[-1], RULE=RULES[combine], BLOCK_K=stats_block(score_ws), GU=g,
                       **common, **launch)
    for shift, dmask in ((10, 0x7FF), (0, 0x3FF)):
        _digit_kernel[grid](ws.keys, ws.hist, ws.meta, ws.done, ws.n_chunks, SHIFT=shift, DMASK=dmask, CH=ws.chunk,
                            **launch)
    _count_kernel[grid](ws.keys, ws.meta, ws.counts, ws.n_chunks, CH=ws.chunk, **launch)
    _place_kernel[grid](ws.keys, ws.meta, ws.counts, seq_lens, ss, ws.out, hkv, ws.n_chunks,
                        KP=triton.next_power_of_2(k), SP=triton.next_power_of_2(max(sink_pages, 1)),
                        RP=triton.next_power_of_2(recent_pages), CP=triton.next_power_of_2(ws.n_chunks), **common,
                        **launch)
    return ws.out
