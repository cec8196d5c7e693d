"""Page input and summary output of the summary-build kernels (:mod:`kvlocks.summary.triton`): the
centred keys of a page as even/odd halves of D, the eigenvalue ranking, and the int4/int8 quantized
stores with float16 scales rounded up (round-half-even like ``torch.round``)."""

from __future__ import annotations

import triton
import triton.language as tl


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
def _dev_halves(k_ptr, base, ok, s_idx, j, stride_ks, S: tl.constexpr):
    """Centred keys of BP pages as even/odd halves of D: ``[BP, S, D/2]`` each, and the means."""
    ptr = k_ptr + base[:, None, None] + s_idx[None, :, None] * stride_ks + 2 * j[None, None, :]
    ke = tl.load(ptr, mask=ok[:, None, None], other=0.0).to(tl.float32)
    ko = tl.load(ptr + 1, mask=ok[:, None, None], other=0.0).to(tl.float32)
    mue = tl.sum(ke, axis=1) / S
    muo = tl.sum(ko, axis=1) / S
    return ke - mue[:, None, :], ko - muo[:, None, :], mue, muo


@triton.jit
def _descending_rank(lam, ii):
    """Position of each eigenvalue of ``lam [BP, S]`` in descending order (ties: lower index first)."""
    return tl.sum(((lam[:, None, :] > lam[:, :, None]) |
                   ((lam[:, None, :] == lam[:, :, None]) & (ii[None, None, :] < ii[None, :, None]))).to(tl.int32),
                  axis=2)


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
