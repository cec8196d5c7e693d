"""Quest baseline: a per-page, per-channel min/max envelope of the keys bounds every logit.

For a page (or a sub-page block) with channel-wise minimum ``m`` and maximum ``M`` of its keys,
every key ``k`` in it satisfies ``q.k <= sum_d max(q_d m_d, q_d M_d) = q+ . M + q- . m`` (``q+``,
``q-`` the positive and negative parts of ``q``). Quest ranks pages by that bound ``u`` (times the
softmax scale). We return ``u + log(n)`` with ``n`` the page's real tokens, which bounds the page's
log-sum-exp from above (``LSE <= max + log n``) and so is a log-mass like every other selector's
score; for full pages ``log n = log S`` is one constant and the per-head ranking is Quest's.

The envelope is what a deployed Quest keeps resident: ``2 * D`` values per page in the key dtype.
This reference recomputes it from ``view.keys`` each step (cheap on CPU, identical result); the
byte accounting counts the envelope, never the keys. Two knobs spend more or fewer bytes:

- ``bits``: ``None`` (key dtype, exact), 32, 16 (float16) or 8 (int8, one float16 scale per
  envelope). Rounding is outward (min down, max up), so the bound stays a bound.
- ``sub_pages``: envelopes per page, over ``sub_pages`` contiguous blocks of the page; the page
  scores ``logsumexp_b(u_b + log n_b)``, still an upper bound on its LSE.
"""

from __future__ import annotations

import math

import torch

from kvlocks.config import LocksConfig
from kvlocks.selection.pages import (
    NEG_INF, block_bounds, check_bits, full_pages, mask_empty_pages, page_mask,
)
from kvlocks_lab.selectors.matched_bytes import envelope_bytes

_INT8_MARGIN = 1.0 + 2.0**-20  # keeps |x / scale| strictly inside 127 after fp32 rounding


def _fp16_outward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """Float16 value of fp32 ``x`` rounded up (``up``) or down, returned as float32."""
    if x.numel() and float(x.abs().max()) > 65504.0:
        raise ValueError(f"Quest envelope magnitude {float(x.abs().max()):.3g} exceeds the float16 range")
    h = x.half()
    bad = h.float() < x if up else h.float() > x
    h = torch.where(bad, torch.nextafter(h, torch.full_like(h, math.inf if up else -math.inf)), h)
    return h.float()


def _int8_outward(kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 envelope with one float16 scale per ``[D]`` pair (min down, max up), as float32."""
    amax = torch.maximum(kmin.abs(), kmax.abs()).amax(dim=-1, keepdim=True)  # [..., 1]
    scale = _fp16_outward((amax / 127.0 * _INT8_MARGIN).clamp_min(2.0**-24), up=True)
    lo = torch.floor(kmin / scale)
    lo = torch.where(lo * scale > kmin, lo - 1, lo).clamp(-127, 127)  # fix fp32 division rounding
    hi = torch.ceil(kmax / scale)
    hi = torch.where(hi * scale < kmax, hi + 1, hi).clamp(-127, 127)
    return lo * scale, hi * scale


def page_envelopes(
    pages: torch.Tensor, pmask: torch.Tensor | None, sub_pages: int = 1, bits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Channel-wise min/max of each block's real keys, as stored at ``bits``.

    Parameters
    ----------
    pages : float32 ``[..., Pc, S, D]``
    pmask : bool ``[..., Pc, S]`` (True = real token) or None
    sub_pages : M, blocks per page
    bits : None (exact), 32, 16 or 8

    Returns
    -------
    kmin, kmax : float32 ``[..., Pc, M, D]`` (zeros for a block without real tokens)
    count : float32 ``[..., Pc, M]``, real tokens per block
    """
    mins, maxs, counts = [], [], []
    for a, b in block_bounds(pages.shape[-2], sub_pages):
        blk = pages[..., a:b, :]  # [..., Pc, s, D]
        if pmask is None:
            mins.append(blk.amin(dim=-2))
            maxs.append(blk.amax(dim=-2))
            counts.append(torch.full(blk.shape[:-2], float(b - a), device=pages.device))
        else:
            real = pmask[..., a:b].unsqueeze(-1)  # [..., Pc, s, 1]
            mins.append(blk.masked_fill(~real, math.inf).amin(dim=-2))
            maxs.append(blk.masked_fill(~real, -math.inf).amax(dim=-2))
            counts.append(pmask[..., a:b].float().sum(-1).expand(blk.shape[:-2]))
    kmin, kmax = torch.stack(mins, dim=-2), torch.stack(maxs, dim=-2)  # [..., Pc, M, D]
    count = torch.stack(counts, dim=-1)  # [..., Pc, M]
    empty = (count == 0).unsqueeze(-1)
    kmin, kmax = kmin.masked_fill(empty, 0.0), kmax.masked_fill(empty, 0.0)
    if bits == 16:
        kmin, kmax = _fp16_outward(kmin, up=False), _fp16_outward(kmax, up=True)
    elif bits == 8:
        kmin, kmax = _int8_outward(kmin, kmax)
    return kmin, kmax, count


def envelope_bound(queries: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float) -> torch.Tensor:
    """Quest's bound ``scale * sum_d max(q_d kmin_d, q_d kmax_d)``.

    queries ``[..., G, D]``, kmin/kmax ``[..., Pc, M, D]`` -> float32 ``[..., G, Pc, M]``.
    """
    q = queries.float()
    hi = torch.einsum("...gd,...pmd->...gpm", q.clamp_min(0.0), kmax)
    lo = torch.einsum("...gd,...pmd->...gpm", q.clamp_max(0.0), kmin)
    return (hi + lo) * scale


class QuestSelector:
    """Quest: page score = envelope upper bound on the max logit + log(real tokens).

    Parameters
    ----------
    bits : None (key dtype, the published Quest), 32, 16 or 8; see the module docstring
    sub_pages : envelopes per page (1 = the published Quest)
    """

    name = "quest"
    needs_summaries = False  # keeps its own envelope, not LOCKS summaries
    reads_all_keys = False

    def __init__(self, *, bits: int | None = None, sub_pages: int = 1) -> None:
        if bits is not None:
            check_bits("QuestSelector", bits)
        if isinstance(sub_pages, bool) or not isinstance(sub_pages, int) or sub_pages < 1:
            raise ValueError(f"QuestSelector.sub_pages={sub_pages!r}: must be an integer >= 1")
        self.bits = bits
        self.sub_pages = sub_pages

    def __repr__(self) -> str:
        return f"QuestSelector(bits={self.bits}, sub_pages={self.sub_pages})"

    def _check(self, config: LocksConfig) -> None:
        if self.sub_pages > config.page_size:
            raise ValueError(f"QuestSelector.sub_pages={self.sub_pages}: must be <= page_size={config.page_size}")

    def page_scores(self, queries: torch.Tensor, view, config: LocksConfig) -> torch.Tensor:
        """queries ``[..., G, D]`` -> float32 ``[..., G, Pc]``, upper bounds on each page's LSE."""
        self._check(config)
        pc = view.keys.shape[-2] // config.page_size
        pm = page_mask(view.token_mask, config.page_size, pc)
        kmin, kmax, count = page_envelopes(full_pages(view.keys, config.page_size), pm, self.sub_pages, self.bits)
        ub = envelope_bound(queries, kmin, kmax, view.scale)  # [..., G, Pc, M]
        logn = torch.where(count > 0, count.clamp_min(1.0).log(), NEG_INF).unsqueeze(-3)  # [..., 1, Pc, M]
        return mask_empty_pages(torch.logsumexp(ub + logn, dim=-1), pm)

    def bytes_per_page(self, config: LocksConfig, head_dim: int, elem_size: int) -> tuple[int, int]:
        """``(payload, scales)`` bytes of one page's envelopes, one KV head."""
        self._check(config)
        return envelope_bytes(head_dim, self.sub_pages, self.bits, elem_size)

    def selection_bytes(self, config: LocksConfig, head_dim: int, elem_size: int, full_pages: int) -> float:
        """Bytes read to score ``full_pages`` pages, one KV head."""
        return float(full_pages * sum(self.bytes_per_page(config, head_dim, elem_size)))


