"""Small helpers shared by the compaction modules: default scale, logits, input checks."""

from __future__ import annotations

import math

import torch


def default_scale(head_dim: int, scale: float | None) -> float:
    """``scale`` if given, else ``1/sqrt(head_dim)``; must be finite and > 0."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale={scale!r}: must be a finite number > 0")
    return float(scale)


def logits(q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None = None,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Attention logits ``q k^T * scale + bias`` computed in ``dtype``.

    Parameters
    ----------
    q : Tensor [n, D], any float dtype
    k : Tensor [t, D], any float dtype
    scale : float
    bias : Tensor [t] or None
        Per-key logit bias, added to every query's row.
    dtype : torch.dtype
        Compute dtype (float32 or float64).

    Returns
    -------
    Tensor [n, t], ``dtype``
    """
    out = (q.to(dtype) @ k.to(dtype).T).mul_(scale)  # [n, t]; in place: n x T can be 64 MB
    if bias is not None:
        out.add_(bias.to(dtype)[None, :])
    return out


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` if ``x`` holds NaN or Inf."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} contains {bad} NaN/Inf values; inputs must be finite")


def check_matrix(name: str, x, cols: int | None = None) -> None:
    """Raise ``ValueError`` unless ``x`` is a finite floating 2-D tensor (with ``cols`` columns)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if cols is not None and x.shape[1] != cols:
        raise ValueError(f"{name} must have {cols} columns, got shape {tuple(x.shape)}")
    check_finite(name, x)
