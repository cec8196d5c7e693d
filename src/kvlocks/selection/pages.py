"""Helpers shared by the selectors: full-page views, padding masks, sub-page blocks, fake quant.

Shapes use ``...`` for leading dims such as ``[Hkv]`` or ``[B, Hkv]``; Pc is the number of full
pages, S the page size, G the GQA group size.
"""

from __future__ import annotations

import torch

from kvlocks.pages import full_pages as full_page_count
from kvlocks.summary.quant import quantize

NEG_INF = float("-inf")
SUMMARY_BITS = (8, 16, 32)  # int8 (symmetric, float16 scales), float16, float32 (unquantized)


def page_mask(token_mask: torch.Tensor | None, page_size: int, pc: int) -> torch.Tensor | None:
    """Bool ``[..., N]`` token mask -> ``[..., Pc, S]`` over the full pages (None stays None)."""
    if token_mask is None:
        return None
    return token_mask[..., : pc * page_size].unflatten(-1, (pc, page_size))  # [..., Pc, S]


def full_pages(keys: torch.Tensor, page_size: int) -> torch.Tensor:
    """Keys ``[..., N, D]`` -> float32 ``[..., Pc, S, D]`` (the trailing partial page dropped)."""
    pc = full_page_count(keys.shape[-2], page_size)
    return keys[..., : pc * page_size, :].float().unflatten(-2, (pc, page_size))


def token_weights(pmask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Float32 ``[..., Pc, S]`` weights: 1 for real tokens, 0 for padding; ``like`` is ``[..., Pc, S, D]``."""
    if pmask is None:
        return torch.ones(like.shape[:-1], dtype=torch.float32, device=like.device)
    return pmask.float().expand(like.shape[:-1])


def mask_empty_pages(scores: torch.Tensor, pmask: torch.Tensor | None) -> torch.Tensor:
    """Scores ``[..., G, Pc]``: pages without a real token become ``-inf`` (never chosen by score)."""
    if pmask is None:
        return scores
    empty = ~pmask.any(dim=-1)  # [..., Pc]
    return scores.masked_fill(empty.unsqueeze(-2), NEG_INF)


def masked_page_lse(logits: torch.Tensor, pmask: torch.Tensor | None) -> torch.Tensor:
    """Log-sum-exp over each page's real tokens: logits ``[..., G, Pc, S]`` -> ``[..., G, Pc]``."""
    if pmask is not None:
        logits = logits.masked_fill(~pmask.unsqueeze(-3), NEG_INF)
    return torch.logsumexp(logits, dim=-1)


def block_bounds(page_size: int, blocks: int) -> list[tuple[int, int]]:
    """Split ``S`` tokens into ``blocks`` contiguous blocks as evenly as possible.

    Token ``t`` lies in block ``floor(t * blocks / S)``, i.e. block ``b`` is
    ``[ceil(b * S / blocks), ceil((b + 1) * S / blocks))``.
    """
    edges = [-(-b * page_size // blocks) for b in range(blocks + 1)]
    return list(zip(edges[:-1], edges[1:]))


def check_bits(owner: str, bits: int, allowed: tuple[int, ...] = SUMMARY_BITS) -> None:
    if isinstance(bits, bool) or bits not in allowed:
        raise ValueError(f"{owner}.bits={bits!r}: allowed {allowed}")


def check_rank(owner: str, rank: int | None, low: int = 1) -> None:
    if rank is None:
        return
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < low:
        raise ValueError(f"{owner}.rank={rank!r}: must be None (matched bytes) or an integer >= {low}")


def fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round ``x`` to what a summary stored at ``bits`` holds, as float32.

    8: symmetric int8 with one float16 scale per row (last dim); 16: float16; 32: unchanged.
    """
    x = x.float()
    if bits == 32:
        return x
    if bits == 16:
        return x.half().float()
    q, scale = quantize(x, 8, dim=-1)  # scale [...]
    return q.float() * scale.float().unsqueeze(-1)


def scale_bytes(bits: int, rows: int) -> int:
    """Float16 scale bytes of ``rows`` int8 rows (0 for float storage)."""
    return 2 * rows if bits == 8 else 0
