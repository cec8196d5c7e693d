"""Sink + recent + top-(k - forced) page selection without a sort, in Triton.

Two launches, grid sizes fixed by the plan (no host sync, graph-capturable):

1. ``_chunk_kernel``, grid ``(chunks, B * Hkv)``: each program takes CH consecutive pages of a
   row, maps each ranking to an order-preserving uint32 key and finds its chunk's top-m by a radix
   select (eight 4-bit digits, a 32-bin ``tl.histogram`` per digit: no sort). Ties at the
   threshold go to the lower page index (a prefix count over the tied pages). It writes the at
   most m winners, in page order, plus their count. Any global top-m page is in its chunk's top-m.
2. ``_merge_kernel``, grid ``(B * Hkv,)``: the same radix select over all chunks' winners (at
   most ``chunks * M`` keys, read tile by tile), then a prefix-count compaction that writes the
   m winners and the forced pages straight to their ascending positions in the output.

Output: int32 ``[B, Hkv, K]`` logical page ids in ascending order; a row with at most K pages
lists them all and pads with -1. Same choice as :func:`kvlocks.selection.topk.select_top_pages`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# stop the radix passes once every key left in the threshold digit is chosen (same pages; fewer
# passes on spread-out rankings). H200, session 8 (docs/results/gpu_session8/): the fused selection
# alone at 1M 29.8 -> 24.9 us (glm4-9b-1m), 28.6 -> 24.7 (llama3-8b); GLM-4-9B TPOT at 1M
# 12.64 -> 11.84 ms (scripts/device/select_ab.py --modes fused,fused_early, one machine).
EARLY_EXIT = True
# the merge loads the chunks' winners once and runs its radix passes on registers when one tile
# (<= 4096 keys) holds them all, instead of re-reading them from L2 for every pass (same pages).
# radix digit width: 4 (eight passes; the 32-bin histogram's upper half counts the keys that do not
# match the prefix) or 5 (seven passes, the same 32-bin histogram with a mask). Same pages.
# H200, session 9 (docs/results/gpu_session9/, scripts/device/pending8.sh): the fused selection alone
# at 1M 25.0 -> 22.4 us (llama3-8b), 24.6 -> 23.5 (glm4-9b-1m); after the score kernel at 1M
# 188.9 -> 185.5 us (llama3-8b), 122.9 -> 120.7 (glm4); GLM-4-9B TPOT 1M 12.21 -> 12.06 ms, 128K
# 8.40 -> 8.32, 32K 7.56 -> 7.49 (select_ab.py --modes fused,fused_regs_bits5, one machine).
MERGE_IN_REGISTERS = True
DIGIT_BITS = 5
# radix passes over keys rebased per program (:func:`_rebased`: minus their minimum, shifted so the
# highest bit where they differ is bit 31): the first digit splits where the keys differ instead of
# on the sign and exponent bits they share. Same pages. On synthetic mean-share rankings (65,536
# pages, chunks of 4,096, k = 126; an emulation of the passes, docs/benchmarks.md) the early-stopping
# passes per chunk drop from ~4.0 to ~2.8 and the merge's from ~4.2 to ~2.5. On since session 11
# (H200: -0.1 to -1.3 us per layer, fused_select_probe.py --rebase both).
REBASE_KEYS = True


def default_chunk(max_pages: int) -> int:
    """Pages per stage-1 program: an eighth of the row rounded down to a power of two, clamped to
    1024 to 4096. Measured on the H200
    (``scripts/device/select_probe.py``, glm4-9b-1m shape, batch 1; llama3-8b alike): 64K tokens
    best at 1024 (13.6 us; 2048: 15.0, 4096: 20.2), 256K at 2048 (20.3; 1024: 26.6, 4096: 23.5),
    1M at 4096 (37.5; 2048: 44.5, 8192: 45.2). Fewer, longer chunks serialise the radix passes;
    more chunks grow the merge (chunks x winners keys in one program)."""
    eighth = max(max_pages // 8, 1)
    return min(4096, max(1024, 1 << (eighth.bit_length() - 1)))


@triton.jit
def _orderkey(x):
    """float32 -> uint32 with the same order (-0.0 folded onto +0.0: torch ranks them as equal)."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, ~u, u | 0x80000000)


@triton.jit
def _forced(n, ss, S: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Page count and the forced ranges [s_lo, s_hi) (sink) and [r_lo, r_hi) (recent)."""
    total = (n + S - 1) // S
    s_lo = tl.minimum(ss, total)
    s_hi = tl.minimum(ss + SINK, total)
    r_lo = tl.maximum(total - RECENT, 0)
    overlap = tl.maximum(tl.minimum(s_hi, total) - tl.maximum(s_lo, r_lo), 0)
    f = (s_hi - s_lo) + (total - r_lo) - overlap
    return total, s_lo, s_hi, r_lo, f


@triton.jit
def _below(x, s_lo, s_hi, r_lo, total):
    """Number of forced pages with index < x (elementwise)."""
    a = tl.minimum(tl.maximum(x - s_lo, 0), s_hi - s_lo)
    c = tl.minimum(tl.maximum(x - r_lo, 0), total - r_lo)
    o_lo = tl.maximum(s_lo, r_lo)
    o = tl.minimum(tl.maximum(x - o_lo, 0), tl.maximum(s_hi - o_lo, 0))
    return a + c - o


@triton.jit
def _pick_digit(hist, remaining, BITS: tl.constexpr):
    """Digit d* holding the remaining-th largest key, how many keys lie in higher digits, and how
    many in d* itself (``hist``: 32 bins, the digits in the first 2**BITS)."""
    d = tl.arange(0, 32)
    nb: tl.constexpr = 1 << BITS
    h = tl.where(d < nb, hist, 0)
    ge = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys with digit >= d
    dstar = tl.max(tl.where((ge >= remaining) & (d < nb), d, -1), axis=0)
    above = tl.sum(tl.where(d > dstar, h, 0), axis=0)
    inside = tl.sum(tl.where(d == dstar, h, 0), axis=0)
    return dstar, above, inside


@triton.jit
def _digit(i, BITS: tl.constexpr):
    """Pass i's digit of a 32-bit key, from the top: (shift, mask). BITS-bit digits; with BITS = 5 the
    seventh and last is 2 bits wide."""
    shift = tl.maximum(32 - BITS * (i + 1), 0)
    width = tl.minimum(32 - BITS * i, BITS)
    return shift.to(tl.uint32), ((1 << width) - 1).to(tl.uint32)


@triton.jit
def _more_passes(i, n_in, remaining, EARLY: tl.constexpr, BITS: tl.constexpr):
    """Another radix pass? Until the last digit; with EARLY only while the threshold digit holds
    more keys than are left to choose."""
    digits_left = i < (32 + BITS - 1) // BITS
    if EARLY:
        return digits_left & (n_in > remaining)
    else:
        return digits_left


@triton.jit
def _advance(hist, shift, dmask, remaining, prefix, kmask, BITS: tl.constexpr):
    """One radix pass from its digit histogram: (remaining, prefix, kmask, keys in the threshold digit)."""
    dstar, above, n_in = _pick_digit(hist, remaining, BITS)
    return remaining - above, prefix | (dstar.to(tl.uint32) << shift), kmask | (dmask << shift), n_in


@triton.jit
def _digit_hist(key, match, shift, dmask, BITS: tl.constexpr):
    """32-bin histogram of the keys' digit at ``shift`` over the keys where ``match``."""
    d = ((key >> shift) & dmask).to(tl.int32)
    if BITS == 4:  # 16 digits; the unmatched keys counted in bin 16
        return tl.histogram(tl.where(match, d, 16), 32)
    else:  # 32 digits; the unmatched keys masked off
        return tl.histogram(d, 32, mask=match)


@triton.jit
def _rebase_params(key, valid):
    """(lo, shift) of :func:`_rebased` for the valid keys: their minimum, and the left shift that puts
    the highest bit of (max - min) at bit 31 (from the float32 exponent of max - min, which rounds
    to nearest: it can only overstate that bit, never understate it, so nothing is shifted out)."""
    lo = tl.min(tl.where(valid, key, 0xFFFFFFFF), axis=0)
    hi = tl.max(tl.where(valid, key, 0), axis=0)
    diff = tl.where(hi > lo, hi - lo, 0)
    e = ((diff.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(diff)), or one more
    shift = tl.where(diff > 0, tl.maximum(31 - e, 0), 0).to(tl.uint32)
    return lo, shift


@triton.jit
def _rebased(key, valid, lo, shift):
    """Order-preserving map of the valid keys onto the full 32 bits: ``(key - lo) << shift`` (equal keys
    stay equal); the radix passes' first digit then splits where the keys differ, not on the sign
    and exponent bits they share. Invalid keys map to 0."""
    return tl.where(valid, (key - lo) << shift, 0)


@triton.jit
def radix_threshold(key, valid, need, EARLY: tl.constexpr, BITS: tl.constexpr = 4):
    """(prefix, kmask, remaining): the ``need``-th largest valid key's leading digits. Selected are
    the valid keys with ``key & kmask > prefix`` and the first ``remaining`` (by index) with
    ``key & kmask == prefix``. Digits of BITS bits (4: eight passes, 5: seven); with EARLY the passes
    stop as soon as every key left in the threshold digit is selected (``kmask`` then covers only
    the digits fixed)."""
    remaining = tl.maximum(need, 1)
    prefix = tl.full([], 0, tl.uint32)
    kmask = tl.full([], 0, tl.uint32)
    n_in = tl.sum(valid.to(tl.int32), axis=0)  # valid keys matching the prefix so far
    i = 0
    while _more_passes(i, n_in, remaining, EARLY, BITS):
        shift, dmask = _digit(i, BITS)
        remaining, prefix, kmask, n_in = _advance(
            _digit_hist(key, valid & ((key & kmask) == prefix), shift, dmask, BITS), shift, dmask, remaining,
            prefix, kmask, BITS)
        i += 1
    return prefix, kmask, remaining


@triton.jit
def chunk_winners(key, valid, offs, need, slot, ckey_ptr, cidx_ptr, ccnt_ptr, M: tl.constexpr,
                  EARLY: tl.constexpr = False, BITS: tl.constexpr = 4, REBASE: tl.constexpr = False):
    """Radix-select the ``need`` largest of ``key`` where ``valid`` (ties to the lower index) and write
    them, in page order, to chunk slot ``slot``: keys and page ids at ``slot * M``, the count at ``slot``.
    With REBASE the passes run on :func:`_rebased` keys (the same order; the original keys are stored)."""
    rk = key
    if REBASE:
        lo, shift = _rebase_params(key, valid)
        rk = _rebased(key, valid, lo, shift)
    prefix, kmask, remaining = radix_threshold(rk, valid, need, EARLY, BITS)
    km = rk & kmask
    is_t = valid & (km == prefix)
    tie_rank = tl.cumsum(is_t.to(tl.int32), axis=0) - 1
    sel = valid & ((km > prefix) | (is_t & (tie_rank < remaining))) & (tie_rank * 0 < need)
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    tl.store(ckey_ptr + slot * M + pos, key.to(tl.int32, bitcast=True), mask=sel)
    tl.store(cidx_ptr + slot * M + pos, offs, mask=sel)
    tl.store(ccnt_ptr + slot, tl.sum(sel.to(tl.int32), axis=0))


@triton.jit
def _chunk_kernel(rank_ptr, stride_rb, stride_rh, seqlen_ptr, ss_ptr, ckey_ptr, cidx_ptr, ccnt_ptr, Hkv,
                  n_chunks, S: tl.constexpr, K: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
                  CH: tl.constexpr, M: tl.constexpr, HAS_SS: tl.constexpr, EARLY: tl.constexpr,
                  BITS: tl.constexpr, REBASE: tl.constexpr = False):
    c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // Hkv
    h = row % Hkv
    n = tl.load(seqlen_ptr + b)
    ss = 0
    if HAS_SS:
        ss = tl.load(ss_ptr + b)
    total, s_lo, s_hi, r_lo, f = _forced(n, ss, S, SINK, RECENT)
    offs = c * CH + tl.arange(0, CH)
    forced = ((offs >= s_lo) & (offs < s_hi)) | (offs >= r_lo)
    limit = tl.where(total > K, n // S, 0)  # candidates: full pages, and only if not all pages fit
    valid = (offs < limit) & ~forced
    x = tl.load(rank_ptr + b.to(tl.int64) * stride_rb + h * stride_rh + offs, mask=valid, other=0.0)
    need = tl.minimum(K - f, tl.sum(valid.to(tl.int32), axis=0))
    chunk_winners(_orderkey(x), valid, offs, need, (row * n_chunks + c).to(tl.int64), ckey_ptr, cidx_ptr, ccnt_ptr, M,
                  EARLY, BITS, REBASE)


@triton.jit
def _merge_hist(ckey_ptr, ccnt_ptr, row, base, n_chunks, n_flat, kmask, prefix, shift, dmask, M: tl.constexpr,
                TILE: tl.constexpr, BITS: tl.constexpr):
    """Digit histogram (at ``shift``) of the row's chunk winners whose fixed digits equal ``prefix``."""
    hist = tl.zeros([32], tl.int32)
    for t0 in range(0, n_flat, TILE):
        flat = t0 + tl.arange(0, TILE)
        cnt = tl.load(ccnt_ptr + row * n_chunks + flat // M, mask=flat < n_flat, other=0, cache_modifier=".cg")
        valid = (flat % M) < cnt
        key = tl.load(ckey_ptr + base + flat, mask=valid, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        hist += _digit_hist(key, valid & ((key & kmask) == prefix), shift, dmask, BITS)
    return hist


@triton.jit
def merge_row(row, n, ss, ckey_ptr, cidx_ptr, ccnt_ptr, out_ptr, n_chunks, S: tl.constexpr, K: tl.constexpr,
              SINK: tl.constexpr, RECENT: tl.constexpr, M: tl.constexpr, TILE: tl.constexpr, KP: tl.constexpr,
              SP: tl.constexpr, RP: tl.constexpr, CP: tl.constexpr, EARLY: tl.constexpr = False,
              REGS: tl.constexpr = False, BITS: tl.constexpr = 4, REBASE: tl.constexpr = False):
    """Stage 2 for one row: the top ``K - forced`` of all chunks' winners, and the forced pages, in
    ascending page order into ``out_ptr[row]``. Loads bypass L1 (``.cg``): in the fused kernel the
    winners were written by other programs of the same launch. With REGS (every winner fits one
    TILE) the winners are loaded once and the radix passes run on registers, as in a chunk."""
    total, s_lo, s_hi, r_lo, f = _forced(n, ss, S, SINK, RECENT)
    out = out_ptr + row.to(tl.int64) * K
    if total <= K:  # every page is attended
        kk = tl.arange(0, KP)
        tl.store(out + kk, tl.where(kk < total, kk, -1), mask=kk < K)
    else:
        n_flat = n_chunks * M
        base = row.to(tl.int64) * n_flat
        cp = tl.arange(0, CP)
        n_win = tl.sum(tl.load(ccnt_ptr + row * n_chunks + cp, mask=cp < n_chunks, other=0, cache_modifier=".cg"))
        remaining = tl.maximum(K - f, 1)
        prefix = tl.full([], 0, tl.uint32)
        kmask = tl.full([], 0, tl.uint32)  # no digit fixed: every winner matches
        lo = tl.full([], 0, tl.uint32)  # with REBASE (register merge only): the keys' _rebased map
        shift = tl.full([], 0, tl.uint32)
        if REGS:  # one tile holds every winner: one load, then the chunks' register passes
            flat = tl.arange(0, TILE)
            cnt = tl.load(ccnt_ptr + row * n_chunks + flat // M, mask=flat < n_flat, other=0, cache_modifier=".cg")
            valid = (flat % M) < cnt
            key = tl.load(ckey_ptr + base + flat, mask=valid, other=0, cache_modifier=".cg").to(tl.uint32,
                                                                                              bitcast=True)
            if REBASE:
                lo, shift = _rebase_params(key, valid)
                key = _rebased(key, valid, lo, shift)
            prefix, kmask, remaining = radix_threshold(key, valid, tl.minimum(remaining, n_win), EARLY, BITS)
        elif n_win <= remaining:  # every winner is selected (one chunk, or few candidates): no radix pass
            remaining = n_win
        else:  # radix passes over the winners, re-read from L2 each pass
            n_in = n_win
            i = 0
            while _more_passes(i, n_in, remaining, EARLY, BITS):
                shift, dmask = _digit(i, BITS)
                remaining, prefix, kmask, n_in = _advance(
                    _merge_hist(ckey_ptr, ccnt_ptr, row, base, n_chunks, n_flat, kmask, prefix, shift, dmask, M,
                                TILE, BITS), shift, dmask, remaining, prefix, kmask, BITS)
                i += 1
        # compaction in page order; forced pages get their slots from the counts below them
        sp = s_lo + tl.arange(0, SP)
        sp_ok = sp < s_hi
        rp = r_lo + tl.arange(0, RP)
        rp_ok = (rp < total) & ~((rp >= s_lo) & (rp < s_hi))
        below_s = tl.zeros([SP], tl.int32)
        below_r = tl.zeros([RP], tl.int32)
        n_ties = tl.full([], 0, tl.int32)
        n_sel = tl.full([], 0, tl.int32)
        for t0 in range(0, n_flat, TILE):
            flat = t0 + tl.arange(0, TILE)
            cnt = tl.load(ccnt_ptr + row * n_chunks + flat // M, mask=flat < n_flat, other=0, cache_modifier=".cg")
            valid = (flat % M) < cnt
            key = tl.load(ckey_ptr + base + flat, mask=valid, other=0, cache_modifier=".cg").to(tl.uint32,
                                                                                              bitcast=True)
            idx = tl.load(cidx_ptr + base + flat, mask=valid, other=0, cache_modifier=".cg")
            if REBASE and REGS:
                key = _rebased(key, valid, lo, shift)
            km = key & kmask
            is_t = valid & (km == prefix)
            tie_rank = n_ties + tl.cumsum(is_t.to(tl.int32), axis=0) - 1
            sel = valid & ((km > prefix) | (is_t & (tie_rank < remaining)))
            pos = n_sel + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(out + pos + _below(idx, s_lo, s_hi, r_lo, total), idx, mask=sel)
            below_s += tl.sum((sel[None, :] & (idx[None, :] < sp[:, None])).to(tl.int32), axis=1)
            below_r += tl.sum((sel[None, :] & (idx[None, :] < rp[:, None])).to(tl.int32), axis=1)
            n_ties += tl.sum(is_t.to(tl.int32), axis=0)
            n_sel += tl.sum(sel.to(tl.int32), axis=0)
        tl.store(out + below_s + _below(sp, s_lo, s_hi, r_lo, total), sp, mask=sp_ok)
        tl.store(out + below_r + _below(rp, s_lo, s_hi, r_lo, total), rp, mask=rp_ok)


@triton.jit
def _merge_kernel(seqlen_ptr, ss_ptr, ckey_ptr, cidx_ptr, ccnt_ptr, out_ptr, Hkv, n_chunks,
                  S: tl.constexpr, K: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, M: tl.constexpr,
                  TILE: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, RP: tl.constexpr, CP: tl.constexpr,
                  HAS_SS: tl.constexpr, EARLY: tl.constexpr, REGS: tl.constexpr, BITS: tl.constexpr,
                  REBASE: tl.constexpr = False):
    row = tl.program_id(0)
    b = row // Hkv
    ss = 0
    if HAS_SS:
        ss = tl.load(ss_ptr + b)
    merge_row(row, tl.load(seqlen_ptr + b), ss, ckey_ptr, cidx_ptr, ccnt_ptr, out_ptr, n_chunks, S, K, SINK,
              RECENT, M, TILE, KP, SP, RP, CP, EARLY, REGS, BITS, REBASE)


def select_workspace(batch: int, num_kv_heads: int, max_pages: int, k: int, device, chunk: int | None = None) -> dict:
    """Buffers for :func:`select_pages_paged`, allocated once per plan; ``chunk`` None = :func:`default_chunk`."""
    chunk = default_chunk(max_pages) if chunk is None else chunk
    chunk = min(chunk, max(16, triton.next_power_of_2(max_pages)))
    n_chunks = max(1, -(-max_pages // chunk))
    m = triton.next_power_of_2(max(k, 1))
    rows = batch * num_kv_heads
    i32 = dict(dtype=torch.int32, device=device)
    return {
        "chunk": chunk, "n_chunks": n_chunks, "m": m,
        "keys": torch.empty(rows, n_chunks, m, **i32),  # uint32 order keys, stored bitcast
        "idx": torch.empty(rows, n_chunks, m, **i32),
        "count": torch.empty(rows, n_chunks, **i32),
        "done": torch.zeros(rows, **i32),  # per-row arrival counters of the fused kernel (reset by it)
        "out": torch.empty(batch, num_kv_heads, k, **i32),
    }


def merge_meta(ws: dict, k: int, sink_pages: int, recent_pages: int) -> dict:
    """Compile-time sizes of :func:`merge_row` for a workspace and its radix options: early stop
    (``ws["early_exit"]``, default EARLY_EXIT), merge on registers where one tile holds every
    winner (``ws["merge_in_registers"]``, default MERGE_IN_REGISTERS), digit width
    (:func:`digit_bits`), radix passes over rebased keys (``ws["rebase_keys"]``, default
    REBASE_KEYS; the chunks' and the register merge's)."""
    m, n_chunks = ws["m"], ws["n_chunks"]
    tile = max(m, min(4096, triton.next_power_of_2(n_chunks * m)))
    return dict(M=m, TILE=tile, KP=triton.next_power_of_2(k),
                SP=triton.next_power_of_2(max(sink_pages, 1)), RP=triton.next_power_of_2(recent_pages),
                CP=triton.next_power_of_2(n_chunks), EARLY=bool(ws.get("early_exit", EARLY_EXIT)),
                REGS=bool(ws.get("merge_in_registers", MERGE_IN_REGISTERS)) and n_chunks * m <= tile,
                BITS=digit_bits(ws), REBASE=bool(ws.get("rebase_keys", REBASE_KEYS)))


def digit_bits(ws: dict) -> int:
    """Radix digit width of a workspace's selection (``ws["digit_bits"]``, default DIGIT_BITS): 4 or 5."""
    bits = int(ws.get("digit_bits", DIGIT_BITS))
    if bits not in (4, 5):
        raise ValueError(f"digit_bits={bits}: allowed 4 or 5")
    return bits


def check_select_args(k: int, sink_pages: int, recent_pages: int) -> None:
    if k < sink_pages + recent_pages or recent_pages < 1 or sink_pages < 0:
        raise ValueError(f"k={k}, sink_pages={sink_pages}, recent_pages={recent_pages}: need k >= sink_pages + "
                         "recent_pages, recent_pages >= 1 and sink_pages >= 0")


def select_pages_paged(ranking: torch.Tensor, seq_lens: torch.Tensor, *, page_size: int, k: int,
                       sink_pages: int = 1, recent_pages: int = 1, sink_start: torch.Tensor | None = None,
                       workspace: dict | None = None) -> torch.Tensor:
    """Pages to attend per (sequence, KV head).

    Parameters
    ----------
    ranking : float32 ``[B, Hkv, max_pages]`` (last dim contiguous); entry ``p`` is read only for
        full pages ``p < seq_lens[b] // page_size``
    seq_lens : int32 ``[B]``; sink_start : int32 ``[B]`` or None (first page of the sink)
    k : pages per step, sink and recent included (``k >= sink_pages + recent_pages``)

    Returns
    -------
    int32 ``[B, Hkv, k]``: ascending logical page ids, padded with -1 when a sequence has fewer
    than k pages.
    """
    bsz, hkv, max_pages = ranking.shape
    check_select_args(k, sink_pages, recent_pages)
    ws = workspace or select_workspace(bsz, hkv, max_pages, k, ranking.device)
    rows, n_chunks = bsz * hkv, ws["n_chunks"]
    ss = sink_start if sink_start is not None else seq_lens
    meta = dict(S=page_size, K=k, SINK=sink_pages, RECENT=recent_pages, HAS_SS=sink_start is not None)
    _chunk_kernel[(n_chunks, rows)](
        ranking, ranking.stride(0), ranking.stride(1), seq_lens, ss, ws["keys"], ws["idx"], ws["count"], hkv,
        n_chunks, CH=ws["chunk"], M=ws["m"], EARLY=bool(ws.get("early_exit", EARLY_EXIT)), BITS=digit_bits(ws),
        REBASE=bool(ws.get("rebase_keys", REBASE_KEYS)), num_warps=8, **meta,
    )
    _merge_kernel[(rows,)](
        seq_lens, ss, ws["keys"], ws["idx"], ws["count"], ws["out"], hkv, n_chunks,
        **merge_meta(ws, k, sink_pages, recent_pages), num_warps=8, **meta,
    )
    return ws["out"]


def select_top_pages(ranking: torch.Tensor, total_pages: int, k: int, *, sink_pages: int = 1,
                     recent_pages: int = 1, sink_start: torch.Tensor | None = None) -> torch.Tensor:
    """Same as :func:`kvlocks.selection.topk.select_top_pages`: ``[..., Pc]`` -> int64 ``[..., min(k, P)]``."""
    pc = ranking.shape[-1]
    if total_pages not in (pc, pc + 1):
        raise ValueError(f"total_pages={total_pages} must be the candidate count {pc} or {pc + 1}")
    lead = ranking.shape[:-1]
    rows = lead.numel()
    x = ranking.float().reshape(rows, 1, pc).contiguous()
    if pc == 0:
        x = torch.zeros(rows, 1, 1, device=ranking.device)
    # token count consistent with (Pc full pages, total pages): a partial page holds one token
    n = pc * 16 + (1 if total_pages > pc else 0)
    seq = torch.full((rows,), n, dtype=torch.int32, device=ranking.device)
    ss = None if sink_start is None else sink_start.reshape(-1).to(torch.int32).contiguous()
    out = select_pages_paged(x, seq, page_size=16, k=k, sink_pages=sink_pages,
                             recent_pages=recent_pages, sink_start=ss)
    kk = min(k, total_pages)
    return out[:, 0, :kk].long().reshape(*lead, kk)
