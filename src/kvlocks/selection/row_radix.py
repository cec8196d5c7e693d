"""GQA combine (Eq. 5) and page selection for long rows by a row-wide radix histogram, in Triton.

The fused kernel (:mod:`kvlocks.selection.fused`) selects each chunk's top ``k - forced`` pages and
merges the chunks' winners in the row's last program. At 1M tokens (65,536 pages per row, chunks of
4,096) a chunk keeps up to half of its pages, so one program per row radix-selects over ~32K
winners, tile by tile from L2: most of the selection's time. Here the row's programs share a
histogram instead, and no program does more than its chunk's pages plus the threshold digit's
keys. Three launches, grid ``(chunks, B * Hkv)`` each, no host synchronisation (graph-capturable):

1. ``_rank_hist_kernel``: the ranking of the chunk's pages (as the fused kernel: per-head LSE from
   the score programs' statistics, then Eq. 5), stored; the top HIST_BITS bits of each candidate's
   order key (:func:`kvlocks.selection.triton._orderkey`) counted into the row's histogram
   (``atomic_add``). The row's last program to arrive (a ticket, as in the fused kernel) finds the
   threshold bin ``t`` (the bin holding the ``need``-th largest key), leaves ``need`` minus the
   keys above it, and clears the histogram for the next step.
2. ``_refine_kernel``: each program counts its keys above bin ``t`` and appends its keys in bin
   ``t`` to the row's candidate list (position from an ``atomic_add``; order does not matter). The
   row's last program radix-selects the candidates (:func:`kvlocks.selection.triton.radix_threshold`,
   on one register tile over rebased keys, or tile by tile from L2 when more than TILE keys share
   bin ``t``), then turns the per-chunk counts into each chunk's output offset and its share of the
   threshold ties (ties go to the lower page: to the lower chunks first, then in page order).
3. ``_emit_kernel``: each program writes its chosen pages, and the forced (sink, recent) pages in its
   range, straight to their ascending positions in the output.

Same pages as :func:`kvlocks.selection.fused.rank_and_select` (the same ranking, ties to the lower
page index). Output: int32 ``[B, Hkv, k]`` ascending logical page ids, -1 padded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlocks.scoring.triton import _LN2, RULES, _check_rule, row_lse2, stats_block
from kvlocks.selection.fused import UNROLL_HEADS, _rank_chunk
from kvlocks.selection.triton import (
    EARLY_EXIT, REBASE_KEYS, _advance, _below, _digit, _digit_hist, _forced, _more_passes, _orderkey,
    _rebase_params, _rebased, check_select_args, digit_bits, radix_threshold,
)

HIST_BITS = 12  # the row histogram's bins: the order key's top 12 bits (sign, exponent, 3 mantissa bits)
TILE = 4096  # candidates per register tile in the refine step
INFO = 8  # int32 fields per row: t, rem, lo, shift, prefix, kmask, remaining


@triton.jit
def _row_state(seqlen_ptr, ss_ptr, row, Hkv, S: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
               HAS_SS: tl.constexpr):
    """(n, total, s_lo, s_hi, r_lo, forced count) of row ``row``'s sequence."""
    b = row // Hkv
    n = tl.load(seqlen_ptr + b)
    ss = 0
    if HAS_SS:
        ss = tl.load(ss_ptr + b)
    total, s_lo, s_hi, r_lo, f = _forced(n, ss, S, SINK, RECENT)
    return n, total, s_lo, s_hi, r_lo, f


@triton.jit
def _candidates(offs, n, total, s_lo, s_hi, r_lo, S: tl.constexpr, K: tl.constexpr):
    """Pages of ``offs`` that compete for the top-(k - forced): full, not forced, and only if not
    every page fits the budget."""
    forced = ((offs >= s_lo) & (offs < s_hi)) | (offs >= r_lo)
    limit = tl.where(total > K, n // S, 0)
    return (offs < limit) & ~forced


@triton.jit
def _chunk_keys(ranking_row, offs, valid, HB: tl.constexpr):
    """Order keys of the chunk's stored ranking and their histogram bins (the top HB bits)."""
    x = tl.load(ranking_row + offs, mask=valid, other=0.0)
    key = _orderkey(tl.where(valid, x, 0.0))
    return key, (key >> (32 - HB)).to(tl.int32)


@triton.jit
def _rank_hist_kernel(scores_ptr, stats_ptr, n_sc, seqlen_ptr, ss_ptr, ranking_ptr, lse_ptr, hist_ptr, done_ptr,
                      info_ptr, Hkv, G, max_pages, n_chunks, S: tl.constexpr, K: tl.constexpr, SINK: tl.constexpr,
                      RECENT: tl.constexpr, CH: tl.constexpr, GP: tl.constexpr, RULE: tl.constexpr,
                      BLOCK_K: tl.constexpr, HAS_SS: tl.constexpr, GU: tl.constexpr, HB: tl.constexpr):
    c = tl.program_id(0)
    row = tl.program_id(1)
    n, total, s_lo, s_hi, r_lo, f = _row_state(seqlen_ptr, ss_ptr, row, Hkv, S, SINK, RECENT, HAS_SS)
    lse2 = row_lse2(stats_ptr, row, n_sc, GP, BLOCK_K)
    if c == 0:
        g = tl.arange(0, GP)
        tl.store(lse_ptr + row * G + g, lse2 * _LN2, mask=g < G)
    pc = n // S
    offs = c * CH + tl.arange(0, CH)
    rank = _rank_chunk(scores_ptr + row.to(tl.int64) * G * max_pages, offs, offs < pc, lse2, G, max_pages, CH, GP,
                       RULE, GU)
    tl.store(ranking_ptr + row.to(tl.int64) * max_pages + offs, rank, mask=offs < pc)
    valid = _candidates(offs, n, total, s_lo, s_hi, r_lo, S, K)
    bins = (_orderkey(tl.where(valid, rank, 0.0)) >> (32 - HB)).to(tl.int32)
    NB: tl.constexpr = 1 << HB
    hist = hist_ptr + row.to(tl.int64) * NB
    tl.atomic_add(hist + bins, 1, mask=valid, sem="relaxed", scope="gpu")
    tl.debug_barrier()  # every thread's counts are in before the ticket is taken
    ticket = tl.atomic_add(done_ptr + row, 1, sem="acq_rel", scope="gpu")
    if ticket == n_chunks - 1:  # the row's last program: the threshold bin
        tl.atomic_xchg(done_ptr + row, 0, sem="relaxed", scope="gpu")
        d = tl.arange(0, NB)
        h = tl.load(hist + d, cache_modifier=".cg")
        tl.store(hist + d, tl.zeros([NB], tl.int32))  # clear for the next step
        n_valid = tl.sum(h, axis=0)
        need = tl.minimum(K - f, n_valid)
        ge = n_valid - tl.cumsum(h, axis=0) + h  # keys in bins >= d
        t = tl.where(need > 0, tl.max(tl.where(ge >= need, d, -1), axis=0), NB)
        above = tl.sum(tl.where(d > t, h, 0), axis=0)
        tl.store(info_ptr + row * 8, t)
        tl.store(info_ptr + row * 8 + 1, tl.maximum(need - above, 0))


@triton.jit
def _resolve(row, n_c, rem, ckey, cidx, cnt_ptr, off_ptr, quota_ptr, info_ptr, n_chunks, CH: tl.constexpr,
             TILE: tl.constexpr, CP: tl.constexpr, EARLY: tl.constexpr, BITS: tl.constexpr,
             REBASE: tl.constexpr):
    """The row's exact threshold among its ``n_c`` candidates (keys ``ckey``, pages ``cidx``), then
    each chunk's output offset and its quota of threshold ties. Stores the key map (lo, shift) and
    the threshold (prefix, kmask) in ``info`` for the emit step."""
    lo = tl.full([], 0, tl.uint32)
    shift = tl.full([], 0, tl.uint32)
    prefix = tl.full([], 0, tl.uint32)
    kmask = tl.full([], 0, tl.uint32)
    remaining = rem
    cc = tl.arange(0, CP)
    strict = tl.zeros([CP], tl.int32)  # per chunk: candidates above the threshold
    ties = tl.zeros([CP], tl.int32)  # per chunk: candidates at the threshold
    if n_c <= TILE:  # one register tile: the chunks' passes, over rebased keys
        fi = tl.arange(0, TILE)
        ok = fi < n_c
        key = tl.load(ckey + fi, mask=ok, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        idx = tl.load(cidx + fi, mask=ok, other=0, cache_modifier=".cg")
        if REBASE:
            lo, shift = _rebase_params(key, ok)
            key = _rebased(key, ok, lo, shift)
        prefix, kmask, remaining = radix_threshold(key, ok, rem, EARLY, BITS)
        km = key & kmask
        strict = tl.histogram(idx // CH, CP, mask=ok & (km > prefix))
        ties = tl.histogram(idx // CH, CP, mask=ok & (km == prefix))
    else:  # radix passes over the candidates, re-read from L2 each pass
        n_in = n_c
        i = 0
        while _more_passes(i, n_in, remaining, EARLY, BITS):
            sh, dmask = _digit(i, BITS)
            h = tl.zeros([32], tl.int32)
            for t0 in range(0, n_c, TILE):
                fi = t0 + tl.arange(0, TILE)
                ok = fi < n_c
                key = tl.load(ckey + fi, mask=ok, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
                h += _digit_hist(key, ok & ((key & kmask) == prefix), sh, dmask, BITS)
            remaining, prefix, kmask, n_in = _advance(h, sh, dmask, remaining, prefix, kmask, BITS)
            i += 1
        for t0 in range(0, n_c, TILE):
            fi = t0 + tl.arange(0, TILE)
            ok = fi < n_c
            key = tl.load(ckey + fi, mask=ok, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
            idx = tl.load(cidx + fi, mask=ok, other=0, cache_modifier=".cg")
            km = key & kmask
            strict += tl.histogram(idx // CH, CP, mask=ok & (km > prefix))
            ties += tl.histogram(idx // CH, CP, mask=ok & (km == prefix))
    in_row = cc < n_chunks
    quota = tl.minimum(tl.maximum(remaining - (tl.cumsum(ties, axis=0) - ties), 0), ties)
    above = tl.load(cnt_ptr + row * n_chunks + cc, mask=in_row, other=0, cache_modifier=".cg")
    chosen = above + strict + quota
    tl.store(off_ptr + row * n_chunks + cc, tl.cumsum(chosen, axis=0) - chosen, mask=in_row)
    tl.store(quota_ptr + row * n_chunks + cc, quota, mask=in_row)
    tl.store(info_ptr + row * 8 + 2, lo.to(tl.int32, bitcast=True))
    tl.store(info_ptr + row * 8 + 3, shift.to(tl.int32, bitcast=True))
    tl.store(info_ptr + row * 8 + 4, prefix.to(tl.int32, bitcast=True))
    tl.store(info_ptr + row * 8 + 5, kmask.to(tl.int32, bitcast=True))


@triton.jit
def _refine_kernel(ranking_ptr, seqlen_ptr, ss_ptr, info_ptr, cnt_ptr, ckey_ptr, cidx_ptr, ccount_ptr, done_ptr,
                   off_ptr, quota_ptr, Hkv, max_pages, n_chunks, cap, S: tl.constexpr, K: tl.constexpr,
                   SINK: tl.constexpr, RECENT: tl.constexpr, CH: tl.constexpr, HB: tl.constexpr,
                   TILE: tl.constexpr, CP: tl.constexpr, HAS_SS: tl.constexpr, EARLY: tl.constexpr,
                   BITS: tl.constexpr, REBASE: tl.constexpr):
    c = tl.program_id(0)
    row = tl.program_id(1)
    n, total, s_lo, s_hi, r_lo, f = _row_state(seqlen_ptr, ss_ptr, row, Hkv, S, SINK, RECENT, HAS_SS)
    t = tl.load(info_ptr + row * 8)
    rem = tl.load(info_ptr + row * 8 + 1)
    offs = c * CH + tl.arange(0, CH)
    valid = _candidates(offs, n, total, s_lo, s_hi, r_lo, S, K)
    key, bins = _chunk_keys(ranking_ptr + row.to(tl.int64) * max_pages, offs, valid, HB)
    tl.store(cnt_ptr + row * n_chunks + c, tl.sum((valid & (bins > t)).to(tl.int32), axis=0))
    cand = valid & (bins == t)
    ckey = ckey_ptr + row.to(tl.int64) * cap
    cidx = cidx_ptr + row.to(tl.int64) * cap
    base = tl.atomic_add(ccount_ptr + row, tl.sum(cand.to(tl.int32), axis=0), sem="relaxed", scope="gpu")
    pos = base + tl.cumsum(cand.to(tl.int32), axis=0) - 1
    tl.store(ckey + pos, key.to(tl.int32, bitcast=True), mask=cand)
    tl.store(cidx + pos, offs, mask=cand)
    tl.debug_barrier()  # every thread's candidates and counts are written before the ticket is taken
    ticket = tl.atomic_add(done_ptr + row, 1, sem="acq_rel", scope="gpu")
    if ticket == n_chunks - 1:  # the row's last program: the exact threshold and the chunks' offsets
        tl.atomic_xchg(done_ptr + row, 0, sem="relaxed", scope="gpu")
        n_c = tl.atomic_xchg(ccount_ptr + row, 0, sem="relaxed", scope="gpu")
        _resolve(row, n_c, rem, ckey, cidx, cnt_ptr, off_ptr, quota_ptr, info_ptr, n_chunks, CH, TILE, CP, EARLY,
                 BITS, REBASE)


@triton.jit
def _emit_kernel(ranking_ptr, seqlen_ptr, ss_ptr, info_ptr, off_ptr, quota_ptr, out_ptr, Hkv, max_pages, n_chunks,
                 S: tl.constexpr, K: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, CH: tl.constexpr,
                 HB: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, RP: tl.constexpr, HAS_SS: tl.constexpr):
    c = tl.program_id(0)
    row = tl.program_id(1)
    n, total, s_lo, s_hi, r_lo, f = _row_state(seqlen_ptr, ss_ptr, row, Hkv, S, SINK, RECENT, HAS_SS)
    out = out_ptr + row.to(tl.int64) * K
    if total <= K:  # every page is attended: the first program lists them
        if c == 0:
            kk = tl.arange(0, KP)
            tl.store(out + kk, tl.where(kk < total, kk, -1), mask=kk < K)
    else:
        info = info_ptr + row * 8
        t = tl.load(info)
        lo = tl.load(info + 2).to(tl.uint32, bitcast=True)
        shift = tl.load(info + 3).to(tl.uint32, bitcast=True)
        prefix = tl.load(info + 4).to(tl.uint32, bitcast=True)
        kmask = tl.load(info + 5).to(tl.uint32, bitcast=True)
        o = tl.load(off_ptr + row * n_chunks + c)
        q = tl.load(quota_ptr + row * n_chunks + c)
        start = c * CH
        offs = start + tl.arange(0, CH)
        valid = _candidates(offs, n, total, s_lo, s_hi, r_lo, S, K)
        key, bins = _chunk_keys(ranking_ptr + row.to(tl.int64) * max_pages, offs, valid, HB)
        in_t = valid & (bins == t)
        km = _rebased(key, in_t, lo, shift) & kmask
        tie = in_t & (km == prefix)
        tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) - 1
        sel = valid & ((bins > t) | (in_t & (km > prefix)) | (tie & (tie_rank < q)))
        pos = o + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(out + pos + _below(offs, s_lo, s_hi, r_lo, total), offs, mask=sel)
        # the forced pages of this chunk's range: after the chosen pages below them
        sp = s_lo + tl.arange(0, SP)
        sp_ok = (sp < s_hi) & (sp >= start) & (sp < start + CH)
        below_s = o + tl.sum((sel[None, :] & (offs[None, :] < sp[:, None])).to(tl.int32), axis=1)
        tl.store(out + below_s + _below(sp, s_lo, s_hi, r_lo, total), sp, mask=sp_ok)
        rp = r_lo + tl.arange(0, RP)
        rp_ok = (rp < total) & ~((rp >= s_lo) & (rp < s_hi)) & (rp >= start) & (rp < start + CH)
        below_r = o + tl.sum((sel[None, :] & (offs[None, :] < rp[:, None])).to(tl.int32), axis=1)
        tl.store(out + below_r + _below(rp, s_lo, s_hi, r_lo, total), rp, mask=rp_ok)


def row_radix_workspace(batch: int, num_kv_heads: int, max_pages: int, k: int, device, chunk: int = 1024) -> dict:
    """Buffers for :func:`rank_and_select_rows`, allocated once per plan (``chunk``: pages per program)."""
    chunk = min(int(chunk), max(16, triton.next_power_of_2(max_pages)))
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk}: pages per program must be a power of two >= 16")
    n_chunks = max(1, -(-max_pages // chunk))
    rows = batch * num_kv_heads
    i32 = dict(dtype=torch.int32, device=device)
    cap = n_chunks * chunk
    return {
        "path": "row_radix", "chunk": chunk, "n_chunks": n_chunks, "cap": cap,
        "hist": torch.zeros(rows, 1 << HIST_BITS, **i32),  # cleared by the launch that reads it
        "done": torch.zeros(2, rows, **i32),  # the two tickets, reset by the rows' last programs
        "ccount": torch.zeros(rows, **i32),  # candidates appended per row, reset likewise
        "info": torch.zeros(rows, INFO, **i32),
        "above": torch.zeros(rows, n_chunks, **i32),
        "offset": torch.zeros(rows, n_chunks, **i32),
        "quota": torch.zeros(rows, n_chunks, **i32),
        "ckey": torch.empty(rows, cap, **i32),
        "cidx": torch.empty(rows, cap, **i32),
        "out": torch.empty(batch, num_kv_heads, k, **i32),
    }


def rank_and_select_rows(score_ws: dict, seq_lens: torch.Tensor, *, page_size: int, k: int,
                         combine: str = "mean_share", sink_pages: int = 1, recent_pages: int = 1,
                         sink_start: torch.Tensor | None = None, workspace: dict | None = None) -> torch.Tensor:
    """Same contract as :func:`kvlocks.selection.fused.rank_and_select` (the score workspace after
    ``score_pages_paged(..., rank=False)``; its ``lse`` and ``ranking`` are written), by the
    row-histogram selection; ``workspace`` from :func:`row_radix_workspace`."""
    check_select_args(k, sink_pages, recent_pages)
    _check_rule(combine)
    scores = score_ws["scores"]
    bsz, hkv, g, max_pages = scores.shape
    if seq_lens.shape != (bsz,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{bsz}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    ws = workspace or row_radix_workspace(bsz, hkv, max_pages, k, scores.device)
    if ws.get("path") != "row_radix" or ws["out"].shape != (bsz, hkv, k) or ws["cap"] < max_pages:
        raise ValueError(f"workspace is not a row_radix_workspace for output {(bsz, hkv, k)} over {max_pages} pages")
    ss = sink_start if sink_start is not None else seq_lens
    grid = (ws["n_chunks"], bsz * hkv)
    ch, nc = ws["chunk"], ws["n_chunks"]
    rows = dict(S=page_size, K=k, SINK=sink_pages, RECENT=recent_pages, CH=ch, HB=HIST_BITS,
                HAS_SS=sink_start is not None)
    warps = ws.get("num_warps") or (8 if ch >= 2048 else 4)
    _rank_hist_kernel[grid](
        scores, score_ws["stats"], score_ws["n_chunks"], seq_lens, ss, score_ws["ranking"], score_ws["lse"],
        ws["hist"], ws["done"][0], ws["info"], hkv, g, max_pages, nc, GP=score_ws["stats"].shape[-1],
        RULE=RULES[combine], BLOCK_K=stats_block(score_ws), GU=g if ws.get("unroll_heads", UNROLL_HEADS) else 0,
        num_warps=warps, **rows)
    _refine_kernel[grid](
        score_ws["ranking"], seq_lens, ss, ws["info"], ws["above"], ws["ckey"], ws["cidx"], ws["ccount"],
        ws["done"][1], ws["offset"], ws["quota"], hkv, max_pages, nc, ws["cap"],
        TILE=ws.get("tile") or min(TILE, triton.next_power_of_2(ws["cap"])), CP=max(32, triton.next_power_of_2(nc)), EARLY=bool(ws.get("early_exit", EARLY_EXIT)), BITS=digit_bits(ws),
        REBASE=bool(ws.get("rebase_keys", REBASE_KEYS)), num_warps=warps, **rows)
    _emit_kernel[grid](
        score_ws["ranking"], seq_lens, ss, ws["info"], ws["offset"], ws["quota"], ws["out"], hkv, max_pages, nc,
        KP=triton.next_power_of_2(k), SP=triton.next_power_of_2(max(sink_pages, 1)),
        RP=triton.next_power_of_2(recent_pages), num_warps=warps, **rows)
    return ws["out"]
