"""Split-KV paged decode over a per-(sequence, KV head) page list, in Triton.

``_attn_kernel``, grid ``(splits, B * Hkv)``: one program holds all G query heads of its KV head
(padded to GP = 16 rows, the smallest ``tl.dot`` M), walks its share of the page list
``ppi`` pages (``ppi * S`` tokens) at a time, translates logical page ids through the block table,
masks tokens past ``seq_lens`` (the partial last page) and ids of -1 (list padding), and keeps an
online softmax in float32 (exp2 domain). ``_merge_kernel``, grid ``(B * Hq,)``, combines the
splits by log-sum-exp. The dense split-KV baseline is the same kernel over the identity page list
(a stride-0 ``arange``), so the two differ only in which pages they read.

The merge runs as its own launch. Done instead by each row's last split to finish (an arrival
counter per row) it was timed slower on the H200 (GLM-4-9B, LOCKS: 11.76 -> 12.19 ms per step at
1M, 7.74 -> 8.15 at 32K; as a tuner candidate the slowest launch everywhere: docs/benchmarks.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvlocks._checks import check_out
from kvlocks.cache.layout import dot_dtype, token_major_to_paged
from kvlocks.config import DenseLaunch, KernelOptions, default_kernel_options
from kvlocks.pdl import enabled as pdl_enabled

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# kernels may read module globals only when they are constexpr
_LN2 = tl.constexpr(LN2)
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _dense_pps(n_pages, dense_splits, PP: tl.constexpr):
    """Pages per program of a row attended over every page: its pages over ``dense_splits``
    programs, rounded up to the inner step ``PP`` (any length is covered)."""
    return tl.cdiv(tl.cdiv(n_pages, dense_splits), PP) * PP


@triton.jit
def _page_ids(lst, idx, end, dense, HAS_DENSE: tl.constexpr):
    """Logical page ids of list positions ``idx`` (-1 from ``end`` on): the listed ids, or the
    positions themselves on a row attended over every page (``dense``; the list is not read)."""
    inb = idx < end
    if HAS_DENSE:
        listed = tl.load(lst + idx, mask=inb & ((idx * 0 + dense) == 0), other=-1)  # (a tensor mask)
        return tl.where(inb, tl.where(dense != 0, idx, listed), -1)
    return tl.load(lst + idx, mask=inb, other=-1)


@triton.jit
def _attn_kernel(q_ptr, stride_qb, stride_qh, k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, bt_ptr, stride_bt,
                 seqlen_ptr, pl_ptr, stride_lb, stride_lh, n_list, po_ptr, plse_ptr, Hkv, G, n_splits,
                 pages_per_split, qk_scale, sel_ptr, dense_splits, GP: tl.constexpr, D: tl.constexpr,
                 S: tl.constexpr, PP: tl.constexpr, DOT_DT: tl.constexpr, PRECISION: tl.constexpr,
                 HAS_DENSE: tl.constexpr = False, PDL: tl.constexpr = False):
    if PDL:  # launched early (kvlocks.pdl): wait for the kernels ahead, then let the next launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    split = tl.program_id(0)
    row = tl.program_id(1)
    b = row // Hkv
    h = row % Hkv
    n = tl.load(seqlen_ptr + b)
    g = tl.arange(0, GP)
    gmask = g < G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=gmask[:, None],
                other=0.0).to(DOT_DT)  # [GP, D]
    t = tl.arange(0, PP * S)
    slot = t // S
    tok = t % S
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    pps = pages_per_split
    n_end = n_list
    dense = 0  # int 0/1: whether the row attends every page instead of its page list
    if HAS_DENSE:  # a row whose sel_ptr entry is 0 attends pages 0 .. ceil(n / S) - 1 over dense_splits programs
        dense = (tl.load(sel_ptr + b) == 0).to(tl.int32)
        n_pages = tl.cdiv(n, S)
        pps = tl.where(dense != 0, _dense_pps(n_pages, dense_splits, PP), pps)
        n_end = tl.where(dense != 0, n_pages, n_end)
    start = split * pps
    end = tl.minimum(start + pps, n_end)
    lst = pl_ptr + b.to(tl.int64) * stride_lb + h * stride_lh
    btr = bt_ptr + b.to(tl.int64) * stride_bt
    # page ids one step ahead: the index loads of step j+1 overlap the K/V loads of step j
    lp = _page_ids(lst, start + slot, end, dense, HAS_DENSE)  # logical page of each token row
    phys = tl.load(btr + lp, mask=lp >= 0, other=0).to(tl.int64)
    for j0 in range(start, end, PP):
        valid = (lp >= 0) & (lp * S + tok < n)
        off = phys * stride_kp + tok * stride_ks + h * stride_kh  # [PP * S]
        k = tl.load(k_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(DOT_DT)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(DOT_DT)
        lp = _page_ids(lst, j0 + PP + slot, end, dense, HAS_DENSE)
        phys = tl.load(btr + lp, mask=lp >= 0, other=0).to(tl.int64)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [GP, PP * S]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(DOT_DT), v, acc=acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    r = (b * Hkv * G + h * G + g).to(tl.int64) * n_splits + split  # [GP] partial-row index
    tl.store(po_ptr + r[:, None] * D + d[None, :], out, mask=gmask[:, None])
    tl.store(plse_ptr + r, lse2, mask=gmask)


@triton.jit
def _merge_kernel(po_ptr, plse_ptr, out_ptr, stride_ob, stride_oh, lse_ptr, Hq, n_splits, list_splits, seqlen_ptr,
                  sel_ptr, dense_splits, D: tl.constexpr, BLOCK_S: tl.constexpr, S: tl.constexpr, PP: tl.constexpr,
                  HAS_DENSE: tl.constexpr = False, PDL: tl.constexpr = False):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)  # b * Hq + head
    b = r // Hq
    hq = r % Hq
    d = tl.arange(0, D)
    m_all = tl.full([], float("-inf"), tl.float32)
    l_all = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D], tl.float32)
    used = list_splits  # the programs that may hold a partial of this row (the others wrote none)
    if HAS_DENSE:
        n_pages = tl.cdiv(tl.load(seqlen_ptr + b), S)
        dense_used = tl.minimum(tl.cdiv(n_pages, tl.maximum(_dense_pps(n_pages, dense_splits, PP), 1)), n_splits)
        used = tl.where(tl.load(sel_ptr + b) == 0, dense_used, used)
    for s0 in range(0, used, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        sm = s < used
        ls = tl.load(plse_ptr + r.to(tl.int64) * n_splits + s, mask=sm, other=float("-inf"))
        o = tl.load(po_ptr + (r.to(tl.int64) * n_splits + s)[:, None] * D + d[None, :], mask=sm[:, None], other=0.0)
        m_new = tl.maximum(m_all, tl.max(ls, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(ls - m_safe)
        alpha = tl.exp2(m_all - m_safe)
        l_all = l_all * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        m_all = m_new
    has = l_all > 0.0
    out = acc / tl.where(has, l_all, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + r, tl.where(has, (m_all + tl.log2(tl.where(has, l_all, 1.0))) * _LN2, float("-inf")))


def step_pages(ppi: int, head_dim: int) -> int:
    """Pages the attention kernel reads per inner step for a launch of ``ppi`` pages per step:
    ``ppi`` up to head_dim 128, half of it (at least 1) at 256.

    Halved at 256 so that a step's tiles keep D = 128's size: the K and V tiles ``[ppi * S, D]``
    (staged in shared memory once per pipeline stage: at D = 256 the 8-page, 2-stage launch would
    need 256 KB, over sm_90's 227 KB per block) and the loads in flight per thread. The float32
    accumulator ``[16, D]`` still doubles, to 32 registers per thread at 4 warps (16 at 8 warps).
    """
    return ppi if head_dim <= 128 else max(1, ppi * 128 // head_dim)


@dataclass
class AttentionWorkspace:
    """Buffers of one split-KV launch shape, allocated once per plan (:func:`attention_workspace`).

    launch : the DenseLaunch it was sized for (pages per inner step, warps, stages; the kernel's
        step at head_dim 256 is :func:`step_pages`)
    splits : programs per (sequence, KV head) over a page list; pps : pages per split, a multiple of
        ``launch.ppi``
    dense_splits : programs per (sequence, KV head) of a row attended over every page (``sparse_lens``
        0 in :func:`paged_decode`; sized for ``dense_pages``)
    po, plse : float32 partials ``[B, Hq, grid, D]`` and their LSEs ``[B, Hq, grid]``,
        ``grid = max(splits, dense_splits)``
    out : ``[B, Hq, D]`` in the queries' dtype; lse : float32 ``[B, Hq]``
    """

    launch: DenseLaunch
    splits: int
    pps: int
    dense_splits: int
    po: torch.Tensor
    plse: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


def default_splits(list_len: int, rows: int, device, ppi: int) -> int:
    """About 4 programs per SM, at least ``ppi`` pages each."""
    device = torch.device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return max(1, min(-(-list_len // ppi), -(-4 * sms // max(rows, 1))))


def _splits(pages: int, rows: int, device, launch: DenseLaunch) -> tuple[int, int]:
    """``(splits, pages per split)`` over ``pages``: :func:`default_splits` times the launch's split
    factor, pages per split a multiple of its ``ppi``."""
    ppi = launch.ppi
    base = default_splits(pages, rows, device, ppi)
    splits = max(1, min(-(-pages // ppi), round(base * launch.split_factor)))
    pps = -(-(-(-pages // splits)) // ppi) * ppi
    return max(1, -(-pages // pps)), pps


def attention_workspace(batch: int, num_q_heads: int, head_dim: int, list_len: int, rows: int, dtype, device,
                        launch: DenseLaunch | None = None, num_splits: int | None = None,
                        dense_pages: int = 0, split_rows: int | None = None) -> AttentionWorkspace:
    """Buffers for :func:`paged_decode` with ``launch`` (default ``DenseLaunch()``) over page lists of
    ``list_len`` entries and ``rows = B * Hkv``; ``num_splits`` None: :func:`default_splits` times
    the launch's split factor. ``dense_pages``: the pages of the longest row attended over every
    page that the launch is sized for (0: as many programs as a list; longer rows are still
    attended whole, by fewer programs per page). ``split_rows``: the rows the split counts are
    sized for (default ``rows``); a row's pages are split the same way whatever the batch when it
    is fixed, so its output bits do not depend on the rows beside it."""
    device = torch.device(device)
    launch = launch or DenseLaunch()
    ppi = launch.ppi
    rows = split_rows or rows
    if num_splits is None:
        num_splits, pps = _splits(list_len, rows, device, launch)
    else:
        pps = -(-(-(-list_len // num_splits)) // ppi) * ppi  # pages per split, a multiple of ppi
        num_splits = max(1, -(-list_len // pps))
    dense_splits = _splits(dense_pages, rows, device, launch)[0] if dense_pages > list_len else num_splits
    grid = max(num_splits, dense_splits)
    f32 = dict(dtype=torch.float32, device=device)
    return AttentionWorkspace(
        launch=launch, splits=num_splits, pps=pps, dense_splits=dense_splits,
        po=torch.empty(batch, num_q_heads, grid, head_dim, **f32),
        plse=torch.empty(batch, num_q_heads, grid, **f32),
        out=torch.empty(batch, num_q_heads, head_dim, dtype=dtype, device=device),
        lse=torch.empty(batch, num_q_heads, **f32),
    )


def paged_decode(queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, page_list: torch.Tensor, *, scale: float | None = None,
                 workspace: AttentionWorkspace | None = None, options: KernelOptions | None = None,
                 out: torch.Tensor | None = None,
                 sparse_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of one decode query per head over the listed pages.

    Parameters
    ----------
    queries : ``[B, Hq, D]`` (last dim contiguous), Hq = Hkv * G, head ``h * G + g``
    k_cache, v_cache : ``[num_pages, S, Hkv, D]`` (same strides, last dim contiguous)
    block_table : int32 ``[B, max_pages]``; seq_lens : int32 ``[B]``
    page_list : int32 ``[B, Hkv, L]`` logical page ids (any order, distinct; -1 = skip); strides
        may be 0 (the dense baseline passes a broadcast ``arange``)
    workspace : from :func:`attention_workspace` (allocated here with the default launch when omitted)
    options : KernelOptions (None: the defaults); ``pdl`` is read
    out : ``[B, Hq, D]`` in the queries' dtype, last dim contiguous (any row and head strides): the
        merge writes the result there instead of into the workspace's buffer
    sparse_lens : int32 ``[B]`` or None: a row whose entry is 0 is attended over every page of its
        ``seq_lens`` (exact attention; its page list is not read), by the workspace's
        ``dense_splits`` programs; the other rows attend their page lists

    Returns
    -------
    out : ``[B, Hq, D]`` in the queries' dtype (``out``, or the workspace's buffer); lse : float32 ``[B, Hq]``
    """
    bsz, hq, d = queries.shape
    _, s, hkv, _ = k_cache.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or queries.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need equal strides and a contiguous last dim")
    g = hq // hkv
    n_list = page_list.shape[-1]
    ws = workspace or attention_workspace(bsz, hq, d, n_list, bsz * hkv, queries.dtype, queries.device)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    lse, launch = ws.lse, ws.launch
    out = ws.out if out is None else check_out(out, queries)
    pdl = pdl_enabled(queries.device, (options or default_kernel_options()).pdl)
    pdl_launch = {"launch_pdl": True} if pdl else {}
    has_dense = sparse_lens is not None
    if has_dense and (sparse_lens.shape != (bsz,) or sparse_lens.dtype != torch.int32):
        raise ValueError(f"sparse_lens must be int32 [{bsz}], got {sparse_lens.dtype} {tuple(sparse_lens.shape)}")
    grid = max(ws.splits, ws.dense_splits) if has_dense else ws.splits
    if ws.po.shape[2] < grid:
        raise ValueError(f"workspace holds {ws.po.shape[2]} partials per head, the launch needs {grid}")
    sel = sparse_lens if has_dense else seq_lens
    pp = step_pages(launch.ppi, d)
    _attn_kernel[(grid, bsz * hkv)](
        queries, queries.stride(0), queries.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_table, block_table.stride(0), seq_lens, page_list, page_list.stride(0),
        page_list.stride(1), n_list, ws.po, ws.plse, hkv, g, ws.po.shape[2], ws.pps, scale * LOG2E, sel,
        ws.dense_splits, GP=max(16, triton.next_power_of_2(g)), D=d, S=s, PP=pp, DOT_DT=dot_dtype(k_cache.dtype),
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32", HAS_DENSE=has_dense, PDL=pdl,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_launch,
    )
    _merge_kernel[(bsz * hq,)](ws.po, ws.plse, out, out.stride(0), out.stride(1), lse, hq, ws.po.shape[2], ws.splits,
                               seq_lens, sel, ws.dense_splits, D=d, BLOCK_S=32, S=s, PP=pp, HAS_DENSE=has_dense,
                               PDL=pdl, num_warps=4, **pdl_launch)
    return out, lse


def identity_pages(batch: int, num_kv_heads: int, max_pages: int, device) -> torch.Tensor:
    """The dense page list: ``[B, Hkv, max_pages]`` view of one ``arange`` (strides 0, 0, 1)."""
    return torch.arange(max_pages, dtype=torch.int32, device=device).expand(batch, num_kv_heads, max_pages)


# ---- adapters with the reference signatures (token-major keys/values) ----

def _as_paged(queries, keys, values, page_size):
    lead, (g, d), n = queries.shape[:-2], queries.shape[-2:], keys.shape[-2]
    rows = lead.numel()
    kc, table = token_major_to_paged(keys.reshape(rows, n, d), page_size)
    vc, _ = token_major_to_paged(values.reshape(rows, n, d), page_size)
    seq = torch.full((rows,), n, dtype=torch.int32, device=keys.device)
    return queries.reshape(rows, g, d).contiguous(), kc, vc, table, seq, lead


def sparse_decode(queries, keys, values, page_ids, page_size, *, scale=None, token_mask=None):
    """Same as :func:`kvlocks.attention.reference.sparse_decode` (no ``token_mask``)."""
    if token_mask is not None:
        raise NotImplementedError("token_mask: use the torch backend (the paged layout has no padding)")
    q, kc, vc, table, seq, lead = _as_paged(queries, keys, values, page_size)
    pl = page_ids.reshape(q.shape[0], 1, -1).to(torch.int32).contiguous()
    out, lse = paged_decode(q, kc, vc, table, seq, pl, scale=scale)
    return out.reshape(queries.shape).clone(), lse.reshape(queries.shape[:-1]).clone()


def dense_decode(queries, keys, values, *, scale=None, token_mask=None):
    """Same as :func:`kvlocks.attention.reference.dense_decode`: split-KV over every page."""
    if token_mask is not None:
        raise NotImplementedError("token_mask: use the torch backend (the paged layout has no padding)")
    q, kc, vc, table, seq, lead = _as_paged(queries, keys, values, page_size=16)
    pl = identity_pages(q.shape[0], 1, table.shape[1], q.device)
    out, lse = paged_decode(q, kc, vc, table, seq, pl, scale=scale)
    return out.reshape(queries.shape).clone(), lse.reshape(queries.shape[:-1]).clone()
