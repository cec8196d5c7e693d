"""Sink + recent + top-(k - forced) page selection without a sort, in Triton.

Two launches, grid sizes fixed by the plan (no host sync, graph-capturable):

1. ``_chunk_kernel``, grid ``(chunks, B * Hkv)``: each program takes CH consecutive pages of a
   row, maps each ranking to an order-preserving uint32 key and finds its chunk's top-m by a radix
   select (5-bit digits from the top, a 32-bin ``tl.histogram`` per digit: no sort). Ties at the
   threshold go to the lower page index (a prefix count over the tied pages). It writes the at
   most m winners, in page order, plus their count. Any global top-m page is in its chunk's top-m.
2. ``_merge_kernel``, grid ``(B * Hkv,)``: the same radix select over all chunks' winners (at
   most ``chunks * M`` keys: on registers when one tile holds them all, else re-read from L2 for
   every pass), then a prefix-count compaction that writes the m winners and the forced pages
   straight to their ascending positions in the output.

The radix passes stop once every key left in the threshold digit is chosen, and run on keys
rebased per program (minus their minimum, shifted so the highest bit where they differ is bit 31),
so the first digit splits where the keys differ. Each was timed on the H200 against its
alternative (docs/benchmarks.md): the early stop took the fused selection alone at 1M from 29.8 to
24.9 us (glm4-9b-1m) and GLM-4-9B TPOT at 1M from 12.64 to 11.84 ms; the register merge with 5-bit
digits (seven passes instead of eight 4-bit ones) 25.0 -> 22.4 us (llama3-8b), TPOT 1M 12.21 ->
12.06 ms; rebased keys -0.1 to -1.3 us per layer. Same pages every way.

Output: int32 ``[B, Hkv, K]`` logical page ids in ascending order; a row with at most K pages
lists them all and pads with -1. Same choice as :func:`kvlocks.selection.topk.select_top_pages`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvlocks.selection.triton_radix import (
    _advance, _below, _digit, _digit_hist, _forced, _more_passes, _orderkey, _rebase_params, _rebased, chunk_winners,
    radix_threshold,
)

def default_chunk(max_pages: int) -> int:
    """Pages per stage-1 program: an eighth of the row rounded down to a power of two, clamped to
    1024 to 4096. Measured on the H200
    (glm4-9b-1m shape, batch 1; llama3-8b alike; docs/benchmarks.md): 64K tokens
    best at 1024 (13.6 us; 2048: 15.0, 4096: 20.2), 256K at 2048 (20.3; 1024: 26.6, 4096: 23.5),
    1M at 4096 (37.5; 2048: 44.5, 8192: 45.2). Fewer, longer chunks serialise the radix passes;
    more chunks grow the merge (chunks x winners keys in one program)."""
    eighth = max(max_pages // 8, 1)
    return min(4096, max(1024, 1 << (eighth.bit_length() - 1)))


@triton.jit
def _chunk_kernel(rank_ptr, stride_rb, stride_rh, seqlen_ptr, ss_ptr, ckey_ptr, cidx_ptr, ccnt_ptr, Hkv,
                  n_chunks, S: tl.constexpr, K: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
                  CH: tl.constexpr, M: tl.constexpr, HAS_SS: tl.constexpr):
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
    chunk_winners(_orderkey(x), valid, offs, need, (row * n_chunks + c).to(tl.int64), ckey_ptr, cidx_ptr, ccnt_ptr, M)


@triton.jit
def _merge_hist(ckey_ptr, ccnt_ptr, row, base, n_chunks, n_flat, kmask, prefix, shift, dmask, M: tl.constexpr,
                TILE: tl.constexpr):
    """Digit histogram (at ``shift``) of the row's chunk winners whose fixed digits equal ``prefix``."""
    hist = tl.zeros([32], tl.int32)
    for t0 in range(0, n_flat, TILE):
        flat = t0 + tl.arange(0, TILE)
        cnt = tl.load(ccnt_ptr + row * n_chunks + flat // M, mask=flat < n_flat, other=0, cache_modifier=".cg")
        valid = (flat % M) < cnt
        key = tl.load(ckey_ptr + base + flat, mask=valid, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        hist += _digit_hist(key, valid & ((key & kmask) == prefix), shift, dmask)
    return hist


@triton.jit
def merge_row(row, n, ss, ckey_ptr, cidx_ptr, ccnt_ptr, out_ptr, n_chunks, S: tl.constexpr, K: tl.constexpr,
              SINK: tl.constexpr, RECENT: tl.constexpr, M: tl.constexpr, TILE: tl.constexpr, KP: tl.constexpr,
              SP: tl.constexpr, RP: tl.constexpr, CP: tl.constexpr, REGS: tl.constexpr):
    """Stage 2 for one row: the top ``K - forced`` of all chunks' winners, and the forced pages, in
    ascending page order into ``out_ptr[row]``. Loads bypass L1 (``.cg``): in the fused kernel the
    winners were written by other programs of the same launch. With REGS (every winner fits one
    TILE) the winners are loaded once and the radix passes run on registers over rebased keys, as
    in a chunk; otherwise they re-read the winners from L2 for every pass."""
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
        lo = tl.full([], 0, tl.uint32)  # register merge: the keys' _rebased map
        up = tl.full([], 0, tl.uint32)
        if REGS:  # one tile holds every winner: one load, then the chunks' register passes
            flat = tl.arange(0, TILE)
            cnt = tl.load(ccnt_ptr + row * n_chunks + flat // M, mask=flat < n_flat, other=0, cache_modifier=".cg")
            valid = (flat % M) < cnt
            key = tl.load(ckey_ptr + base + flat, mask=valid, other=0, cache_modifier=".cg").to(tl.uint32,
                                                                                              bitcast=True)
            lo, up = _rebase_params(key, valid)
            key = _rebased(key, valid, lo, up)
            prefix, kmask, remaining = radix_threshold(key, valid, tl.minimum(remaining, n_win))
        elif n_win <= remaining:  # every winner is selected (one chunk, or few candidates): no radix pass
            remaining = n_win
        else:  # radix passes over the winners, re-read from L2 each pass
            n_in = n_win
            i = 0
            while _more_passes(i, n_in, remaining):
                shift, dmask = _digit(i)
                remaining, prefix, kmask, n_in = _advance(
                    _merge_hist(ckey_ptr, ccnt_ptr, row, base, n_chunks, n_flat, kmask, prefix, shift, dmask, M,
                                TILE), shift, dmask, remaining, prefix, kmask)
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
            if REGS:
                key = _rebased(key, valid, lo, up)
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
                  HAS_SS: tl.constexpr, REGS: tl.constexpr):
    row = tl.program_id(0)
    b = row // Hkv
    ss = 0
    if HAS_SS:
        ss = tl.load(ss_ptr + b)
    merge_row(row, tl.load(seqlen_ptr + b), ss, ckey_ptr, cidx_ptr, ccnt_ptr, out_ptr, n_chunks, S, K, SINK,
              RECENT, M, TILE, KP, SP, RP, CP, REGS)


@dataclass
class SelectWorkspace:
    """Buffers of one selection launch shape, allocated once per plan (:func:`select_workspace`).

    chunk : pages per stage-1 program (CH); n_chunks : programs per row; m : winners kept per
        program, ``k`` rounded up to a power of two
    keys, idx : int32 ``[B * Hkv, n_chunks, m]`` (uint32 order keys stored bitcast, page ids);
    count : int32 ``[B * Hkv, n_chunks]``; done : int32 ``[B * Hkv]`` per-row arrival counters of the
    fused kernel (zero between launches); out : int32 ``[B, Hkv, k]``
    short, short_pages : the fused selection's second launch for rows of at most ``short_pages`` full
    pages (its own chunk size and buffers, the same ``out``), or None: one launch for every row
    (:func:`kvlocks.selection.fused.fused_workspace`)
    """

    chunk: int
    n_chunks: int
    m: int
    keys: torch.Tensor
    idx: torch.Tensor
    count: torch.Tensor
    done: torch.Tensor
    out: torch.Tensor
    short: SelectWorkspace | None = None
    short_pages: int = 0


def select_workspace(batch: int, num_kv_heads: int, max_pages: int, k: int, device,
                     chunk: int | None = None) -> SelectWorkspace:
    """Buffers for :func:`select_pages_paged`; ``chunk`` None = :func:`default_chunk`."""
    chunk = default_chunk(max_pages) if chunk is None else chunk
    chunk = min(chunk, max(16, triton.next_power_of_2(max_pages)))
    n_chunks = max(1, -(-max_pages // chunk))
    m = triton.next_power_of_2(max(k, 1))
    rows = batch * num_kv_heads
    i32 = dict(dtype=torch.int32, device=device)
    return SelectWorkspace(chunk=chunk, n_chunks=n_chunks, m=m, keys=torch.empty(rows, n_chunks, m, **i32),
                           idx=torch.empty(rows, n_chunks, m, **i32), count=torch.empty(rows, n_chunks, **i32),
                           done=torch.zeros(rows, **i32), out=torch.empty(batch, num_kv_heads, k, **i32))


def merge_meta(ws: SelectWorkspace, k: int, sink_pages: int, recent_pages: int) -> dict:
    """Compile-time sizes of :func:`merge_row` for a workspace; the merge runs on registers where one
    tile (at most 4096 keys) holds every chunk's winners."""
    m, n_chunks = ws.m, ws.n_chunks
    tile = max(m, min(4096, triton.next_power_of_2(n_chunks * m)))
    return dict(M=m, TILE=tile, KP=triton.next_power_of_2(k),
                SP=triton.next_power_of_2(max(sink_pages, 1)), RP=triton.next_power_of_2(recent_pages),
                CP=triton.next_power_of_2(n_chunks), REGS=n_chunks * m <= tile)


def check_select_args(k: int, sink_pages: int, recent_pages: int) -> None:
    if k < sink_pages + recent_pages or recent_pages < 1 or sink_pages < 0:
        raise ValueError(f"k={k}, sink_pages={sink_pages}, recent_pages={recent_pages}: need k >= sink_pages + "
                         "recent_pages, recent_pages >= 1 and sink_pages >= 0")


def select_pages_paged(ranking: torch.Tensor, seq_lens: torch.Tensor, *, page_size: int, k: int,
                       sink_pages: int = 1, recent_pages: int = 1, sink_start: torch.Tensor | None = None,
                       workspace: SelectWorkspace | None = None) -> torch.Tensor:
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
    rows, n_chunks = bsz * hkv, ws.n_chunks
    ss = sink_start if sink_start is not None else seq_lens
    meta = dict(S=page_size, K=k, SINK=sink_pages, RECENT=recent_pages, HAS_SS=sink_start is not None)
    _chunk_kernel[(n_chunks, rows)](
        ranking, ranking.stride(0), ranking.stride(1), seq_lens, ss, ws.keys, ws.idx, ws.count, hkv,
        n_chunks, CH=ws.chunk, M=ws.m, num_warps=8, **meta,
    )
    _merge_kernel[(rows,)](
        seq_lens, ss, ws.keys, ws.idx, ws.count, ws.out, hkv, n_chunks,
        **merge_meta(ws, k, sink_pages, recent_pages), num_warps=8, **meta,
    )
    return ws.out


def select_top_pages(ranking: torch.Tensor, total_pages: int, k: int, *, page_size: int, sink_pages: int = 1,
                     recent_pages: int = 1, sink_start: torch.Tensor | None = None) -> torch.Tensor:
    """Same as :func:`kvlocks.selection.topk.select_top_pages`: ``[..., Pc]`` -> int64 ``[..., min(k, P)]``.

    The kernels read token counts: each row gets the Pc full pages of ``page_size`` tokens, plus one
    token of a partial page when ``total_pages = Pc + 1``; the pages chosen do not depend on S."""
    pc = ranking.shape[-1]
    if total_pages not in (pc, pc + 1):
        raise ValueError(f"total_pages={total_pages} must be the candidate count {pc} or {pc + 1}")
    lead = ranking.shape[:-1]
    rows = lead.numel()
    x = ranking.float().reshape(rows, 1, pc).contiguous()
    if pc == 0:
        x = torch.zeros(rows, 1, 1, device=ranking.device)
    n = pc * page_size + (total_pages - pc)  # Pc full pages, and one token of a partial page if any
    seq = torch.full((rows,), n, dtype=torch.int32, device=ranking.device)
    ss = None if sink_start is None else sink_start.reshape(-1).to(torch.int32).contiguous()
    out = select_pages_paged(x, seq, page_size=page_size, k=k, sink_pages=sink_pages,
                             recent_pages=recent_pages, sink_start=ss)
    kk = min(k, total_pages)
    return out[:, 0, :kk].long().reshape(*lead, kk)
