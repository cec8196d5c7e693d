"""The one-sided solver of the summary build (:mod:`kvlocks.summary.triton`, ``"onesided"``): Hestenes
Jacobi on the centred keys themselves, the rows rotated in XOR pairs until orthogonal (no Gram), the
coefficients from the accumulated rotations."""

from __future__ import annotations

import triton
import triton.language as tl

from kvlocks.summary.triton_pages import _descending_rank, _store_basis_row, _store_coefs


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
