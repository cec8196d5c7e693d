"""Page scoring (Eq. 4) and GQA combine (Eq. 5) over the paged summary store, in Triton: the dispatcher.

Two launches per layer and step, grid sizes fixed by the plan (no host sync, graph-capturable):

1. a score kernel, grid ``(chunks, B * Hkv)``: each program reads the int4/int8 summaries of a run
   of pages *once* and scores them for all G query heads of its KV head, then writes the per-head
   page scores and each head's running (max, sum-exp) over its pages. Three kernels, picked by
   :func:`kvlocks.kernels_support.score_kernel` (or ``KernelOptions.score_kernel``): the CUDA
   kernel (:mod:`kvlocks.scoring.cuda_mma`), the packed Triton kernel
   (:mod:`kvlocks.scoring.triton_packed`) or the three-dot Triton kernel here, whose three
   tensor-core dots per step of BLOCK pages are the basis projections of q, the centroid term and
   the per-page contraction with the coefficients as a batched dot, then the length-S log-sum-exp
   in float32. On CUDA the Triton kernels' step size and launch shape are autotuned per shape at
   the first call (before any graph capture);
2. the combine pass (:mod:`kvlocks.scoring.triton_combine`): each head's log-sum-exp over all
   pages, then the combined ranking.

Float32 accumulation throughout; the payloads are small integers, exact in every dot dtype used.
H200 measurements and the analysis of this kernel's speed: ``docs/kernels.md``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvlocks.cache.layout import SummaryStore, dot_dtype
from kvlocks.config import KernelOptions, default_kernel_options
from kvlocks.kernels_support import CUDA_HEAD_DIMS, kernel_support, score_kernel
from kvlocks.scoring import cuda_mma, triton_packed
from kvlocks.scoring.triton_combine import (
    LOG2E, ScoreWorkspace, combine_launch, finish_scores, launch_sizes, row_chunk, store_and_fold,
)

MAX_BLOCK = 32  # pages per inner step at most (pages per program are a multiple of it)


@triton.jit
def _score_mma_kernel(q_ptr, stride_qb, stride_qh, basis_ptr, bscale_ptr, coef_ptr, cscale_ptr, cen_ptr,
                      censcale_ptr, bt_ptr, stride_bt, seqlen_ptr, scores_ptr, stats_ptr,
                      Hkv, G, max_pages, n_chunks, pages_per_prog, qk_scale,
                      GP: tl.constexpr, GB: tl.constexpr, D: tl.constexpr, S: tl.constexpr, R: tl.constexpr,
                      RP: tl.constexpr, BLOCK: tl.constexpr, DOT_DT: tl.constexpr, C_DT: tl.constexpr,
                      PRECISION: tl.constexpr, DH: tl.constexpr):
    """Three tensor-core dots per step of BLOCK pages, q^T loaded once per program.

    1. projections: the basis bytes of BLOCK pages as a ``[BLOCK * RP, D / 2]`` tile (rows past R
       masked to zero, RP = 16), nibbles sign-extended and interleaved back to ``[BLOCK * RP, D]``
       (element 2i = low nibble), times q^T ``[D, GP]``;
    2. centroid term: ``[BLOCK, D]`` int8 times q^T;
    3. per-page contraction with the coefficients as a batched dot
       ``[BLOCK, S, RP] x [BLOCK, RP, GP]`` (int8 coefficients exact in C_DT; for float16 the
       projections are split into two float16 parts, two dots, so no precision is lost), then the
       key scales, the centroid term and the log-sum-exp over the S keys in float32.

    Dots 1 and 2 run over DH = min(D, 128) head dims at a time (two accumulating dots at D = 256),
    so their operand tiles keep D = 128's size: the unpacked basis of 16 pages in float32 (float32
    queries) would be 256 KB at D = 256, over sm_90's 227 KB of shared memory per block.
    """
    tl.static_assert(D == DH or D == 2 * DH, "head dims in one or two chunks of DH")
    pid_c = tl.program_id(0)
    row = tl.program_id(1)  # b * Hkv + h
    b = row // Hkv
    h = row % Hkv
    pc = tl.load(seqlen_ptr + b) // S
    g = tl.arange(0, GP)
    dd = tl.arange(0, DH)
    q_row = q_ptr + b * stride_qb + (h * G + g)[None, :] * stride_qh
    qt = tl.load(q_row + dd[:, None], mask=(g < G)[None, :], other=0.0).to(DOT_DT)  # [DH, GP] dims 0..DH-1
    if D > DH:
        qt2 = tl.load(q_row + DH + dd[:, None], mask=(g < G)[None, :], other=0.0).to(DOT_DT)  # dims DH..D-1
    else:
        qt2 = qt
    m = tl.arange(0, BLOCK * RP)
    mp = m // RP
    mr = m % RP
    jj = tl.arange(0, DH // 2)
    s_idx = tl.arange(0, S)
    r_idx = tl.arange(0, RP)
    pb = tl.arange(0, BLOCK)
    m_run = tl.full([GP], float("-inf"), tl.float32)
    l_run = tl.zeros([GP], tl.float32)
    start, end = row_chunk(pc, pid_c, n_chunks, pages_per_prog, BLOCK)
    btr = bt_ptr + b.to(tl.int64) * stride_bt
    for p0 in range(start, end, BLOCK):
        p = p0 + pb
        pmask = p < end
        ph = tl.load(btr + p, mask=pmask, other=0).to(tl.int64) * Hkv + h  # (page, head) record [BLOCK]
        mmask = ((p0 + mp) < end) & (mr < R)
        ph_m = tl.load(btr + p0 + mp, mask=mmask, other=0).to(tl.int64) * Hkv + h  # [BLOCK * RP]
        by = tl.load(basis_ptr + (ph_m * R + mr)[:, None] * (D // 2) + jj[None, :], mask=mmask[:, None],
                     other=0).to(tl.int32)  # [BLOCK * RP, DH / 2] bytes
        x = tl.interleave((by << 28) >> 28, (by << 24) >> 28).to(tl.float32).to(DOT_DT)  # [BLOCK * RP, DH]
        proj = tl.dot(x, qt, input_precision=PRECISION)  # [BLOCK * RP, GP]
        if D > DH:  # the second half of the head dims
            by = tl.load(basis_ptr + (ph_m * R + mr)[:, None] * (D // 2) + DH // 2 + jj[None, :], mask=mmask[:, None],
                         other=0).to(tl.int32)
            x = tl.interleave((by << 28) >> 28, (by << 24) >> 28).to(tl.float32).to(DOT_DT)
            proj = tl.dot(x, qt2, acc=proj, input_precision=PRECISION)
        bsc = tl.load(bscale_ptr + ph_m * R + mr, mask=mmask, other=0.0).to(tl.float32)
        proj = tl.reshape(proj * bsc[:, None], (BLOCK, RP, GP))
        cen = tl.load(cen_ptr + ph[:, None] * D + dd[None, :], mask=pmask[:, None], other=0).to(tl.float32)
        qmu = tl.dot(cen.to(DOT_DT), qt, input_precision=PRECISION)  # [BLOCK, GP]
        if D > DH:
            cen = tl.load(cen_ptr + ph[:, None] * D + DH + dd[None, :], mask=pmask[:, None], other=0).to(tl.float32)
            qmu = tl.dot(cen.to(DOT_DT), qt2, acc=qmu, input_precision=PRECISION)
        qmu = qmu * tl.load(censcale_ptr + ph, mask=pmask, other=0.0).to(tl.float32)[:, None]
        c = tl.load(coef_ptr + ph[:, None, None] * (S * R) + s_idx[None, :, None] * R + r_idx[None, None, :],
                    mask=pmask[:, None, None] & (r_idx < R)[None, None, :], other=0).to(tl.float32).to(C_DT)
        if C_DT == tl.float16:  # proj as an exact-to-~2^-22 sum of two float16 parts: float32 accuracy
            hi = proj.to(tl.float16)
            acc = tl.dot(c, hi)
            acc = tl.dot(c, (proj - hi.to(tl.float32)).to(tl.float16), acc=acc)  # [BLOCK, S, GP]
        else:
            acc = tl.dot(c, proj, input_precision=PRECISION)
        cs = tl.load(cscale_ptr + ph[:, None] * S + s_idx[None, :], mask=pmask[:, None], other=0.0).to(tl.float32)
        logit = (acc * cs[:, :, None] + qmu[:, None, :]) * qk_scale  # log2 units
        mx = tl.max(logit, axis=1)
        lse2 = mx + tl.log2(tl.sum(tl.exp2(logit - mx[:, None, :]), axis=1))  # [BLOCK, GP]
        m_run, l_run = store_and_fold(lse2, p, pmask, g, row, G, max_pages, scores_ptr, m_run, l_run)
    st = stats_ptr + ((row * n_chunks + pid_c) * 2) * GB + g
    tl.store(st, m_run, mask=g < GB)
    tl.store(st + GB, l_run, mask=g < GB)


# On CUDA the step size and launch shape are tuned once per (shape, pages per program), at the first
# call (the decode plan's warm-up, before any graph capture); ``launch=`` pins one instead.
_MMA_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w, num_stages=st)
                for b in (16, 32) for w in (4, 8) for st in (1, 2, 3)]
_score_mma_tuned = triton.autotune(_MMA_CONFIGS, key=["Hkv", "G", "D", "R", "pages_per_prog"])(_score_mma_kernel)
# head_dim 256: 16 pages per step only, the operand tiles of D = 128's BLOCK 16 (the kernel's dots
# take 128 head dims at a time; 16 is tl.dot's smallest M). sm_90 cubins (Triton 3.9, bfloat16
# queries) spill 80 B per thread at 8 warps and 1 KB at 4 (D = 128, BLOCK 16: 0 and 72 B; BLOCK 32,
# which the D = 128 tuner may pick: 296 B and 1.2 KB); float32 queries 9-12 KB at D = 256.
_MMA_CONFIGS_256 = [triton.Config({"BLOCK": 16}, num_warps=w, num_stages=st) for w in (4, 8) for st in (1, 2)]
_score_mma_tuned_256 = triton.autotune(_MMA_CONFIGS_256, key=["Hkv", "G", "D", "R", "pages_per_prog"])(
    _score_mma_kernel)


def tuned_launch(head_dim: int = 128):
    """The launch configuration the score autotuner of ``head_dim`` chose last (None before a
    tuned CUDA call at that head_dim)."""
    return getattr(_score_mma_tuned_256 if head_dim > 128 else _score_mma_tuned, "best_config", None)


def score_workspace(batch: int, num_kv_heads: int, group: int, max_pages: int, device,
                    pages_per_program: int | None = None, head_dim: int = 128,
                    split_batch: int | None = None) -> ScoreWorkspace:
    """Buffers for :func:`score_pages_paged`, allocated once per plan. Pages per program: sized
    for the CUDA kernel where it runs (``head_dim`` in ``CUDA_HEAD_DIMS`` and compiled: a multiple of
    every kernel's step), else for Triton's, to fill the GPU with ``split_batch`` rows (default
    ``batch``; the per-head log-sum-exp is summed over the programs of a row, so a fixed value
    makes it independent of the batch)."""
    device = torch.device(device)
    ppp, rows = pages_per_program, (split_batch or batch) * num_kv_heads
    if ppp is None and device.type == "cuda" and head_dim in CUDA_HEAD_DIMS and cuda_mma.available(device):
        ppp = cuda_mma.pages_per_program(max_pages, rows, device, head_dim, group)
    ppp = ppp or launch_sizes(max_pages, rows, device, MAX_BLOCK)
    return ScoreWorkspace.allocate(batch, num_kv_heads, group, max_pages, device, ppp)


def score_pages_paged(queries: torch.Tensor, summaries: SummaryStore, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, *, scale: float | None = None, combine: str = "mean_share",
                      workspace: ScoreWorkspace | None = None, rank: bool = True,
                      options: KernelOptions | None = None,
                      launch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 4 page scores, per-head log-sum-exp and the combined ranking, for every full page.

    Parameters
    ----------
    queries : ``[B, Hq, D]`` float32/bfloat16/float16, Hq = Hkv * G (head ``h * G + g``)
    summaries : :class:`SummaryStore` indexed by physical page id
    block_table : int32 ``[B, max_pages]``; seq_lens : int32 ``[B]`` (tokens per sequence)
    workspace : from :func:`score_workspace` (allocated here when omitted)
    options : KernelOptions (None: the defaults): ``score_kernel`` picks the kernel (``"auto"``:
        :func:`kvlocks.kernels_support.score_kernel`), ``pdl`` the CUDA kernel's launch
    launch : a fixed ``BLOCK`` / ``num_warps`` / ``num_stages`` for the Triton kernels instead of
        the autotuned one (the CPU interpreter's default: ``{"BLOCK": 16}``)

    Returns
    -------
    scores : float32 ``[B, Hkv, G, max_pages]``, natural-log page masses (Eq. 4)
    lse : float32 ``[B, Hkv, G]``, each head's log-sum-exp over its full pages
    ranking : float32 ``[B, Hkv, max_pages]``, the combined score (higher is better)
    Entries at page ``p >= seq_lens[b] // S`` are not written. With ``rank=False`` the combine pass
    is skipped and lse and ranking are None (:func:`kvlocks.selection.fused.rank_and_select` does
    it, fused with the selection).
    """
    options = options or default_kernel_options()
    bsz, hq, d = queries.shape
    hkv, s, r = summaries.num_kv_heads, summaries.page_size, summaries.rank
    why = kernel_support(page_size=s, rank=r, head_dim=d)
    if why is not None:
        raise ValueError(f"score_pages_paged: {why}")
    g = hq // hkv
    max_pages = block_table.shape[1]
    ws = workspace or score_workspace(bsz, hkv, g, max_pages, queries.device, head_dim=d)
    which = score_kernel(queries, g, r, ws.ppp, choice=options.score_kernel,
                         cuda_library=lambda: cuda_mma.available(queries.device))
    if which == "cuda":
        return cuda_mma.score_pages_mma(queries, summaries, block_table, seq_lens, scale=scale, combine=combine,
                                        workspace=ws, rank=rank, pdl=options.pdl)
    if which == "packed":
        return triton_packed.score_pages_packed(queries, summaries, block_table, seq_lens, scale=scale,
                                                combine=combine, launch=launch, workspace=ws, rank=rank)
    gb = ws.stats.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    fixed = launch or ({} if queries.is_cuda else {"BLOCK": 16})
    tuned = _score_mma_tuned_256 if d > 128 else _score_mma_tuned
    kernel = tuned if queries.is_cuda and not launch else _score_mma_kernel
    kw = dict(RP=max(16, triton.next_power_of_2(r)), DOT_DT=dot_dtype(queries.dtype),
              C_DT=tl.float32 if queries.dtype == torch.float32 else tl.float16,
              PRECISION="ieee" if queries.dtype == torch.float32 else "tf32")
    kernel[(ws.n_chunks, bsz * hkv)](
        queries, queries.stride(0), queries.stride(1), summaries.basis, summaries.basis_scale, summaries.coef,
        summaries.coef_scale, summaries.centroid, summaries.centroid_scale, block_table, block_table.stride(0),
        seq_lens, ws.scores, ws.stats, hkv, g, max_pages, ws.n_chunks, ws.ppp, scale * LOG2E,
        GP=max(16, gb), GB=gb, D=d, S=s, R=r, DH=min(d, 128), **kw, **fixed,
    )
    return finish_scores(ws, seq_lens, hkv, g, max_pages, s, combine, rank)


# ---- adapters with the reference signatures (token-major / reference layouts) ----

def score_pages_from_summaries(queries, summaries, *, scale=None, token_mask=None):
    """Same as :func:`kvlocks.scoring.reference.score_pages_from_summaries` (int4/int8 summaries).

    queries ``[..., G, D]``, summaries with leading dims ``...`` -> float32 ``[..., G, P]``.
    ``token_mask`` is not supported by the kernel (the paged layout has no padding).
    """
    if token_mask is not None:
        raise NotImplementedError("token_mask: use the torch backend (the paged layout has no padding)")
    lead, (g, d), p = queries.shape[:-2], queries.shape[-2:], summaries.num_pages
    q = queries.reshape(-1, g, d)
    n_rows = q.shape[0]
    store, table = _store_from_reference(summaries, n_rows)
    seq = torch.full((n_rows,), p * summaries.page_size, dtype=torch.int32, device=q.device)
    scores, _, _ = score_pages_paged(q, store, table, seq, scale=scale)
    return scores[:, 0].reshape(*lead, g, p)


def combine_group(page_scores: torch.Tensor, rule: str) -> torch.Tensor:
    """Same as :func:`kvlocks.scoring.reference.combine_group`: ``[..., G, P]`` -> ``[..., P]``."""
    lead, (g, p) = page_scores.shape[:-2], page_scores.shape[-2:]
    x = page_scores.float().reshape(-1, 1, g, p).contiguous()
    rows = x.shape[0]
    gb = triton.next_power_of_2(g)
    stats = torch.zeros(rows, p, 2, gb, device=x.device)  # one "program" per page: (score, 1)
    stats[:, :, 0, :] = float("-inf")
    stats[:, :, 0, :g] = x[:, 0].transpose(1, 2) * LOG2E
    stats[:, :, 1, :g] = 1.0
    ws = ScoreWorkspace(ppp=1, n_chunks=p, ppp2=256, scores=x, stats=stats,
                        lse=torch.empty(rows, 1, g, device=x.device), ranking=torch.empty(rows, 1, p, device=x.device))
    seq = torch.full((rows,), p, dtype=torch.int32, device=x.device)
    combine_launch(ws, seq, 1, g, p, 1, rule)
    return ws.ranking.reshape(*lead, p)


def _store_from_reference(summaries, n_rows: int) -> tuple[SummaryStore, torch.Tensor]:
    """Reference summaries ``[..., P]`` -> a store of ``n_rows * P`` pages with Hkv = 1."""
    p = summaries.num_pages

    def flat(t, tail):  # [..., P, *tail] -> [n_rows * P, 1, *tail]
        return t.reshape(n_rows * p, 1, *tail).contiguous()

    s, r, d = summaries.page_size, summaries.rank, summaries.head_dim
    store = SummaryStore(
        basis=flat(summaries.basis, (r, d // 2)), basis_scale=flat(summaries.basis_scale, (r,)),
        coef=flat(summaries.coef, (s, r)), coef_scale=flat(summaries.coef_scale, (s,)),
        centroid=flat(summaries.centroid, (d,)), centroid_scale=flat(summaries.centroid_scale, ()),
    )
    table = torch.arange(n_rows * p, dtype=torch.int32, device=summaries.coef.device).view(n_rows, p)
    return store, table
