"""Fused page scoring (Eq. 4) and GQA combine (Eq. 5) over the paged summary store, in Triton.

Two launches per layer and step, grid sizes fixed by the plan (no host sync, graph-capturable):

1. the score kernel, grid ``(chunks, B * Hkv)``: each program reads the int4/int8 summaries of a
   run of pages *once* and scores them for all G query heads of its KV head, BLOCK pages per
   step, with three tensor-core dots per step (basis projections of q, the centroid term, and the
   per-page contraction with the coefficients as a batched dot), then the length-S log-sum-exp in
   float32. It writes the per-head page scores and, per program, each head's running
   (max, sum-exp) over its pages: what the share normalisation needs. On CUDA the step size and
   launch shape are autotuned per shape at the first call (before any graph capture).
2. ``_combine_kernel``, grid ``(chunks2, B * Hkv)``: reduces the per-program statistics to each
   head's log-sum-exp over all pages, then turns the per-head scores into the combined ranking
   (``mean_share`` Eq. 5, ``max_share`` or ``sum_mass``).

Float32 accumulation throughout; the payloads are small integers, exact in every dot dtype used.
H200 measurements and the analysis of this kernel's speed: ``docs/kernels.md``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kvlocks.cache.layout import PagedSummaries, dot_dtype

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# kernels may read module globals only when they are constexpr
_LN2 = tl.constexpr(LN2)
_LOG2E = tl.constexpr(LOG2E)
RULES = {"mean_share": 0, "max_share": 1, "sum_mass": 2}
MAX_BLOCK = 32  # pages per inner step at most (pages per program are a multiple of it)
HEAD_DIMS = (64, 128)


@triton.jit
def store_and_fold(lse2, p, pmask, g, row, G, max_pages, scores_ptr, m_run, l_run):
    """Store a step's page scores (log2 units in, natural log out) and fold them into each head's
    running (max, sum of exp2) over the program's pages. Shared by the score kernels."""
    out_off = (row * G + g)[None, :].to(tl.int64) * max_pages + p[:, None]
    tl.store(scores_ptr + out_off, lse2 * _LN2, mask=pmask[:, None] & (g < G)[None, :])
    lse2 = tl.where(pmask[:, None], lse2, float("-inf"))
    m_new = tl.maximum(m_run, tl.max(lse2, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_run = l_run * tl.exp2(m_run - m_safe) + tl.sum(tl.exp2(lse2 - m_safe[None, :]), axis=0)
    return m_new, l_run


@triton.jit
def _score_mma_kernel(q_ptr, stride_qb, stride_qh, basis_ptr, bscale_ptr, coef_ptr, cscale_ptr, cen_ptr,
                      censcale_ptr, bt_ptr, stride_bt, seqlen_ptr, scores_ptr, stats_ptr,
                      Hkv, G, max_pages, n_chunks, pages_per_prog, qk_scale,
                      GP: tl.constexpr, GB: tl.constexpr, D: tl.constexpr, S: tl.constexpr, R: tl.constexpr,
                      RP: tl.constexpr, BLOCK: tl.constexpr, DOT_DT: tl.constexpr, C_DT: tl.constexpr,
                      PRECISION: tl.constexpr):
    """Three tensor-core dots per step of BLOCK pages, q^T loaded once per program.

    1. projections: the basis bytes of BLOCK pages as a ``[BLOCK * RP, D / 2]`` tile (rows past R
       masked to zero, RP = 16), nibbles sign-extended and interleaved back to ``[BLOCK * RP, D]``
       (element 2i = low nibble), times q^T ``[D, GP]``;
    2. centroid term: ``[BLOCK, D]`` int8 times q^T;
    3. per-page contraction with the coefficients as a batched dot
       ``[BLOCK, S, RP] x [BLOCK, RP, GP]`` (int8 coefficients exact in C_DT; for float16 the
       projections are split into two float16 parts, two dots, so no precision is lost), then the
       key scales, the centroid term and the log-sum-exp over the S keys in float32.
    """
    pid_c = tl.program_id(0)
    row = tl.program_id(1)  # b * Hkv + h
    b = row // Hkv
    h = row % Hkv
    pc = tl.load(seqlen_ptr + b) // S
    g = tl.arange(0, GP)
    dd = tl.arange(0, D)
    qt = tl.load(q_ptr + b * stride_qb + (h * G + g)[None, :] * stride_qh + dd[:, None], mask=(g < G)[None, :],
                 other=0.0).to(DOT_DT)  # [D, GP]
    m = tl.arange(0, BLOCK * RP)
    mp = m // RP
    mr = m % RP
    jj = tl.arange(0, D // 2)
    s_idx = tl.arange(0, S)
    r_idx = tl.arange(0, RP)
    pb = tl.arange(0, BLOCK)
    m_run = tl.full([GP], float("-inf"), tl.float32)
    l_run = tl.zeros([GP], tl.float32)
    start = pid_c * pages_per_prog
    end = tl.minimum(start + pages_per_prog, pc)
    btr = bt_ptr + b.to(tl.int64) * stride_bt
    for p0 in range(start, end, BLOCK):
        p = p0 + pb
        pmask = p < end
        ph = tl.load(btr + p, mask=pmask, other=0).to(tl.int64) * Hkv + h  # (page, head) record [BLOCK]
        mmask = ((p0 + mp) < end) & (mr < R)
        ph_m = tl.load(btr + p0 + mp, mask=mmask, other=0).to(tl.int64) * Hkv + h  # [BLOCK * RP]
        by = tl.load(basis_ptr + (ph_m * R + mr)[:, None] * (D // 2) + jj[None, :], mask=mmask[:, None],
                     other=0).to(tl.int32)  # [BLOCK * RP, D / 2] bytes
        x = tl.interleave((by << 28) >> 28, (by << 24) >> 28).to(tl.float32).to(DOT_DT)  # [BLOCK * RP, D]
        proj = tl.dot(x, qt, input_precision=PRECISION)  # [BLOCK * RP, GP]
        bsc = tl.load(bscale_ptr + ph_m * R + mr, mask=mmask, other=0.0).to(tl.float32)
        proj = tl.reshape(proj * bsc[:, None], (BLOCK, RP, GP))
        cen = tl.load(cen_ptr + ph[:, None] * D + dd[None, :], mask=pmask[:, None], other=0).to(tl.float32)
        qmu = tl.dot(cen.to(DOT_DT), qt, input_precision=PRECISION)  # [BLOCK, GP]
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
# call (the decode plan's warm-up, before any graph capture); ws["launch"] pins one instead.
_MMA_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w, num_stages=st)
                for b in (16, 32) for w in (4, 8) for st in (1, 2, 3)]
_score_mma_tuned = triton.autotune(_MMA_CONFIGS, key=["Hkv", "G", "D", "R", "pages_per_prog"])(_score_mma_kernel)


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


def _launch_sizes(total_pages: int, rows: int, device: torch.device, block: int) -> int:
    """Pages per program: enough programs to fill the GPU, at least one block each."""
    target = 8 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    per_row = max(1, target // max(rows, 1))
    ppp = -(-total_pages // per_row)
    return max(block, -(-ppp // block) * block)


def score_workspace(batch: int, num_kv_heads: int, group: int, max_pages: int, device,
                    pages_per_program: int | None = None, head_dim: int = 128) -> dict:
    """Buffers for :func:`score_pages_paged`, allocated once per plan. Pages per program: sized
    for the CUDA kernel where it is available (a multiple of every kernel's step), else for Triton's."""
    device = torch.device(device)
    rows = batch * num_kv_heads
    ppp, balanced = pages_per_program, False
    if ppp is None and device.type == "cuda":
        from kvlocks.scoring import cuda_mma  # noqa: PLC0415 (imports this module)

        if cuda_mma.available(device):
            ppp = cuda_mma.pages_per_program(max_pages, rows, device, head_dim, group)
            balanced = cuda_mma.BALANCED
    ppp = ppp or _launch_sizes(max_pages, rows, device, MAX_BLOCK)
    n_chunks = max(1, -(-max_pages // ppp))
    gb = triton.next_power_of_2(group)
    f32 = dict(dtype=torch.float32, device=device)
    return {
        "ppp": ppp, "n_chunks": n_chunks, "balanced": balanced,
        "scores": torch.empty(batch, num_kv_heads, group, max_pages, **f32),
        "stats": torch.empty(rows, n_chunks, 2, gb, **f32),
        "lse": torch.empty(batch, num_kv_heads, group, **f32),
        "ranking": torch.empty(batch, num_kv_heads, max_pages, **f32),
        "ppp2": _launch_sizes(max_pages, rows, device, 256),
    }


def score_pages_paged(queries: torch.Tensor, summaries: PagedSummaries, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, *, scale: float | None = None, combine: str = "mean_share",
                      workspace: dict | None = None, rank: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 4 page scores, per-head log-sum-exp and the combined ranking, for every full page.

    Parameters
    ----------
    queries : ``[B, Hq, D]`` float32/bfloat16/float16, Hq = Hkv * G (head ``h * G + g``)
    summaries : :class:`PagedSummaries` indexed by physical page id
    block_table : int32 ``[B, max_pages]``; seq_lens : int32 ``[B]`` (tokens per sequence)
    workspace : from :func:`score_workspace` (allocated here when omitted); ``workspace["kernel"]``
        (or the environment variable ``KVLOCKS_SCORE_KERNEL``) may pin ``"cuda"`` (:mod:`kvlocks.scoring.cuda_mma`), ``"packed"``
        (:mod:`kvlocks.scoring.triton_packed`) or ``"mma"`` (the Triton three-dot kernel). By default
        the CUDA kernel runs where it is supported and compiled (half-precision queries, S = 16,
        R = 8), else the packed kernel where it measured faster (half precision, G <= 16, R = 8),
        else the three-dot kernel

    Returns
    -------
    scores : float32 ``[B, Hkv, G, max_pages]``, natural-log page masses (Eq. 4)
    lse : float32 ``[B, Hkv, G]``, each head's log-sum-exp over its full pages
    ranking : float32 ``[B, Hkv, max_pages]``, the combined score (higher is better)
    Entries at page ``p >= seq_lens[b] // S`` are not written. With ``rank=False`` the combine pass
    is skipped and lse and ranking are None (:func:`kvlocks.selection.fused.rank_and_select` does
    it, fused with the selection).
    """
    bsz, hq, d = queries.shape
    hkv, s, r = summaries.num_kv_heads, summaries.page_size, summaries.rank
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim={d}: the score kernel supports {HEAD_DIMS}")
    g = hq // hkv
    max_pages = block_table.shape[1]
    ws = workspace or score_workspace(bsz, hkv, g, max_pages, queries.device, head_dim=d)
    choice = ws.get("kernel") or os.environ.get("KVLOCKS_SCORE_KERNEL", "auto")
    if choice not in ("auto", "cuda", "packed", "mma"):
        raise ValueError(f"score kernel {choice!r} (workspace['kernel'] or KVLOCKS_SCORE_KERNEL): "
                         "allowed 'auto', 'cuda', 'packed', 'mma'")
    from kvlocks.scoring import cuda_mma, triton_packed  # noqa: PLC0415 (imports this module)

    if choice == "cuda" or (choice == "auto" and (ws["ppp"] % cuda_mma.TILE == 0 or ws.get("balanced"))
                            and cuda_mma.supports(queries, g, summaries)):
        return cuda_mma.score_pages_mma(queries, summaries, block_table, seq_lens, scale=scale, combine=combine,
                                        workspace=ws, rank=rank)

    if choice == "packed" or (choice == "auto" and triton_packed.supports(queries, g, r)):
        return triton_packed.score_pages_packed(queries, summaries, block_table, seq_lens, scale=scale,
                                                combine=combine, launch=ws.get("launch"), workspace=ws, rank=rank)
    gb = ws["stats"].shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    launch = ws.get("launch") or ({} if queries.is_cuda else {"BLOCK": 16})
    kernel = _score_mma_tuned if queries.is_cuda and not ws.get("launch") else _score_mma_kernel
    kw = dict(RP=max(16, triton.next_power_of_2(r)), DOT_DT=dot_dtype(queries.dtype),
              C_DT=tl.float32 if queries.dtype == torch.float32 else tl.float16,
              PRECISION="ieee" if queries.dtype == torch.float32 else "tf32")
    kernel[(ws["n_chunks"], bsz * hkv)](
        queries, queries.stride(0), queries.stride(1), summaries.basis, summaries.basis_scale, summaries.coef,
        summaries.coef_scale, summaries.centroid, summaries.centroid_scale, block_table, block_table.stride(0),
        seq_lens, ws["scores"], ws["stats"], hkv, g, max_pages, ws["n_chunks"], ws["ppp"], scale * LOG2E,
        GP=max(16, gb), GB=gb, D=d, S=s, R=r, **kw, **launch,
    )
    return finish_scores(ws, seq_lens, hkv, g, max_pages, s, combine, rank)


def finish_scores(ws, seq_lens, hkv, g, max_pages, s, combine, rank=True):
    """The score functions' last step: the combine pass (per-head LSE and ranking) unless ``rank`` is
    False, where a fused consumer (:func:`kvlocks.selection.fused.rank_and_select`) does it."""
    if not rank:
        _check_rule(combine)
        return ws["scores"], None, None
    _combine_launch(ws, seq_lens, hkv, g, max_pages, s, combine)
    return ws["scores"], ws["lse"], ws["ranking"]


def _check_rule(combine: str) -> None:
    if combine not in RULES:
        raise ValueError(f"combine rule {combine!r}: allowed {tuple(RULES)}")


def _combine_launch(ws, seq_lens, hkv, g, max_pages, s, combine):
    _check_rule(combine)
    rows = ws["stats"].shape[0]
    n2 = max(1, -(-max_pages // ws["ppp2"]))
    _combine_kernel[(n2, rows)](
        ws["scores"], ws["stats"], seq_lens, ws["ranking"], ws["lse"], hkv, g, max_pages, ws["n_chunks"],
        ws["ppp2"], S=s, GP=ws["stats"].shape[-1], RULE=RULES[combine], BLOCK_C=ws.get("combine_block", 256),
        BLOCK_K=stats_block(ws), num_warps=4,
    )


def stats_block(ws: dict) -> int:
    """Score programs' statistics reduced per load by :func:`row_lse2`."""
    return max(16, min(256, triton.next_power_of_2(ws["n_chunks"])))


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
    ws = {"scores": x, "stats": stats, "n_chunks": p, "lse": torch.empty(rows, 1, g, device=x.device),
          "ranking": torch.empty(rows, 1, p, device=x.device), "ppp2": 256}
    seq = torch.full((rows,), p, dtype=torch.int32, device=x.device)
    _combine_launch(ws, seq, 1, g, p, 1, rule)
    return ws["ranking"].reshape(*lead, p)


def _store_from_reference(summaries, n_rows: int) -> tuple[PagedSummaries, torch.Tensor]:
    """Reference summaries ``[..., P]`` -> a store of ``n_rows * P`` pages with Hkv = 1."""
    p = summaries.num_pages

    def flat(t, tail):  # [..., P, *tail] -> [n_rows * P, 1, *tail]
        return t.reshape(n_rows * p, 1, *tail).contiguous()

    s, r, d = summaries.page_size, summaries.rank, summaries.head_dim
    store = PagedSummaries(
        basis=flat(summaries.basis, (r, d // 2)), basis_scale=flat(summaries.basis_scale, (r,)),
        coef=flat(summaries.coef, (s, r)), coef_scale=flat(summaries.coef_scale, (s,)),
        centroid=flat(summaries.centroid, (d,)), centroid_scale=flat(summaries.centroid_scale, ()),
    )
    table = torch.arange(n_rows * p, dtype=torch.int32, device=summaries.coef.device).view(n_rows, p)
    return store, table
