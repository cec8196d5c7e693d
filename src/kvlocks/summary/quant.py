"""Symmetric integer quantization with float16 scales, and sub-byte packing.

A value ``x`` in a slice with scale ``s`` is stored as ``q = round(x / s)`` clamped to
``[-qmax, qmax]`` with ``qmax = 2**(bits-1) - 1`` (int8: 127, int4: 7, int2: 1). The stored scale
is rounded *up* to float16, so ``|x - q * s| <= s / 2`` holds exactly for the stored ``s``; that
is the analytic bound the tests check.
"""

from __future__ import annotations

import torch

FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # smallest positive float16 (subnormal)


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def _fp16_round_up(s: torch.Tensor) -> torch.Tensor:
    """Float16 copy of positive fp32 ``s`` that is never below ``s`` (and never zero)."""
    if bool((s > FP16_MAX).any()):
        raise ValueError(
            f"quantization scale {float(s.max()):.3g} exceeds the float16 range; "
            "key magnitudes this large are not supported"
        )
    h = s.clamp_min(FP16_TINY).to(torch.float16)
    low = h.float() < s
    if bool(low.any()):
        h = torch.where(low, torch.nextafter(h, torch.full_like(h, torch.inf)), h)
    return h


def quantize(x: torch.Tensor, bits: int, dim: int | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` symmetrically with one scale per slice that reduces over ``dim``.

    Returns ``(q, scale)``: ``q`` int8 with the shape of ``x`` (values within ``±qmax(bits)``),
    ``scale`` float16 with ``dim`` reduced (keepdim=False).
    """
    x = x.float()
    m = qmax(bits)
    amax = x.abs().amax(dim=dim, keepdim=True)
    scale = _fp16_round_up(amax / m)  # keepdim shape
    q = torch.round(x / scale.float()).clamp_(-m, m).to(torch.int8)
    dims = (dim,) if isinstance(dim, int) else dim
    for d in sorted((d % x.dim() for d in dims), reverse=True):
        scale = scale.squeeze(d)
    return q, scale


def to_fp16_checked(name: str, x: torch.Tensor) -> torch.Tensor:
    """Float16 copy of ``x``; refuse values float16 cannot hold rather than storing Inf."""
    if x.numel() and float(x.abs().max()) > FP16_MAX:
        raise ValueError(f"{name} magnitude {float(x.abs().max()):.3g} exceeds the float16 range")
    return x.to(torch.float16)


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed ``bits``-bit integers (int8 tensor) along the last dim into uint8.

    ``bits`` in (2, 4): 4 or 2 values per byte, first value in the lowest bits.
    Last dim must be divisible by ``8 // bits``.
    """
    per = 8 // bits
    n = q.shape[-1]
    if n % per:
        raise ValueError(f"cannot pack {n} values at {bits} bits: last dim must be a multiple of {per}")
    mask = (1 << bits) - 1
    u = (q.to(torch.int16) & mask).to(torch.uint8).reshape(*q.shape[:-1], n // per, per)
    out = torch.zeros(u.shape[:-1], dtype=torch.uint8, device=q.device)
    for i in range(per):
        out |= u[..., i] << (bits * i)
    return out


def unpack_bits(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., n / per]`` to sign-extended int8 ``[..., n]``."""
    per = 8 // bits
    mask = (1 << bits) - 1
    sign = 1 << (bits - 1)
    parts = [((p >> (bits * i)) & mask).to(torch.int16) for i in range(per)]
    u = torch.stack(parts, dim=-1)
    s = torch.where(u >= sign, u - (1 << bits), u)
    return s.to(torch.int8).reshape(*p.shape[:-1], p.shape[-1] * per)
