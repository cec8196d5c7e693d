"""Input validation shared by the public functions: clear errors instead of silent wrong answers."""

from __future__ import annotations

import torch


def check_tensor(name: str, x, ndim_min: int, *, floating: bool = True) -> None:
    """Raise ``ValueError`` unless ``x`` is a tensor with at least ``ndim_min`` dims."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < ndim_min:
        raise ValueError(f"{name} must have at least {ndim_min} dims, got shape {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``x`` holds NaN or Inf (one reduction; cheap next to the math)."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} contains {bad} NaN/Inf values; inputs must be finite")


def check_same(what: str, a_name: str, a, b_name: str, b) -> None:
    if a != b:
        raise ValueError(f"{what} mismatch: {a_name}={a} but {b_name}={b}")
