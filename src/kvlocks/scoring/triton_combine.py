"""What the three score kernels share: their outputs (:class:`ScoreWorkspace`), the per-program fold
of page scores, and the combine pass that turns them into the ranking (Eq. 5).

Every score kernel (``scoring/score_mma.cu`` through :mod:`kvlocks.scoring.cuda_mma`,
:mod:`kvlocks.scoring.triton_packed`, the three-dot kernel of :mod:`kvlocks.scoring.triton`) writes
the per-head page scores and, per program, each head's running (max, sum of exp2) over its pages.
``_combine_kernel``, grid ``(chunks2, B * Hkv)``, reduces those statistics to each head's
log-sum-exp over all pages, then turns the per-head scores into the combined ranking
(``mean_share`` Eq. 5, ``max_share`` or ``sum_mass``); the fused selection
(:mod:`kvlocks.selection.fused`) does the same inside its own launch instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# kernels may read module globals only when they are constexpr
_LN2 = tl.constexpr(LN2)
_LOG2E = tl.constexpr(LOG2E)
RULES = {"mean_share": 0, "max_share": 1, "sum_mass": 2}
COMBINE_BLOCK = 256  # pages per step of the combine kernel


@dataclass
class ScoreWorkspace:
    """Buffers of one score pass, allocated once per plan (:meth:`allocate`).

    ppp : pages per score program (a multiple of every kernel's step); n_chunks : score programs
        per row, ``ceil(max_pages / ppp)``; ppp2 : pages per combine program
    scores : float32 ``[B, Hkv, G, max_pages]``; stats : float32 ``[B * Hkv, n_chunks, 2, GB]``
        (per program and head: max and sum of exp2 of its pages' scores, log2 units; GB = G rounded
        up to a power of two); lse : float32 ``[B, Hkv, G]``; ranking : float32 ``[B, Hkv, max_pages]``
    """

    ppp: int
    n_chunks: int
    ppp2: int
    scores: torch.Tensor
    stats: torch.Tensor
    lse: torch.Tensor
    ranking: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, num_kv_heads: int, group: int, max_pages: int, device,
                 pages_per_program: int) -> "ScoreWorkspace":
        device = torch.device(device)
        rows = batch * num_kv_heads
        n_chunks = max(1, -(-max_pages // pages_per_program))
        gb = triton.next_power_of_2(group)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(ppp=pages_per_program, n_chunks=n_chunks, ppp2=launch_sizes(max_pages, rows, device, COMBINE_BLOCK),
                   scores=torch.empty(batch, num_kv_heads, group, max_pages, **f32),
                   stats=torch.empty(rows, n_chunks, 2, gb, **f32), lse=torch.empty(batch, num_kv_heads, group, **f32),
                   ranking=torch.empty(batch, num_kv_heads, max_pages, **f32))


def launch_sizes(total_pages: int, rows: int, device: torch.device, block: int) -> int:
    """Pages per program: enough programs to fill the GPU, at least one block each."""
    target = 8 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    per_row = max(1, target // max(rows, 1))
    ppp = -(-total_pages // per_row)
    return max(block, -(-ppp // block) * block)


@triton.jit
def row_chunk(pc, pid_c, n_chunks, pages_per_prog, STEP: tl.constexpr):
    """Pages ``[start, end)`` of score program ``pid_c`` for a row of ``pc`` full pages: the row's
    pages spread over all ``n_chunks`` programs in multiples of ``STEP``, at most ``pages_per_prog``
    each (a plan is sized by its longest row; a shorter row still keeps every program busy)."""
    per = tl.cdiv(tl.cdiv(pc, n_chunks), STEP) * STEP
    per = tl.minimum(tl.maximum(per, STEP), pages_per_prog)
    start = pid_c * per
    return start, tl.minimum(start + per, pc)


@triton.jit
def store_and_fold(lse2, p, pmask, g, row, G, max_pages, scores_ptr, m_run, l_run):
    """Store a step's page scores (log2 units in, natural log out) and fold them into each head's
    running (max, sum of exp2) over the program's pages. Shared by the Triton score kernels."""
    out_off = (row * G + g)[None, :].to(tl.int64) * max_pages + p[:, None]
    tl.store(scores_ptr + out_off, lse2 * _LN2, mask=pmask[:, None] & (g < G)[None, :])
    lse2 = tl.where(pmask[:, None], lse2, float("-inf"))
    m_new = tl.maximum(m_run, tl.max(lse2, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_run = l_run * tl.exp2(m_run - m_safe) + tl.sum(tl.exp2(lse2 - m_safe[None, :]), axis=0)
    return m_new, l_run


@triton.jit
def row_lse2(stats_ptr, row, n_chunks, GP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each head's log2-sum-exp over all pages of ``row`` (``[GP]``, -inf where a head has no page)
    from the score programs' per-program (max, sum) pairs ``stats [rows, n_chunks, 2, GP]``. Every
    consumer program redoes this reduction, so it takes up to BLOCK_K (256) score programs per load
    instead of a loop of 16-row loads (~17 serial iterations at 1M tokens)."""
    g = tl.arange(0, GP)
    m_all = tl.full([GP], float("-inf"), tl.float32)
    l_all = tl.zeros([GP], tl.float32)
    for c0 in range(0, n_chunks, BLOCK_K):
        c = c0 + tl.arange(0, BLOCK_K)
        base = stats_ptr + ((row * n_chunks + c) * 2)[:, None] * GP + g[None, :]
        m = tl.load(base, mask=(c < n_chunks)[:, None], other=float("-inf"))  # [BLOCK_K, GP]
        ll = tl.load(base + GP, mask=(c < n_chunks)[:, None], other=0.0)
        m_new = tl.maximum(m_all, tl.max(m, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_all = l_all * tl.exp2(m_all - m_safe) + tl.sum(ll * tl.exp2(m - m_safe[None, :]), axis=0)
        m_all = m_new
    has = l_all > 0.0
    return tl.where(has, m_all + tl.log2(tl.where(has, l_all, 1.0)), float("-inf"))


@triton.jit
def _combine_kernel(scores_ptr, stats_ptr, seqlen_ptr, ranking_ptr, lse_ptr, Hkv, G, max_pages, n_chunks,
                    pages_per_prog, S: tl.constexpr, GP: tl.constexpr, RULE: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // Hkv
    pc = tl.load(seqlen_ptr + b) // S
    g = tl.arange(0, GP)
    gmask = g < G
    lse2 = row_lse2(stats_ptr, row, n_chunks, GP, BLOCK_K)
    has = lse2 > float("-inf")
    if pid_c == 0:
        tl.store(lse_ptr + row * G + g, lse2 * _LN2, mask=gmask)
    start = pid_c * pages_per_prog
    end = tl.minimum(start + pages_per_prog, pc)
    for p0 in range(start, end, BLOCK_C):
        p = p0 + tl.arange(0, BLOCK_C)
        pmask = p < end
        s2 = tl.load(scores_ptr + (row * G + g)[:, None].to(tl.int64) * max_pages + p[None, :],
                     mask=gmask[:, None] & pmask[None, :], other=-1e30) * _LOG2E  # [GP, BLOCK_C]
        if RULE == 2:  # sum_mass: logsumexp over the group (pages past pc are masked at the store)
            mx = tl.max(tl.where(gmask[:, None], s2, -1e31), axis=0)
            tot = tl.sum(tl.where(gmask[:, None], tl.exp2(s2 - mx[None, :]), 0.0), axis=0)
            rank = (mx + tl.log2(tot)) * _LN2
        else:
            share = tl.where(has[:, None], tl.exp2(s2 - tl.where(has, lse2, 0.0)[:, None]), 0.0)
            if RULE == 0:
                rank = tl.sum(share, axis=0) / G
            else:
                rank = tl.max(share, axis=0)
        tl.store(ranking_ptr + row.to(tl.int64) * max_pages + p, rank, mask=pmask)


def check_rule(combine: str) -> None:
    if combine not in RULES:
        raise ValueError(f"combine rule {combine!r}: allowed {tuple(RULES)}")


def stats_block(ws: ScoreWorkspace) -> int:
    """Score programs' statistics reduced per load by :func:`row_lse2`."""
    return max(16, min(256, triton.next_power_of_2(ws.n_chunks)))


def combine_launch(ws: ScoreWorkspace, seq_lens, hkv, g, max_pages, s, combine) -> None:
    """The combine pass: ``ws.lse`` and ``ws.ranking`` from ``ws.scores`` and ``ws.stats``."""
    check_rule(combine)
    rows = ws.stats.shape[0]
    n2 = max(1, -(-max_pages // ws.ppp2))
    _combine_kernel[(n2, rows)](
        ws.scores, ws.stats, seq_lens, ws.ranking, ws.lse, hkv, g, max_pages, ws.n_chunks, ws.ppp2, S=s,
        GP=ws.stats.shape[-1], RULE=RULES[combine], BLOCK_C=COMBINE_BLOCK, BLOCK_K=stats_block(ws), num_warps=4,
    )


def finish_scores(ws: ScoreWorkspace, seq_lens, hkv, g, max_pages, s, combine, rank=True):
    """The score functions' last step: the combine pass (per-head LSE and ranking) unless ``rank`` is
    False, where a fused consumer (:func:`kvlocks.selection.fused.rank_and_select`) does it.
    Returns (scores, lse, ranking); lse and ranking None with ``rank=False``."""
    if not rank:
        check_rule(combine)
        return ws.scores, None, None
    combine_launch(ws, seq_lens, hkv, g, max_pages, s, combine)
    return ws.scores, ws.lse, ws.ranking
