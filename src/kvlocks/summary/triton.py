"""Algorithm 1 on the GPU: batched page-summary build with a parallel Jacobi eigensolver, in Triton.

``_build_kernel``, one program per BP (page, KV head) items, writes straight into the paged store:

1. load the page's keys ``[S, D]`` in float32, centre them (deviations kept as even/odd halves
   of D, so the int4 packing needs no re-interleave), Gram ``dev dev^T [S, S]`` by two batched
   ``tl.dot``s (``tf32x3`` on the GPU: float32-accurate on tensor cores);
2. cyclic parallel Jacobi on the Gram: each step rotates the S/2 disjoint pairs of a round-robin
   tournament (partner(i) = (2t - i) mod (S-1), with S-1 meeting t), the rotations applied as
   ``A <- J^T A J`` and ``V <- V J`` through ``tl.gather`` of the partner rows/columns; a sweep is
   S-1 steps and meets every pair once. Three variants (``ROTATIONS``, same rotations, results
   equal up to float32 rounding): ``lean`` (the default: diagonal tracked in closed form, one
   reduction per step, 284 SASS instructions per thread per step for sm_90), ``gathers`` (four
   masked reductions per step, 468) and ``dots`` (rotations as tf32x3 batched dots, 733). H200,
   whole model at 1M (``scripts/device/build_probe.py``): lean 1.18 s (llama3-8b) / 0.75 s
   (glm4-9b-1m) at 1 item x 1 warp per program (the autotuner's pick), 1.76 / 1.11 s at 2 x 2;
   gathers 2.51 / 1.57 s, dots 2.29 / 1.44 s at 4 x 4. Prepared, off: ``xor`` / ``xor_unrolled``,
   the pairs of step m as (i, i XOR m) (215 / 191 instructions per step; see ``_jacobi_xor``), and
   ``onesided`` (:func:`_build_onesided`): no Gram, the rows of the centred keys rotated until
   orthogonal, the row swaps register moves and 40 butterfly shuffles per step the only exchange
   (the Gram solvers: 67 shared-memory/shuffle operations per step). H200, llama3-8b at 1M (session
   12): with Triton 3.9 it ties lean (1.104 vs 1.094 s); with Triton 3.6, whose layout conversions
   turn the row swaps into shared-memory traffic (2.6x lean's instructions), it is 3x slower (3.52 s).
   Kept, off: it reproduces the float64 reference exactly on pages where lean is near the test
   tolerance;
3. rank the eigenvalues, take the top R eigenvectors u_r, basis ``v_r = dev^T u_r / |.|`` (float32
   rounds the Gram at ~1e-7 * lambda_1, so a direction with lambda_r <= ``rel_floor**2 *
   lambda_1`` is dropped as numerically zero, like the reference's 1e-6 floor in float64),
   coefficients ``dev v_r`` (the projection, as in the reference), one rank at a time (``FINISH =
   "loop"``) or all at once as batched tf32x3 dots (``"dots"``, prepared, off), then int4/int8
   quantization with float16 scales rounded up, round-half-even like ``torch.round``.

Modes: an explicit list of physical page ids (prefill: every full page), or the incremental build
(decode): per sequence, the page that the last appended token filled, found on the device from
``seq_lens`` and the block table (nothing to do unless ``seq_lens % S == 0``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlocks.config import LocksConfig
from kvlocks.cache.layout import PagedSummaries, check_kernel_config
from kvlocks.summary.types import PageSummaries

REL_FLOOR = 3e-3  # sigma_r / sigma_1 below this is numerically zero in float32 (see module doc)
SWEEPS = 5  # sweeps of S-1 steps; 16x16 Grams converge to float32 accuracy in 5 (tests check)
FP16_TINY = 2.0**-24


@triton.jit
def _rint(x):
    """Round half to even (``torch.round``), exact for |x| < 2**22: once 1.5 * 2**23 is added, float32
    keeps no fraction bits, so the add's own round-to-nearest-even rounds x; subtracting it back is
    exact (two adds instead of a floor, a parity test and a select)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _scale_up(s):
    """float16 scale never below ``s`` (``quant._fp16_round_up``): (float16, its float32 value)."""
    s = tl.maximum(s, 2.0**-24)
    hf = s.to(tl.float16)
    bumped = (hf.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    hf = tl.where(hf.to(tl.float32) < s, bumped, hf)
    return hf, hf.to(tl.float32)


@triton.jit
def _dev_halves(k_ptr, base, ok, s_idx, j, stride_ks, S: tl.constexpr, VOLATILE: tl.constexpr = False):
    """Centred keys of BP pages as even/odd halves of D: ``[BP, S, D/2]`` each, and the means.
    ``VOLATILE``: a load the compiler may not merge with an earlier one (a reload after the
    solver, so the keys are not held in registers through it)."""
    ptr = k_ptr + base[:, None, None] + s_idx[None, :, None] * stride_ks + 2 * j[None, None, :]
    ke = tl.load(ptr, mask=ok[:, None, None], other=0.0, volatile=VOLATILE).to(tl.float32)
    ko = tl.load(ptr + 1, mask=ok[:, None, None], other=0.0, volatile=VOLATILE).to(tl.float32)
    mue = tl.sum(ke, axis=1) / S
    muo = tl.sum(ko, axis=1) / S
    return ke - mue[:, None, :], ko - muo[:, None, :], mue, muo


@triton.jit
def _pairs(t, ii, S: tl.constexpr):
    """Round-robin step t: partner of each index (S - 1 meets t), and (j == partner(i)) as floats."""
    part = tl.where(ii == t, S - 1, tl.where(ii == S - 1, t, (2 * t - ii + 2 * (S - 1)) % (S - 1)))
    return part, (ii[None, :] == part[:, None]).to(tl.float32)


@triton.jit
def _rotation(app, aqq, apq, is_p):
    """Jacobi rotation zeroing a_pq, per index: (t, c, weight of the partner's row/column)."""
    zero = apq == 0.0
    theta = (aqq - app) / (2.0 * tl.where(zero, 1.0, apq))
    tt = tl.where(theta >= 0, 1.0, -1.0) / (tl.abs(theta) + tl.sqrt(theta * theta + 1.0))
    tt = tl.where(zero, 0.0, tt)
    c = 1.0 / tl.sqrt(tt * tt + 1.0)
    return tt, c, tl.where(is_p, -tt * c, tt * c)


@triton.jit
def _rotate_by_gathers(a, v, c, sg, part, BP: tl.constexpr, S: tl.constexpr):
    """Apply one step's rotations: ``A <- J^T A J``, ``V <- V J`` by gathering partner rows/columns."""
    idx = tl.broadcast_to(part[None, None, :], (BP, S, S))
    a = c[:, None, :] * a + sg[:, None, :] * tl.gather(a, idx, 2)  # columns: A J
    a = c[:, :, None] * a + sg[:, :, None] * tl.gather(a, tl.permute(idx, (0, 2, 1)), 1)  # rows
    v = c[:, None, :] * v + sg[:, None, :] * tl.gather(v, idx, 2)
    return a, v


@triton.jit
def _jacobi_gathers(a, v, eye, n_sweeps, BP: tl.constexpr, S: tl.constexpr):
    """Cyclic parallel Jacobi: the pair entries read from the tile by masked reductions each step,
    rotations applied by gathers (exact float32). Returns (A, V); eigenvalues = diag(A)."""
    ii = tl.arange(0, S)
    for _sweep in range(n_sweeps):
        for t in range(S - 1):
            part, pm = _pairs(t, ii, S)
            diag = tl.sum(a * eye[None, :, :], axis=2)
            dpart = tl.sum(diag[:, None, :] * pm[None, :, :], axis=2)
            apq = 0.5 * (tl.sum(a * pm[None, :, :], axis=2) + tl.sum(a * tl.trans(pm)[None, :, :], axis=1))
            is_p = (ii < part)[None, :]
            _, c, sg = _rotation(tl.where(is_p, diag, dpart), tl.where(is_p, dpart, diag), apq, is_p)
            a, v = _rotate_by_gathers(a, v, c, sg, part, BP, S)
    return a, v


@triton.jit
def _tracked_step(a, diag, part, ii, BP: tl.constexpr, S: tl.constexpr):
    """One step's rotations for the pairs (i, part[i]) with the diagonal tracked in closed form
    (a_pp -= t a_pq, a_qq += t a_pq): a_pq from one masked reduction plus a gather of an ``[BP, S]``
    vector (the same value for both indices of a pair). Returns (partner mask, c, partner weight,
    new diagonal)."""
    pm = (ii[None, :] == part[:, None]).to(tl.float32)
    x = tl.sum(a * pm[None, :, :], axis=2)  # a[i, partner(i)]
    pidx = tl.broadcast_to(part[None, :], (BP, S))
    apq = 0.5 * (x + tl.gather(x, pidx, 1))
    dpart = tl.gather(diag, pidx, 1)
    is_p = (ii < part)[None, :]
    tt, c, sg = _rotation(tl.where(is_p, diag, dpart), tl.where(is_p, dpart, diag), apq, is_p)
    return pm, c, sg, diag + tl.where(is_p, -tt, tt) * apq


@triton.jit
def _jacobi_lean(a, v, eye, n_sweeps, BP: tl.constexpr, S: tl.constexpr):
    """:func:`_jacobi_gathers` with :func:`_tracked_step`: one masked reduction over the tile per
    step instead of four. Returns (A, V, tracked eigenvalues)."""
    ii = tl.arange(0, S)
    diag = tl.sum(a * eye[None, :, :], axis=2)  # [BP, S]
    for _sweep in range(n_sweeps):
        for t in range(S - 1):
            part, _ = _pairs(t, ii, S)
            _, c, sg, diag = _tracked_step(a, diag, part, ii, BP, S)
            a, v = _rotate_by_gathers(a, v, c, sg, part, BP, S)
    return a, v, diag


@triton.jit
def _xor_step(a, v, diag, part, ii, BP: tl.constexpr, S: tl.constexpr):
    """One step of :func:`_jacobi_xor` for the pairs (i, part[i])."""
    _, c, sg, diag = _tracked_step(a, diag, part, ii, BP, S)
    a, v = _rotate_by_gathers(a, v, c, sg, part, BP, S)
    return a, v, diag


@triton.jit
def _jacobi_xor(a, v, eye, n_sweeps, BP: tl.constexpr, S: tl.constexpr, UNROLL: tl.constexpr):
    """:func:`_jacobi_lean` with the pairs of step m (1..S-1) = (i, i XOR m): every pair meets once
    per sweep; the partner index is one XOR instead of a modulo. ``UNROLL``: the S-1 steps unrolled,
    so each step's partners, masks and signs are compile-time constants (larger code). Returns
    (A, V, tracked eigenvalues)."""
    ii = tl.arange(0, S)
    diag = tl.sum(a * eye[None, :, :], axis=2)  # [BP, S]
    for _sweep in range(n_sweeps):
        if UNROLL:
            for m in tl.static_range(1, S):
                a, v, diag = _xor_step(a, v, diag, ii ^ m, ii, BP, S)
        else:
            for m in range(1, S):
                a, v, diag = _xor_step(a, v, diag, ii ^ m, ii, BP, S)
    return a, v, diag


@triton.jit
def _jacobi_dots(a, v, eye, n_sweeps, BP: tl.constexpr, S: tl.constexpr, PRECISION: tl.constexpr):
    """:func:`_tracked_step` with the rotations applied as batched dots with the rotation matrix J
    (``A <- J^T (A J)``, ``V <- V J``; ``tf32x3`` on the GPU): no gathers of the tiles. Returns
    (A, V, tracked eigenvalues)."""
    ii = tl.arange(0, S)
    diag = tl.sum(a * eye[None, :, :], axis=2)  # [BP, S]
    for _sweep in range(n_sweeps):
        for t in range(S - 1):
            part, _ = _pairs(t, ii, S)
            pm, c, sg, diag = _tracked_step(a, diag, part, ii, BP, S)
            # J[k, j] = c_j (k == j) + sg_j (k == partner(j));  J^T[j, k] likewise by rows
            jm = c[:, None, :] * eye[None, :, :] + sg[:, None, :] * tl.trans(pm)[None, :, :]
            jt = c[:, :, None] * eye[None, :, :] + sg[:, :, None] * pm[None, :, :]
            a = tl.dot(jt, tl.dot(a, jm, input_precision=PRECISION), input_precision=PRECISION)
            v = tl.dot(v, jm, input_precision=PRECISION)
    return a, v, diag


@triton.jit
def _descending_rank(lam, ii):
    """Position of each eigenvalue of ``lam [BP, S]`` in descending order (ties: lower index first)."""
    return tl.sum(((lam[:, None, :] > lam[:, :, None]) |
                   ((lam[:, None, :] == lam[:, :, None]) & (ii[None, None, :] < ii[None, :, None]))).to(tl.int32),
                  axis=2)


@triton.jit
def _split_bit(x, K: tl.constexpr, BP: tl.constexpr, S: tl.constexpr, H: tl.constexpr):
    """Rows of ``x [BP, S, H]`` with bit K of the row index 0 and 1: two ``[BP, S / 2^(K+1), 2^K, H]``."""
    y = tl.reshape(x, (BP, S // (2 << K), 2, 1 << K, H))
    return tl.split(tl.permute(y, (0, 1, 3, 4, 2)))


@triton.jit
def _join_bit(lo, hi, K: tl.constexpr, BP: tl.constexpr, S: tl.constexpr, H: tl.constexpr):
    """Inverse of :func:`_split_bit`: rows with bit K = 0 from ``lo``, = 1 from ``hi``."""
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 4, 2, 3)), (BP, S, H))


@triton.jit
def _xor_rows(x, M: tl.constexpr, BP: tl.constexpr, S: tl.constexpr, H: tl.constexpr):
    """``x[:, i ^ M, :]`` for ``x [BP, S, H]`` and a compile-time M: one split/join swap per set bit.
    With the row axis held within each thread (the layout of the build's key tiles) these are
    register moves: no shuffles, no shared memory (sm_90 SASS, docs/benchmarks.md)."""
    for k in tl.static_range(4):
        if (M >> k) & 1:
            a, b = _split_bit(x, k, BP, S, H)
            x = _join_bit(b, a, k, BP, S, H)
    return x


@triton.jit
def _pair_rotation(app, aqq, apq):
    """:func:`_rotation` for the first index of each pair, with fewer special-function operations:
    t = sign(tau) nu / (|tau| + sqrt(tau^2 + nu^2)) with tau = a_qq - a_pp, nu = 2 a_pq (the same t
    as tan of the angle from theta = tau / nu, without that division), c = rsqrt(t^2 + 1), and
    approximate division: an inexact angle only slows convergence, and (c, t c) stays a rotation."""
    tau = aqq - app
    nu = 2.0 * apq
    den = tl.abs(tau) + tl.sqrt(tau * tau + nu * nu)
    tt = tl.fdiv(tl.where(tau >= 0, nu, -nu), tl.where(den > 0.0, den, 1.0), ieee_rounding=False)
    return tt, tl.math.rsqrt(tt * tt + 1.0)


@triton.jit
def _pairs_of(x, M: tl.constexpr, BP: tl.constexpr, S: tl.constexpr, H: tl.constexpr):
    """The pairs (i, i ^ M) of rows of ``x [BP, S, H]``: the first rows (bit KH of i, the highest bit
    of M, is 0) and their partners, each ``[BP, S/2, H]`` in the same order."""
    KH: tl.constexpr = (M >= 2) + (M >= 4) + (M >= 8)  # highest set bit of 1 <= M < 16 (a call returning
    # a constant is not a constexpr in Triton 3.6)
    first, _ = _split_bit(x, KH, BP, S, H)
    second, _ = _split_bit(_xor_rows(x, M, BP, S, H), KH, BP, S, H)
    return tl.reshape(first, (BP, S // 2, H)), tl.reshape(second, (BP, S // 2, H))


@triton.jit
def _unpair(first, second, M: tl.constexpr, BP: tl.constexpr, S: tl.constexpr, H: tl.constexpr):
    """Inverse of :func:`_pairs_of`: rows back in their places. A partner i ^ M sits in the half with
    bit KH set at the place of i ^ (1 << KH); the rest of M (bits below KH, the same bits in the
    half's own row index) moves it there."""
    KH: tl.constexpr = (M >= 2) + (M >= 4) + (M >= 8)  # highest set bit of 1 <= M < 16 (a call returning
    # a constant is not a constexpr in Triton 3.6)
    hi: tl.constexpr = S // (2 << KH)
    second = _xor_rows(second, M ^ (1 << KH), BP, S // 2, H)
    return _join_bit(tl.reshape(first, (BP, hi, 1 << KH, H)), tl.reshape(second, (BP, hi, 1 << KH, H)), KH, BP, S, H)


@triton.jit
def _onesided_step(me, mo, w, lam, M: tl.constexpr, BP: tl.constexpr, S: tl.constexpr, H: tl.constexpr):
    """One step of :func:`_build_onesided`: the S/2 pairs (i, i ^ M) rotated at once."""
    pe, qe = _pairs_of(me, M, BP, S, H)
    po, qo = _pairs_of(mo, M, BP, S, H)
    pw, qw = _pairs_of(w, M, BP, S, S)
    lp, lq = _pairs_of(tl.reshape(lam, (BP, S, 1)), M, BP, S, 1)
    lp = tl.reshape(lp, (BP, S // 2))
    lq = tl.reshape(lq, (BP, S // 2))
    apq = tl.sum(pe * qe + po * qo, axis=2)  # [BP, S/2] <m_p, m_q>: the only reduction across lanes
    tt, c = _pair_rotation(lp, lq, apq)
    sn = (tt * c)[:, :, None]
    c = c[:, :, None]
    me = _unpair(c * pe - sn * qe, sn * pe + c * qe, M, BP, S, H)
    mo = _unpair(c * po - sn * qo, sn * po + c * qo, M, BP, S, H)
    w = _unpair(c * pw - sn * qw, sn * pw + c * qw, M, BP, S, S)
    lam = _unpair(tl.reshape(lp - tt * apq, (BP, S // 2, 1)), tl.reshape(lq + tt * apq, (BP, S // 2, 1)), M, BP, S, 1)
    return me, mo, w, tl.reshape(lam, (BP, S))


@triton.jit
def _build_onesided(de, do, n_sweeps, floor2, ph, ok, j, s_idx, basis_ptr, bscale_ptr, coef_ptr, cscale_ptr,
                    BP: tl.constexpr, S: tl.constexpr, D: tl.constexpr, R: tl.constexpr):
    """One-sided (Hestenes) Jacobi on the centred keys themselves, no Gram: the rows of ``dev [S, D]``
    are rotated in pairs (i, i XOR m), m = 1..S-1 per sweep, until they are orthogonal: ``dev' = W dev``
    with ``W`` orthogonal, so ``dev' dev'^T`` is the Gram's eigendecomposition (row norms^2 =
    eigenvalues), the basis rows are ``dev'_r / |dev'_r|`` and the projections of the keys on them
    are ``W[r, t] |dev'_r|`` (``dev = W^T dev'``). Rotation angles by :func:`_pair_rotation`, norms
    tracked in closed form; only the pair products are reduced across lanes (8 sums per step); the
    row swaps are register moves. Returns the eigenvalues ``[BP, S]`` (exact row norms^2) and their
    descending ranks."""
    tl.static_assert(S == 16, "the XOR pairings swap four row-index bits: S = 16")
    H: tl.constexpr = D // 2
    ii = tl.arange(0, S)
    w = tl.zeros([BP, S, S], tl.float32) + (ii[:, None] == ii[None, :]).to(tl.float32)[None, :, :]
    lam = tl.sum(de * de, axis=2) + tl.sum(do * do, axis=2)  # [BP, S]
    for _sweep in range(n_sweeps):
        for m in tl.static_range(1, S):
            de, do, w, lam = _onesided_step(de, do, w, lam, m, BP, S, H)
    lam = tl.sum(de * de, axis=2) + tl.sum(do * do, axis=2)  # exact norms of the rotated rows
    rank = _descending_rank(lam, ii)
    floor = floor2 * tl.max(lam, axis=1)
    rr = tl.arange(0, R)
    coefs = tl.zeros([BP, S, R], tl.float32)
    for r in tl.static_range(R):
        oh = (rank == r).to(tl.float32)  # [BP, S]
        lam_r = tl.sum(lam * oh, axis=1)
        keep = (lam_r > floor) & (floor >= 0.0)
        sig = tl.sqrt(lam_r)
        inv = tl.where(keep & (sig > 0.0), 1.0 / tl.where(sig > 0.0, sig, 1.0), 0.0)
        be = tl.sum(de * oh[:, :, None], axis=1) * inv[:, None]  # [BP, D/2] basis row r (even dims)
        bo = tl.sum(do * oh[:, :, None], axis=1) * inv[:, None]
        wr = tl.sum(w * oh[:, :, None], axis=1)  # [BP, S tokens] = W[r, t]
        cr = wr * tl.where(keep, sig, 0.0)[:, None]
        coefs += cr[:, :, None] * (rr == r).to(tl.float32)[None, None, :]
        _store_basis_row(be, bo, ph, r, ok, j[None, :], basis_ptr, bscale_ptr, D, R)
    _store_coefs(coefs, ph, ok, s_idx, rr, coef_ptr, cscale_ptr, S, R)
    return lam, rank


@triton.jit
def _store_basis_row(be, bo, ph, r, ok, j, basis_ptr, bscale_ptr, D: tl.constexpr, R: tl.constexpr):
    """int4 basis rows ``[..., D/2]`` (even/odd dims) with float16 scales rounded up, at rank slots ``r``."""
    amax = tl.maximum(tl.max(tl.abs(be), axis=-1), tl.max(tl.abs(bo), axis=-1))
    sc16, sc = _scale_up(amax / 7.0)
    qe = tl.minimum(tl.maximum(_rint(be / tl.expand_dims(sc, -1)), -7.0), 7.0).to(tl.int32)
    qo = tl.minimum(tl.maximum(_rint(bo / tl.expand_dims(sc, -1)), -7.0), 7.0).to(tl.int32)
    byte = ((qe & 15) | ((qo & 15) << 4)).to(tl.uint8)
    tl.store(basis_ptr + tl.expand_dims(ph * R + r, -1) * (D // 2) + j, byte, mask=tl.expand_dims(ok, -1))
    tl.store(bscale_ptr + ph * R + r, sc16, mask=ok)


@triton.jit
def _store_coefs(coefs, ph, ok, s_idx, rr, coef_ptr, cscale_ptr, S: tl.constexpr, R: tl.constexpr):
    """int8 coefficients ``coefs [BP, S, RC]`` (columns ``rr``; those >= R are zero and not stored),
    one float16 scale per token."""
    cs16, cs = _scale_up(tl.max(tl.abs(coefs), axis=2) / 127.0)  # [BP, S]
    cq = tl.minimum(tl.maximum(_rint(coefs / cs[:, :, None]), -127.0), 127.0).to(tl.int8)
    tl.store(coef_ptr + ph[:, None, None] * (S * R) + s_idx[None, :, None] * R + rr[None, None, :], cq,
             mask=ok[:, None, None] & (rr < R)[None, None, :])
    tl.store(cscale_ptr + ph[:, None] * S + s_idx[None, :], cs16, mask=ok[:, None])


@triton.jit
def _basis_coefs_loop(de, do, v, lam, rank, floor, ph, ok, j, s_idx, basis_ptr, bscale_ptr, coef_ptr, cscale_ptr,
                      BP: tl.constexpr, S: tl.constexpr, D: tl.constexpr, R: tl.constexpr):
    """Basis ``v_r = dev^T u_r / |.|`` and coefficients ``dev v_r``, one rank at a time (exact float32
    reductions)."""
    rr = tl.arange(0, R)
    coefs = tl.zeros([BP, S, R], tl.float32)
    for r in tl.static_range(R):
        oh = (rank == r).to(tl.float32)
        u = tl.sum(v * oh[:, None, :], axis=2)  # [BP, S] eigenvector of the r-th eigenvalue
        keep = (tl.sum(lam * oh, axis=1) > floor) & (floor >= 0.0)
        be = tl.sum(de * u[:, :, None], axis=1)  # [BP, D/2] = dev^T u (even dims)
        bo = tl.sum(do * u[:, :, None], axis=1)
        nrm = tl.sqrt(tl.sum(be * be, axis=1) + tl.sum(bo * bo, axis=1))
        inv = tl.where(keep & (nrm > 0.0), 1.0 / tl.where(nrm > 0.0, nrm, 1.0), 0.0)
        be = be * inv[:, None]
        bo = bo * inv[:, None]
        cr = tl.sum(de * be[:, None, :], axis=2) + tl.sum(do * bo[:, None, :], axis=2)  # [BP, S]
        coefs += cr[:, :, None] * (rr == r).to(tl.float32)[None, None, :]
        _store_basis_row(be, bo, ph, r, ok, j[None, :], basis_ptr, bscale_ptr, D, R)
    _store_coefs(coefs, ph, ok, s_idx, rr, coef_ptr, cscale_ptr, S, R)


@triton.jit
def _basis_coefs_dots(de, do, v, lam, rank, floor, ph, ok, j, s_idx, basis_ptr, bscale_ptr, coef_ptr, cscale_ptr,
                      BP: tl.constexpr, S: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                      PRECISION: tl.constexpr):
    """:func:`_basis_coefs_loop` for all ranks at once: eigenvectors sorted by a gather, then basis
    ``U^T dev`` and coefficients ``dev B^T`` as batched ``tl.dot``s (``tf32x3`` on the GPU) over S
    rank slots, those >= R (and dropped directions) zeroed."""
    ii = tl.arange(0, S)
    order = tl.sum(tl.where(rank[:, :, None] == ii[None, None, :], ii[None, :, None], 0), axis=1)  # [BP, S]
    vs = tl.gather(v, tl.broadcast_to(order[:, None, :], (BP, S, S)), 2)  # column r: r-th eigenvector
    keep = (tl.gather(lam, order, 1) > floor[:, None]) & (floor >= 0.0)[:, None] & (ii < R)[None, :]
    ut = tl.permute(vs, (0, 2, 1))
    be = tl.dot(ut, de, input_precision=PRECISION)  # [BP, S, D/2]: row r = dev^T u_r (even dims)
    bo = tl.dot(ut, do, input_precision=PRECISION)
    nrm = tl.sqrt(tl.sum(be * be, axis=2) + tl.sum(bo * bo, axis=2))  # [BP, S]
    inv = tl.where(keep & (nrm > 0.0), 1.0 / tl.where(nrm > 0.0, nrm, 1.0), 0.0)
    be = be * inv[:, :, None]
    bo = bo * inv[:, :, None]
    coefs = tl.dot(de, tl.permute(be, (0, 2, 1)), input_precision=PRECISION)  # [BP, S tokens, S slots]
    coefs = tl.dot(do, tl.permute(bo, (0, 2, 1)), acc=coefs, input_precision=PRECISION)
    rows = tl.minimum(ii, R - 1)[None, :]  # slots >= R masked out below
    _store_basis_row(be, bo, ph[:, None], rows, ok[:, None] & (ii < R)[None, :], j[None, None, :], basis_ptr,
                     bscale_ptr, D, R)
    _store_coefs(coefs, ph, ok, s_idx, ii, coef_ptr, cscale_ptr, S, R)


@triton.jit
def _build_kernel(k_ptr, stride_kp, stride_ks, stride_kh, ids_ptr, n_items, Hkv, bt_ptr, stride_bt,
                  basis_ptr, bscale_ptr, coef_ptr, cscale_ptr, cen_ptr, censcale_ptr, eig_ptr, n_sweeps,
                  floor2, S: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BP: tl.constexpr,
                  INCREMENTAL: tl.constexpr, WRITE_EIG: tl.constexpr, PRECISION: tl.constexpr,
                  ROT: tl.constexpr = 0, FINISH: tl.constexpr = 0,
                  RELOAD_VOLATILE: tl.constexpr = False):
    it = tl.program_id(0) * BP + tl.arange(0, BP)
    im = it < n_items
    i = it // Hkv
    h = it % Hkv
    if INCREMENTAL:  # ids_ptr = seq_lens: the page the last token filled, if it filled one
        n = tl.load(ids_ptr + i, mask=im, other=0)
        filled = im & (n > 0) & (n % S == 0)
        phys = tl.load(bt_ptr + i.to(tl.int64) * stride_bt + tl.maximum(n // S - 1, 0), mask=filled, other=-1)
    else:
        phys = tl.load(ids_ptr + i, mask=im, other=-1)
    ok = phys >= 0
    if tl.max(ok.to(tl.int32), axis=0) > 0:  # skip the solver when no item has a page (most decode steps)
        ph = tl.maximum(phys, 0).to(tl.int64) * Hkv + h  # store record (page, head)
        base = tl.maximum(phys, 0).to(tl.int64) * stride_kp + h * stride_kh
        s_idx = tl.arange(0, S)
        j = tl.arange(0, D // 2)
        de, do, mue, muo = _dev_halves(k_ptr, base, ok, s_idx, j, stride_ks, S)
        if ROT == 5:
            lam, rank = _build_onesided(de, do, n_sweeps, floor2, ph, ok, j, s_idx, basis_ptr, bscale_ptr,
                                        coef_ptr, cscale_ptr, BP, S, D, R)
            if WRITE_EIG:
                tl.store(eig_ptr + it[:, None].to(tl.int64) * S + rank, lam, mask=im[:, None])
        else:
            _build_twosided(de, do, n_sweeps, floor2, ph, ok, j, s_idx, it, im, base, k_ptr, stride_ks, eig_ptr,
                            basis_ptr, bscale_ptr, coef_ptr, cscale_ptr, S, D, R, BP, WRITE_EIG, PRECISION, ROT,
                            FINISH, RELOAD_VOLATILE)
        ms16, ms = _scale_up(tl.maximum(tl.max(tl.abs(mue), axis=1), tl.max(tl.abs(muo), axis=1)) / 127.0)
        ce = tl.minimum(tl.maximum(_rint(mue / ms[:, None]), -127.0), 127.0).to(tl.int8)
        co = tl.minimum(tl.maximum(_rint(muo / ms[:, None]), -127.0), 127.0).to(tl.int8)
        tl.store(cen_ptr + ph[:, None] * D + 2 * j[None, :], ce, mask=ok[:, None])
        tl.store(cen_ptr + ph[:, None] * D + 2 * j[None, :] + 1, co, mask=ok[:, None])
        tl.store(censcale_ptr + ph, ms16, mask=ok)


@triton.jit
def _build_twosided(de, do, n_sweeps, floor2, ph, ok, j, s_idx, it, im, base, k_ptr, stride_ks, eig_ptr,
                    basis_ptr, bscale_ptr, coef_ptr, cscale_ptr, S: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                    BP: tl.constexpr, WRITE_EIG: tl.constexpr, PRECISION: tl.constexpr, ROT: tl.constexpr,
                    FINISH: tl.constexpr, RELOAD_VOLATILE: tl.constexpr):
    """Gram, two-sided Jacobi (``ROT`` 0-4), basis and coefficients (``FINISH``)."""
    a = tl.dot(de, tl.permute(de, (0, 2, 1)), input_precision=PRECISION)
    a = tl.dot(do, tl.permute(do, (0, 2, 1)), acc=a, input_precision=PRECISION)  # Gram [BP, S, S]
    a = 0.5 * (a + tl.permute(a, (0, 2, 1)))
    ii = tl.arange(0, S)
    eye = (ii[:, None] == ii[None, :]).to(tl.float32)
    v = tl.zeros([BP, S, S], tl.float32) + eye[None, :, :]
    if ROT == 1:
        a, v, lam = _jacobi_dots(a, v, eye, n_sweeps, BP, S, PRECISION)
    elif ROT == 2:
        a, v, lam = _jacobi_lean(a, v, eye, n_sweeps, BP, S)
    elif ROT == 3:
        a, v, lam = _jacobi_xor(a, v, eye, n_sweeps, BP, S, False)
    elif ROT == 4:
        a, v, lam = _jacobi_xor(a, v, eye, n_sweeps, BP, S, True)
    else:
        a, v = _jacobi_gathers(a, v, eye, n_sweeps, BP, S)
        lam = tl.sum(a * eye[None, :, :], axis=2)  # [BP, S] eigenvalues, eigenvectors = columns of v
    rank = _descending_rank(lam, ii)
    if WRITE_EIG:
        tl.store(eig_ptr + it[:, None].to(tl.int64) * S + rank, lam, mask=im[:, None])
    floor = floor2 * tl.max(lam, axis=1)
    # reloaded; as a volatile load with a register cap (RELOAD_VOLATILE), else the compiler merges it
    # with the first and keeps those values live through the solver (uncapped that costs nothing)
    de, do, mue, muo = _dev_halves(k_ptr, base, ok, s_idx, j, stride_ks, S, RELOAD_VOLATILE)
    if FINISH == 1:
        _basis_coefs_dots(de, do, v, lam, rank, floor, ph, ok, j, s_idx, basis_ptr, bscale_ptr, coef_ptr,
                          cscale_ptr, BP, S, D, R, PRECISION)
    else:
        _basis_coefs_loop(de, do, v, lam, rank, floor, ph, ok, j, s_idx, basis_ptr, bscale_ptr, coef_ptr,
                          cscale_ptr, BP, S, D, R)


# Bulk builds on CUDA tune items per program, warps and a register cap once per shape (the kernel
# rewrites its outputs, so re-running it while tuning is harmless); incremental builds keep a fixed
# launch. Fewer items and warps per program won for the lean rotations on the H200 (per llama3-8b
# layer at 1M: 1 x 1: 37 ms, 2 x 2: 55, 4 x 4: 63, 8 x 8: 91). Uncapped, a 1-warp program takes 255
# registers (the Gram's tf32x3 operands), so an SM holds 8 of them and each scheduler has 2 warps to
# hide the solver's shuffle and shared-memory latency; capped at 144 (or 128) the solver loop still
# spills nothing (sm_90 SASS; spills only before and after it) and 14 fit (then shared memory, 16 KB
# per program, is the limit).
# ``REGISTER_CAPS`` (prepared, off until measured on the GPU) adds the capped launches to the tuning.
_BUILD_CONFIGS = [triton.Config({"BP": bp}, num_warps=w) for bp, w in ((1, 1), (1, 2), (2, 1), (2, 2), (4, 4))]
_CAPPED_CONFIGS = [triton.Config({"BP": 1, "RELOAD_VOLATILE": True}, num_warps=1, maxnreg=m) for m in (144, 128)]
_TUNE_KEY = ["Hkv", "S", "D", "R", "WRITE_EIG", "ROT", "FINISH"]
_build_tuned = triton.autotune(_BUILD_CONFIGS, key=_TUNE_KEY)(_build_kernel)
_build_tuned_caps = triton.autotune(_BUILD_CONFIGS + _CAPPED_CONFIGS, key=_TUNE_KEY)(_build_kernel)
REGISTER_CAPS = False
# how Jacobi rotates: _jacobi_gathers / _dots / _lean / _xor (runtime loop) / _xor (steps unrolled) on the
# Gram, or _build_onesided on the keys (no Gram; its own basis/coefficients: FINISH does not apply)
ROTATIONS = {"gathers": 0, "dots": 1, "lean": 2, "xor": 3, "xor_unrolled": 4, "onesided": 5}
ROTATION = "lean"
FINISHES = {"loop": 0, "dots": 1}  # basis and coefficients: _basis_coefs_loop / _basis_coefs_dots
FINISH = "loop"  # "dots": prepared, off until measured on the GPU


def _rot(rotation: str | None) -> int:
    rotation = ROTATION if rotation is None else rotation
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r}: allowed {tuple(ROTATIONS)}")
    return ROTATIONS[rotation]


def _launch(k_cache, store, ids, n_items, table, incremental, eig=None, sweeps=SWEEPS, rotation=None, launch=None,
            finish=None):
    _, s, hkv, d = k_cache.shape
    rot = _rot(rotation)
    finish = FINISH if finish is None else finish
    if finish not in FINISHES:
        raise ValueError(f"finish={finish!r}: allowed {tuple(FINISHES)}")
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache needs a contiguous last dim")
    prec = "tf32x3" if k_cache.is_cuda else "ieee"
    tb = table if table is not None else ids
    tuned = k_cache.is_cuda and not incremental and not launch
    kernel = (_build_tuned_caps if REGISTER_CAPS else _build_tuned) if tuned else _build_kernel
    launch = {} if tuned else dict(launch or {"BP": 4 if k_cache.is_cuda else 2, "num_warps": 4})
    if "maxnreg" in launch:  # capped: reload the keys after the solver rather than keep them live
        launch.setdefault("RELOAD_VOLATILE", True)
    kernel[lambda meta: (triton.cdiv(max(n_items, 1), meta["BP"]),)](
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ids, n_items, hkv, tb,
        tb.stride(0) if table is not None else 0, store.basis, store.basis_scale, store.coef, store.coef_scale,
        store.centroid, store.centroid_scale, eig if eig is not None else store.coef_scale, sweeps, REL_FLOOR**2,
        S=s, D=d, R=store.rank, INCREMENTAL=incremental, WRITE_EIG=eig is not None, PRECISION=prec, ROT=rot,
        FINISH=FINISHES[finish],
        **launch,
    )


def build_pages(k_cache: torch.Tensor, store: PagedSummaries, page_ids: torch.Tensor, *, eig=None,
                sweeps: int = SWEEPS, rotation: str | None = None, launch: dict | None = None,
                finish: str | None = None) -> None:
    """Build the summaries of physical pages ``page_ids [N]`` int32 (-1 = skip), all KV heads.

    k_cache : ``[num_pages, S, Hkv, D]``; writes ``store`` at those page ids. ``eig``: optional
    float32 ``[N * Hkv, S]`` receiving each page's Gram eigenvalues in descending order.
    ``rotation``: a key of :data:`ROTATIONS`; None = :data:`ROTATION`. ``launch``: fixed ``BP`` /
    ``num_warps`` instead of the autotuned launch (CUDA bulk builds). ``finish``: a key of
    :data:`FINISHES` (how basis and coefficients are formed); None = :data:`FINISH`.
    """
    _launch(k_cache, store, page_ids, page_ids.numel() * k_cache.shape[2], None, False, eig, sweeps, rotation,
            launch, finish)


def build_new_pages(k_cache: torch.Tensor, store: PagedSummaries, block_table: torch.Tensor,
                    seq_lens: torch.Tensor) -> None:
    """Incremental build during decode: for each sequence whose length is a positive multiple of S
    (its last page just filled), build that page. Grid ``B * Hkv`` items; no host sync."""
    _launch(k_cache, store, seq_lens, seq_lens.numel() * k_cache.shape[2], block_table, True)


def build_summaries(keys: torch.Tensor, config: LocksConfig, *, rotation: str | None = None,
                    finish: str | None = None) -> PageSummaries:
    """Same as :func:`kvlocks.summary.build.build_summaries` (int4/int8): ``[..., P, S, D]`` pages."""
    check_kernel_config(config, keys.shape[-1])
    *lead, p, s, d = keys.shape
    rows = 1
    for x in lead:
        rows *= x
    cache = keys.reshape(rows * p, s, 1, d)
    store = PagedSummaries.empty(rows * p, 1, d, config, device=keys.device)
    eig = torch.zeros(rows * p, s, device=keys.device)
    ids = torch.arange(rows * p, dtype=torch.int32, device=keys.device)
    if rows * p:
        build_pages(cache, store, ids, eig=eig, rotation=rotation, finish=finish)
    lam = eig.clamp_min(0.0).view(*lead, p, s)
    r = config.rank
    kept = lam[..., :r] > (REL_FLOOR**2) * lam[..., :1]
    tau = lam[..., r:].sum(-1) + (lam[..., :r] * ~kept).sum(-1)

    def unflat(t):
        return t.reshape(*lead, p, *t.shape[2:])

    return PageSummaries(
        page_size=s, rank=r, head_dim=d, basis_bits=4, coef_bits=8,
        basis=unflat(store.basis), basis_scale=unflat(store.basis_scale), coef=unflat(store.coef),
        coef_scale=unflat(store.coef_scale), centroid=unflat(store.centroid),
        centroid_scale=unflat(store.centroid_scale), tau=tau, sigma=lam[..., : min(s, r + 1)].sqrt(),
    )
