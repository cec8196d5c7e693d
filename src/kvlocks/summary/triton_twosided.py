"""The two-sided ("lean") solver of the summary build (:mod:`kvlocks.summary.triton`): the page's Gram
``dev dev^T`` diagonalised by parallel cyclic two-sided Jacobi (each rotation applied to its rows and
columns; round-robin pairings, the rotations applied by gathers, the diagonal tracked in closed
form), then the basis ``v_r = dev^T u_r / |.|`` and the
coefficients ``dev v_r``, one rank at a time.

Variants timed on the H200 and not kept (whole model at 1M, llama3-8b / glm4-9b-1m, s;
docs/benchmarks.md): four masked reductions per step instead of the tracked diagonal 2.51 / 1.57
against 1.18 / 0.75; rotations as batched dots 2.29 / 1.44; XOR pairings and the basis and
coefficients as batched dots, with or without a register cap, 1.17-1.35 / 0.74-0.85 against 1.18 /
0.75."""

from __future__ import annotations

import triton
import triton.language as tl

from kvlocks.summary.triton_pages import _descending_rank, _dev_halves, _store_basis_row, _store_coefs


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
    """Cyclic parallel Jacobi with :func:`_tracked_step` (one masked reduction over the tile per
    step), rotations applied by gathers (exact float32). Returns (A, V, tracked eigenvalues)."""
    ii = tl.arange(0, S)
    diag = tl.sum(a * eye[None, :, :], axis=2)  # [BP, S]
    for _sweep in range(n_sweeps):
        for t in range(S - 1):
            part, _ = _pairs(t, ii, S)
            _, c, sg, diag = _tracked_step(a, diag, part, ii, BP, S)
            a, v = _rotate_by_gathers(a, v, c, sg, part, BP, S)
    return a, v, diag


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
def _build_lean(de, do, n_sweeps, floor2, ph, ok, j, s_idx, it, im, base, k_ptr, stride_ks, eig_ptr,
                basis_ptr, bscale_ptr, coef_ptr, cscale_ptr, S: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                BP: tl.constexpr, WRITE_EIG: tl.constexpr, PRECISION: tl.constexpr):
    """Gram, two-sided Jacobi, basis and coefficients."""
    a = tl.dot(de, tl.permute(de, (0, 2, 1)), input_precision=PRECISION)
    a = tl.dot(do, tl.permute(do, (0, 2, 1)), acc=a, input_precision=PRECISION)  # Gram [BP, S, S]
    a = 0.5 * (a + tl.permute(a, (0, 2, 1)))
    ii = tl.arange(0, S)
    eye = (ii[:, None] == ii[None, :]).to(tl.float32)
    v = tl.zeros([BP, S, S], tl.float32) + eye[None, :, :]
    a, v, lam = _jacobi_lean(a, v, eye, n_sweeps, BP, S)
    rank = _descending_rank(lam, ii)
    if WRITE_EIG:
        tl.store(eig_ptr + it[:, None].to(tl.int64) * S + rank, lam, mask=im[:, None])
    floor = floor2 * tl.max(lam, axis=1)
    # reloaded: the compiler merges this load with the first and keeps the keys live through the solver
    de, do, mue, muo = _dev_halves(k_ptr, base, ok, s_idx, j, stride_ks, S)
    _basis_coefs_loop(de, do, v, lam, rank, floor, ph, ok, j, s_idx, basis_ptr, bscale_ptr, coef_ptr,
                      cscale_ptr, BP, S, D, R)
