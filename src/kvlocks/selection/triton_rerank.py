"""The exact re-rank of the two-stage selection (:mod:`kvlocks.selection.rerank`) in two Triton
launches, after the fused selection has picked ``k' = M + sink + recent`` candidate pages per
(sequence, KV head):

1. ``_exact_kernel``, grid ``(ceil(k' / PB), B * Hkv)``: each program takes PB candidates, gathers
   their keys through the block table (``PB * S`` keys of its KV head), computes the G query heads'
   logits with one ``tl.dot`` and each page's exact log-sum-exp per head in float32; it also reads
   the page's summary estimate. Both go to the workspace ``[B * Hkv, G, k']``.
2. ``_pick_kernel``, grid ``(B * Hkv,)``: the GQA combine with the per-head normalisers rebuilt
   from the score pass's log-sum-exp (the candidates' estimates taken out, their exact masses put
   in), the forced pages first, then the top ``k`` by that combined mass, ties to the lower page,
   in ascending page order. Default (``pick="radix"``): the radix threshold of the selection
   kernels (:func:`kvlocks.selection.triton_radix.top_positions`) over the candidates, which are
   already in page order, then a prefix-sum compaction: no sort. ``pick="sort"``: one ``tl.sort``
   of 64-bit keys (order-preserving bits of the priority, then the candidate's position), a
   second of the chosen page ids; kept to time the two side by side (``kvlocks bench kernels``).

Same pages as the full-width PyTorch re-rank (:func:`kvlocks.selection.rerank_paged.paged_rerank`,
then :func:`kvlocks.plan.paged_select`), up to float rounding of the exact masses and the order of
exactly tied masses: the combine's normalisers over all pages follow from the score pass's per-head
log-sum-exp. Fixed grids, no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvlocks.cache.layout import dot_dtype
from kvlocks.config import KernelOptions, LocksConfig, default_kernel_options
from kvlocks.pdl import enabled as pdl_enabled
from kvlocks.selection.triton_radix import _orderkey, top_positions

LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)
RULES = {"mean_share": 0, "max_share": 1, "sum_mass": 2}
PAGES_PER_PROGRAM = 8  # PB: candidates per exact-LSE program (8 x 16 keys per tl.dot)
PICKS = ("radix", "sort")


@triton.jit
def _exact_kernel(q_ptr, stride_qb, stride_qh, k_ptr, stride_kp, stride_ks, stride_kh, bt_ptr, stride_bt,
                  seqlen_ptr, cand_ptr, scores_ptr, exact_ptr, est_ptr, Hkv, G, max_pages, KC, qk_scale,
                  GP: tl.constexpr, D: tl.constexpr, S: tl.constexpr, PB: tl.constexpr, DOT_DT: tl.constexpr,
                  PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched early (kvlocks.pdl): wait for the selection, then let the pick launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(1)
    b = row // Hkv
    h = row % Hkv
    pc = tl.load(seqlen_ptr + b) // S
    j = tl.program_id(0) * PB + tl.arange(0, PB)  # [PB] candidate slots
    jm = j < KC
    page = tl.load(cand_ptr + row.to(tl.int64) * KC + j, mask=jm, other=-1)
    used = jm & (page >= 0) & (page < pc)  # full pages only (the partial last page has no summary)
    t = tl.arange(0, PB * S)  # [PB * S] keys of the program's pages
    jt = tl.program_id(0) * PB + t // S
    page_t = tl.load(cand_ptr + row.to(tl.int64) * KC + jt, mask=jt < KC, other=-1)
    used_t = (jt < KC) & (page_t >= 0) & (page_t < pc)
    btr = bt_ptr + b.to(tl.int64) * stride_bt
    phys_t = tl.load(btr + tl.where(used_t, page_t, 0), mask=used_t, other=0).to(tl.int64)
    dd = tl.arange(0, D)
    keys = tl.load(k_ptr + phys_t[:, None] * stride_kp + (t % S)[:, None] * stride_ks + h * stride_kh + dd[None, :],
                   mask=used_t[:, None], other=0.0).to(DOT_DT)  # [PB * S, D]
    g = tl.arange(0, GP)
    gm = g < G
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (h * G + g)[:, None] * stride_qh + dd[None, :],
                mask=gm[:, None], other=0.0).to(DOT_DT)  # [GP, D]
    logit = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * qk_scale  # [GP, PB * S], log2 units
    l3 = tl.reshape(logit, (GP, PB, S))
    mx = tl.max(l3, axis=2)
    exact = (mx + tl.log2(tl.sum(tl.exp2(l3 - mx[:, :, None]), axis=2))) * _LN2  # [GP, PB] natural log
    keep = gm[:, None] & used[None, :]
    exact = tl.where(keep, exact, float("-inf"))
    at = tl.where(used, page, 0)
    est = tl.load(scores_ptr + (row.to(tl.int64) * G + g)[:, None] * max_pages + at[None, :], mask=keep,
                  other=float("-inf"))
    dst = (row.to(tl.int64) * G + g)[:, None] * KC + j[None, :]
    tl.store(exact_ptr + dst, exact, mask=gm[:, None] & jm[None, :])
    tl.store(est_ptr + dst, est, mask=gm[:, None] & jm[None, :])


@triton.jit
def _pick_kernel(seqlen_ptr, cand_ptr, exact_ptr, est_ptr, lse_ptr, out_ptr, Hkv, G, KC, S: tl.constexpr,
                 K: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, GP: tl.constexpr, KP: tl.constexpr,
                 RULE: tl.constexpr, RADIX: tl.constexpr = True, PDL: tl.constexpr = False):
    if PDL:  # launched early: wait for the exact masses, then let the attention launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    b = row // Hkv
    n = tl.load(seqlen_ptr + b)
    pc = n // S
    total = (n + S - 1) // S
    j = tl.arange(0, KP)
    jm = j < KC
    page = tl.load(cand_ptr + row.to(tl.int64) * KC + j, mask=jm, other=-1)
    valid = jm & (page >= 0)
    used = valid & (page < pc)
    forced = valid & ((page >= total - RECENT) | (page < SINK))
    g = tl.arange(0, GP)
    gm = g < G
    src = (row.to(tl.int64) * G + g)[:, None] * KC + j[None, :]
    m2 = gm[:, None] & jm[None, :]
    ex = tl.load(exact_ptr + src, mask=m2, other=float("-inf"))  # [GP, KP]
    if RULE == 2:  # sum_mass: the log of the summed exact masses over the heads
        top = tl.max(ex, axis=0)
        safe = tl.where(top > float("-inf"), top, 0.0)
        tot = tl.sum(tl.exp(ex - safe[None, :]), axis=0)  # >= 1 where any head has a mass
        combined = tl.where(top > float("-inf"), safe + tl.log(tl.maximum(tot, 1e-30)), float("-inf"))
    else:  # per-head shares against the normaliser with the candidates' estimates replaced
        es = tl.load(est_ptr + src, mask=m2, other=float("-inf"))
        lse = tl.load(lse_ptr + row * G + g, mask=gm, other=float("-inf"))
        top = tl.maximum(lse, tl.max(ex, axis=1))  # [GP]
        top = tl.where((top > float("-inf")) & (top < float("inf")), top, 0.0)
        new = tl.sum(tl.exp(ex - top[:, None]), axis=1)
        rest = tl.maximum(tl.exp(lse - top) - tl.sum(tl.exp(es - top[:, None]), axis=1), 0.0)
        den = rest + new
        ok = gm & (den > 0.0)
        share = tl.where(ok[:, None], tl.exp(ex - top[:, None]) / tl.where(ok, den, 1.0)[:, None], 0.0)
        if RULE == 0:
            combined = tl.sum(share, axis=0) / G
        else:
            combined = tl.max(share, axis=0)
    prio = tl.where(forced, float("inf"), tl.where(used, combined, float("-inf")))
    if RADIX:  # the K largest priorities of the valid slots, ties to the lower slot, kept in slot (= page) order
        sel, pos = top_positions(_orderkey(prio), valid, tl.minimum(K, tl.sum(valid.to(tl.int32), axis=0)))
        dst = out_ptr + row.to(tl.int64) * K
        tl.store(dst + pos, page, mask=sel)
        tl.store(dst + j, -1, mask=(j >= tl.sum(sel.to(tl.int32), axis=0)) & (j < K))
    else:
        _pick_by_sort(prio, j, cand_ptr + row.to(tl.int64) * KC, out_ptr + row.to(tl.int64) * K, KC, K)


@triton.jit
def _pick_by_sort(prio, j, cand_row, out_row, KC, K: tl.constexpr):
    """The top ``K`` slots by priority (ties to the lower slot) in ascending page order, by two sorts."""
    # 64-bit keys: the priority's order-preserving bits (shifted to signed), then 2^32 - 1 - j so that
    # equal priorities rank the earlier candidate (the lower page: candidates are ascending) first
    low = 4294967295 - j.to(tl.int64)
    key = ((_orderkey(prio).to(tl.int64) - 2147483648) << 32) | low
    ranked = tl.sort(key, descending=True)
    slot = (4294967295 - (ranked & 4294967295)).to(tl.int32)  # candidate position of each rank
    chosen_page = tl.load(cand_row + slot, mask=slot < KC, other=-1)
    big = 2147483647
    ids = tl.where((j < K) & (chosen_page >= 0), chosen_page, big)
    ids = tl.sort(ids)
    tl.store(out_row + j, tl.where(ids < big, ids, -1), mask=j < K)


@dataclass
class RerankWorkspace:
    """Buffers of the exact re-rank for one plan: ``exact`` and ``est`` float32 ``[B * Hkv, G, k']``,
    ``out`` int32 ``[B, Hkv, k]`` (the selected pages)."""

    exact: torch.Tensor
    est: torch.Tensor
    out: torch.Tensor


def rerank_workspace(batch: int, num_kv_heads: int, group: int, k_cand: int, k: int, device) -> RerankWorkspace:
    f32 = dict(dtype=torch.float32, device=device)
    rows = batch * num_kv_heads
    return RerankWorkspace(exact=torch.empty(rows, group, k_cand, **f32), est=torch.empty(rows, group, k_cand, **f32),
                           out=torch.empty(batch, num_kv_heads, k, dtype=torch.int32, device=device))


def rerank_pages(queries: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 scores: torch.Tensor, lse: torch.Tensor, cand: torch.Tensor, config: LocksConfig, *, scale: float,
                 workspace: RerankWorkspace | None = None, options: KernelOptions | None = None,
                 pick: str = "radix") -> torch.Tensor:
    """The final pages from the fused selection's ``k'`` candidates, in two launches
    (:func:`exact_masses`, then :func:`pick_pages`).

    queries ``[B, Hq, D]``; k_cache ``[NB, S, Hkv, D]``; block_table int32 ``[B, W]``; seq_lens int32
    ``[B]``; scores float32 ``[B, Hkv, G, W]`` and lse ``[B, Hkv, G]`` (the score pass and the fused
    selection's outputs); cand int32 ``[B, Hkv, k']`` ascending, -1 padded -> int32 ``[B, Hkv, k]``
    ascending, -1 padded (the workspace's buffer). ``pick``: one of :data:`PICKS`.
    """
    bsz, hq, _ = queries.shape
    hkv = k_cache.shape[2]
    if config.combine not in RULES:
        raise ValueError(f"combine={config.combine!r}: allowed {tuple(RULES)}")
    if pick not in PICKS:
        raise ValueError(f"pick={pick!r}: allowed {PICKS}")
    if cand.dtype != torch.int32 or not cand.is_contiguous() or cand.shape[:2] != (bsz, hkv):
        raise ValueError(f"cand must be contiguous int32 [{bsz}, {hkv}, k'], got {cand.dtype} {tuple(cand.shape)}")
    if k_cache.stride(-1) != 1 or queries.stride(-1) != 1:
        raise ValueError("k_cache and queries need a contiguous last dim")
    g, k, kc = hq // hkv, config.pages_per_step, cand.shape[-1]
    ws = workspace or rerank_workspace(bsz, hkv, g, kc, k, queries.device)
    if ws.exact.shape != (bsz * hkv, g, kc) or ws.out.shape != (bsz, hkv, k):
        raise ValueError(f"workspace is for {tuple(ws.exact.shape)} / {tuple(ws.out.shape)}, not "
                         f"{(bsz * hkv, g, kc)} / {(bsz, hkv, k)}")
    exact_masses(queries, k_cache, block_table, seq_lens, scores, cand, ws, scale=scale, options=options)
    return pick_pages(seq_lens, lse, cand, config, ws, group=g, options=options, pick=pick)


def _pdl(device, options) -> dict:
    return {"launch_pdl": True} if pdl_enabled(device, (options or default_kernel_options()).pdl) else {}


def exact_masses(queries, k_cache, block_table, seq_lens, scores, cand, ws: RerankWorkspace, *, scale: float,
                 options: KernelOptions | None = None) -> None:
    """Launch 1 (arguments checked by :func:`rerank_pages`): each candidate's exact per-head
    log-sum-exp into ``ws.exact``, its score-pass estimate into ``ws.est``."""
    bsz, hq, d = queries.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    g, kc = hq // hkv, cand.shape[-1]
    extra = _pdl(queries.device, options)
    _exact_kernel[(triton.cdiv(kc, PAGES_PER_PROGRAM), bsz * hkv)](
        queries, queries.stride(0), queries.stride(1), k_cache, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_table, block_table.stride(0), seq_lens, cand, scores, ws.exact, ws.est, hkv, g,
        scores.shape[-1], kc, scale * LOG2E, GP=max(16, triton.next_power_of_2(g)), D=d, S=s, PB=PAGES_PER_PROGRAM,
        DOT_DT=dot_dtype(k_cache.dtype), PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        PDL=bool(extra), num_warps=4 if d <= 128 else 8, **extra)  # D = 256: 8 warps keep the gathered
    # keys [PB * S, D] at D = 128's 128 values per thread (the dot's operand tile; 64 KB staged at 256)


def pick_pages(seq_lens, lse, cand, config: LocksConfig, ws: RerankWorkspace, *, group: int,
               options: KernelOptions | None = None, pick: str = "radix") -> torch.Tensor:
    """Launch 2 (arguments checked by :func:`rerank_pages`): the combine over ``ws.exact`` and the
    top ``k`` into ``ws.out``."""
    bsz, hkv, kc = cand.shape
    k = config.pages_per_step
    extra = _pdl(cand.device, options)
    _pick_kernel[(bsz * hkv,)](
        seq_lens, cand, ws.exact, ws.est, lse, ws.out, hkv, group, kc, S=config.page_size, K=k,
        SINK=config.sink_pages, RECENT=config.recent_pages, GP=triton.next_power_of_2(group),
        KP=triton.next_power_of_2(max(kc, k, 2)), RULE=RULES[config.combine], RADIX=pick == "radix",
        PDL=bool(extra), num_warps=8, **extra)
    return ws.out
