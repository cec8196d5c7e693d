"""The scope ladder: within-page key energy captured at rank r by a per-page, a per-sequence and
a global basis, and the same at matched bytes.

For page j with centred deviations ``D_j [S, D]`` and a basis with orthonormal rows ``W [r, D]``,
the captured energy is ``||D_j W^T||_F^2 / ||D_j||_F^2``. For the page's own rank-r eigenbasis
that is ``1 - tau_{j,r} / ||D_j||_F^2`` (tau the spectral tail of Eq. 7), the best any rank-r
basis can do for that page. Pages with no variation (``||D_j|| = 0``) are left out.

Matched bytes: a per-page summary at rank r (int4 basis, int8 coefficients, int8 centroid)
costs :func:`~kvlocks.selection.locks_page_bytes`; a shared basis stores per page a centroid
and ``S x r'`` coefficients (int8, ShadowKV's layout), and ``r'`` is grown until its bytes
reach the per-page summary's (:func:`~kvlocks.selection.matched_settings`).
"""

from __future__ import annotations

import torch

from kvlocks.config import LocksConfig
from kvlocks_lab.fidelity.scopes import centred
from kvlocks_lab.selectors import locks_page_bytes, matched_settings
from kvlocks_lab.selectors.shadowkv import sequence_basis, shadowkv_bytes

_EMPTY = 1e-12  # squared-norm floor below which a page counts as constant


def page_energy_curve(dev: torch.Tensor) -> torch.Tensor:
    """Per-page basis: captured fraction at ranks ``1..S``; dev ``[..., P, S, D]`` -> ``[..., P, S]``."""
    evals = torch.linalg.eigvalsh(dev.double() @ dev.double().transpose(-1, -2)).flip(-1).clamp_min(0)  # [..., P, S]
    total = evals.sum(-1, keepdim=True)
    return (evals.cumsum(-1) / total.clamp_min(_EMPTY)).float()


def shared_energy_curve(dev: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Shared basis: captured fraction at ranks ``1..D``.

    dev ``[H, P, S, D]``, rotation ``[H, D, D]`` (row i = i-th direction) -> ``[H, P, D]``.
    """
    coef = dev.double() @ rotation.double().transpose(-1, -2).unsqueeze(1)  # [H, P, S, D]
    per_dir = (coef * coef).sum(-2)  # [H, P, D]
    total = (dev.double() ** 2).sum(dim=(-2, -1)).unsqueeze(-1)  # [H, P, 1]
    return (per_dir.cumsum(-1) / total.clamp_min(_EMPTY)).float()


def live_pages(dev: torch.Tensor) -> torch.Tensor:
    """Bool ``[..., P]``: pages whose keys vary (energy fractions are defined)."""
    return (dev.double() ** 2).sum(dim=(-2, -1)) > _EMPTY


def energy_by_scope(pages: torch.Tensor, global_rotation: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Mean (over varying pages) captured fraction per KV head and rank, per scope.

    pages ``[H, P, S, D]``, global_rotation ``[H, D, D]`` or None ->
    ``{"page": [H, S], "sequence": [H, D], "global": [H, D]}`` (float32).
    """
    _, dev = centred(pages)
    live = live_pages(dev).float().unsqueeze(-1)  # [H, P, 1]
    n = live.sum(1).clamp_min(1)  # [H, 1]
    out = {"page": (page_energy_curve(dev) * live).sum(1) / n,
           "sequence": (shared_energy_curve(dev, sequence_basis(dev, dev.shape[-1])) * live).sum(1) / n}
    if global_rotation is not None:
        out["global"] = (shared_energy_curve(dev, global_rotation) * live).sum(1) / n
    return out


def bytes_axes(page_size: int, head_dim: int) -> dict[str, list[int]]:
    """Bytes per page at each rank: per-page summaries (ranks 1..S) and shared (1..D)."""
    page = [locks_page_bytes(LocksConfig(page_size=page_size, rank=r, budget=2 * page_size), head_dim)
            for r in range(1, page_size + 1)]
    shared = [sum(shadowkv_bytes(head_dim, page_size, r, 8)) for r in range(1, head_dim + 1)]
    return {"page": page, "sequence": shared, "global": shared}


def matched_shared_rank(page_size: int, rank: int, head_dim: int) -> int:
    """Rank of a shared basis whose bytes per page match a rank-``rank`` per-page summary."""
    cfg = LocksConfig(page_size=page_size, rank=rank, budget=2 * page_size)
    return matched_settings("shadowkv", cfg, head_dim, bits=8)["rank"]
