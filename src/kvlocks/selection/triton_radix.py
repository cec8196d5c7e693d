"""The radix select of the page selection kernels (:mod:`kvlocks.selection.triton`,
:mod:`kvlocks.selection.fused`): order-preserving keys, the forced (sink and recent) pages, and the
digit passes that find the ``need`` largest keys of a tile without a sort, ties to the lower index.
"""

from __future__ import annotations

import triton
import triton.language as tl

DIGIT_BITS = 5  # radix digit width: seven passes over a 32-bit key, the last 2 bits wide
_BITS = tl.constexpr(DIGIT_BITS)  # kernels may read module globals only when they are constexpr


@triton.jit
def _orderkey(x):
    """float32 -> uint32 with the same order (-0.0 folded onto +0.0: torch ranks them as equal)."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, ~u, u | 0x80000000)


@triton.jit
def _forced(n, ss, S: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Page count and the forced ranges [s_lo, s_hi) (sink) and [r_lo, r_hi) (recent)."""
    total = (n + S - 1) // S
    s_lo = tl.minimum(ss, total)
    s_hi = tl.minimum(ss + SINK, total)
    r_lo = tl.maximum(total - RECENT, 0)
    overlap = tl.maximum(tl.minimum(s_hi, total) - tl.maximum(s_lo, r_lo), 0)
    f = (s_hi - s_lo) + (total - r_lo) - overlap
    return total, s_lo, s_hi, r_lo, f


@triton.jit
def _below(x, s_lo, s_hi, r_lo, total):
    """Number of forced pages with index < x (elementwise)."""
    a = tl.minimum(tl.maximum(x - s_lo, 0), s_hi - s_lo)
    c = tl.minimum(tl.maximum(x - r_lo, 0), total - r_lo)
    o_lo = tl.maximum(s_lo, r_lo)
    o = tl.minimum(tl.maximum(x - o_lo, 0), tl.maximum(s_hi - o_lo, 0))
    return a + c - o


@triton.jit
def _pick_digit(hist, remaining):
    """Digit d* holding the remaining-th largest key, how many keys lie in higher digits, and how
    many in d* itself (``hist``: 32 bins, one per 5-bit digit)."""
    d = tl.arange(0, 32)
    h = hist
    ge = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys with digit >= d
    dstar = tl.max(tl.where(ge >= remaining, d, -1), axis=0)
    above = tl.sum(tl.where(d > dstar, h, 0), axis=0)
    inside = tl.sum(tl.where(d == dstar, h, 0), axis=0)
    return dstar, above, inside


@triton.jit
def _digit(i):
    """Pass i's digit of a 32-bit key, from the top: (shift, mask); the seventh and last is 2 bits wide."""
    shift = tl.maximum(32 - _BITS * (i + 1), 0)
    width = tl.minimum(32 - _BITS * i, _BITS)
    return shift.to(tl.uint32), ((1 << width) - 1).to(tl.uint32)


@triton.jit
def _more_passes(i, n_in, remaining):
    """Another radix pass? While digits are left and the threshold digit holds more keys than are
    left to choose."""
    return (i < (32 + _BITS - 1) // _BITS) & (n_in > remaining)


@triton.jit
def _advance(hist, shift, dmask, remaining, prefix, kmask):
    """One radix pass from its digit histogram: (remaining, prefix, kmask, keys in the threshold digit)."""
    dstar, above, n_in = _pick_digit(hist, remaining)
    return remaining - above, prefix | (dstar.to(tl.uint32) << shift), kmask | (dmask << shift), n_in


@triton.jit
def _digit_hist(key, match, shift, dmask):
    """32-bin histogram of the keys' digit at ``shift`` over the keys where ``match``."""
    d = ((key >> shift) & dmask).to(tl.int32)
    return tl.histogram(d, 32, mask=match)


@triton.jit
def _rebase_params(key, valid):
    """(lo, shift) of :func:`_rebased` for the valid keys: their minimum, and the left shift that puts
    the highest bit of (max - min) at bit 31 (from the float32 exponent of max - min, which rounds
    to nearest: it can only overstate that bit, never understate it, so nothing is shifted out)."""
    lo = tl.min(tl.where(valid, key, 0xFFFFFFFF), axis=0)
    hi = tl.max(tl.where(valid, key, 0), axis=0)
    diff = tl.where(hi > lo, hi - lo, 0)
    e = ((diff.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(diff)), or one more
    shift = tl.where(diff > 0, tl.maximum(31 - e, 0), 0).to(tl.uint32)
    return lo, shift


@triton.jit
def _rebased(key, valid, lo, shift):
    """Order-preserving map of the valid keys onto the full 32 bits: ``(key - lo) << shift`` (equal keys
    stay equal); the radix passes' first digit then splits where the keys differ, not on the sign
    and exponent bits they share. Invalid keys map to 0."""
    return tl.where(valid, (key - lo) << shift, 0)


@triton.jit
def radix_threshold(key, valid, need):
    """(prefix, kmask, remaining): the ``need``-th largest valid key's leading digits. Selected are
    the valid keys with ``key & kmask > prefix`` and the first ``remaining`` (by index) with
    ``key & kmask == prefix``. The passes stop as soon as every key left in the threshold digit is
    selected (``kmask`` then covers only the digits fixed)."""
    remaining = tl.maximum(need, 1)
    prefix = tl.full([], 0, tl.uint32)
    kmask = tl.full([], 0, tl.uint32)
    n_in = tl.sum(valid.to(tl.int32), axis=0)  # valid keys matching the prefix so far
    i = 0
    while _more_passes(i, n_in, remaining):
        shift, dmask = _digit(i)
        remaining, prefix, kmask, n_in = _advance(
            _digit_hist(key, valid & ((key & kmask) == prefix), shift, dmask), shift, dmask, remaining, prefix,
            kmask)
        i += 1
    return prefix, kmask, remaining


@triton.jit
def top_positions(key, valid, need):
    """(sel, pos): the ``need`` largest valid keys (ties to the lower index) as a mask, and each
    selected key's position among the selected in index order (a prefix sum: where to store it).
    The passes run on :func:`_rebased` keys (the same order)."""
    lo, shift = _rebase_params(key, valid)
    rk = _rebased(key, valid, lo, shift)
    prefix, kmask, remaining = radix_threshold(rk, valid, need)
    km = rk & kmask
    is_t = valid & (km == prefix)
    tie_rank = tl.cumsum(is_t.to(tl.int32), axis=0) - 1
    sel = valid & ((km > prefix) | (is_t & (tie_rank < remaining))) & (tie_rank * 0 < need)
    return sel, tl.cumsum(sel.to(tl.int32), axis=0) - 1


@triton.jit
def chunk_winners(key, valid, offs, need, slot, ckey_ptr, cidx_ptr, ccnt_ptr, M: tl.constexpr):
    """Radix-select the ``need`` largest of ``key`` where ``valid`` (ties to the lower index) and write
    them, in page order, to chunk slot ``slot``: keys and page ids at ``slot * M``, the count at ``slot``.
    The passes run on :func:`_rebased` keys (the same order; the original keys are stored)."""
    sel, pos = top_positions(key, valid, need)
    tl.store(ckey_ptr + slot * M + pos, key.to(tl.int32, bitcast=True), mask=sel)
    tl.store(cidx_ptr + slot * M + pos, offs, mask=sel)
    tl.store(ccnt_ptr + slot, tl.sum(sel.to(tl.int32), axis=0))
