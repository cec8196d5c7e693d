"""Rank-one (FlashBias-style) exact bias: one extra coordinate on every query and key.

``q' = [q, 1/scale]`` and ``k' = [k, beta]`` give
``q' . k' * scale = q . k * scale + beta``: exactly the biased logit, for every query. The
scale must stay that of the ORIGINAL head dim D (``1/sqrt(D)``, not ``1/sqrt(D+1)``), so
with the default scale the extra query coordinate is ``sqrt(D)``. The cost is a head dim of
D+1 in the cache (which engines pad, e.g. 128 -> 136 or 256), and a changed query path.
"""

from __future__ import annotations

import torch

from .common import default_scale


def augment_keys(keys: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Keys with the bias appended as coordinate D.

    Parameters
    ----------
    keys : Tensor [t, D]
    beta : Tensor [t]

    Returns
    -------
    Tensor [t, D+1], float32
    """
    return torch.cat([keys.to(torch.float32), beta.to(torch.float32)[:, None]], dim=1)


def augment_queries(q: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Queries with ``1/scale`` appended as coordinate D (``sqrt(D)`` for the default scale).

    Parameters
    ----------
    q : Tensor [..., D]
    scale : float, optional
        The original head's logit scale; default ``1/sqrt(D)``.

    Returns
    -------
    Tensor [..., D+1], float32
    """
    s = default_scale(q.shape[-1], scale)
    extra = torch.full((*q.shape[:-1], 1), 1.0 / s, dtype=torch.float32)
    return torch.cat([q.to(torch.float32), extra], dim=-1)
