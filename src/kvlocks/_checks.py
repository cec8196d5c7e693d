"""Input validation shared by the public functions: clear errors instead of silent wrong answers.

Every check raises ``ValueError`` naming the argument, the value seen and what is allowed. The
metadata checks (type, dims, dtype, device) cost nothing; :func:`check_finite` is one reduction
over the tensor (a host sync), so hot internal paths call it only where the docs say so.
"""

from __future__ import annotations

import math
import numbers

import torch


def check_tensor(name: str, x, ndim_min: int, *, floating: bool = True) -> None:
    """Raise ``ValueError`` unless ``x`` is a tensor with at least ``ndim_min`` dims."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < ndim_min:
        raise ValueError(f"{name} must have at least {ndim_min} dims, got shape {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_index_tensor(name: str, x, ndim_min: int = 1) -> None:
    """Raise ``ValueError`` unless ``x`` is an integer (int32 / int64, ...) tensor, not bool."""
    check_tensor(name, x, ndim_min, floating=False)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor (int64 or int32), got dtype {x.dtype}")


def check_bool_tensor(name: str, x, shape: tuple[int, ...], shape_desc: str) -> None:
    """Raise ``ValueError`` unless ``x`` is a bool tensor of exactly ``shape``."""
    check_tensor(name, x, 0, floating=False)
    if x.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor (True = attend), got dtype {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {shape_desc} = {tuple(shape)}, got {tuple(x.shape)}")


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``x`` holds NaN or Inf (one reduction; cheap next to the math)."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} contains {bad} NaN/Inf values; inputs must be finite")


def check_same(what: str, a_name: str, a, b_name: str, b) -> None:
    if a != b:
        raise ValueError(f"{what} mismatch: {a_name}={a} but {b_name}={b}")


def check_same_device(**tensors) -> None:
    """Raise ``ValueError`` unless every tensor given (``None`` skipped) is on one device."""
    given = {k: t.device for k, t in tensors.items() if t is not None}
    if len(set(given.values())) > 1:
        seen = ", ".join(f"{k} on {d}" for k, d in given.items())
        raise ValueError(f"tensors must be on one device, got {seen}")


def check_nonempty(name: str, x: torch.Tensor, dim: int, what: str) -> None:
    """Raise ``ValueError`` if ``x.shape[dim]`` is 0 (``what`` names that dim, e.g. ``"G"``)."""
    if x.shape[dim] == 0:
        raise ValueError(f"{name} has {what}=0 (shape {tuple(x.shape)}); at least 1 is required")


def check_positive_int(name: str, value) -> int:
    """Return ``value`` if it is an int >= 1 (bool refused), else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    if value < 1:
        raise ValueError(f"{name}={value}: must be an integer >= 1")
    return value


def check_scale(scale) -> float | None:
    """``None`` (meaning ``1/sqrt(D)``) or a finite number > 0, returned as float."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale={scale!r}: must be None (1/sqrt(D)) or a finite number > 0")
    return float(scale)


def check_out(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``out`` if it can take a result shaped, typed and placed like ``like`` with a contiguous last
    dim (row and head strides free), else a ``ValueError`` naming what differs."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out must be {tuple(like.shape)} {like.dtype} on {like.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if out.stride(-1) != 1:
        raise ValueError(f"out needs a contiguous last dim, got strides {out.stride()}")
    return out
