"""Group scores that bound the group's attention mass from above (a candidate coarse level).

A group of n keys ``k_j`` is summarised by its centroid ``c`` and rank-R basis ``V`` (the
quantized ones of a LOCKS summary of the group as one super-page), plus, per basis row ``i``,
the range ``[lo_i, hi_i]`` of the keys' least-squares coefficients ``a_j = (k_j − c) V⁺`` and the
largest residual norm ``rho = max_j ||k_j − c − Vᵀ a_j||`` (float16, rounded outward). Since each
residual is orthogonal to V's rows,

    log Σ_j exp(s q·k_j) <= log n + s (q·c + Σ_i max(p_i lo_i, p_i hi_i) + rho ||P⊥ q||),

with ``p = V q`` and ``P⊥`` the projection off V's row space: an upper bound for every query.
It stores ``D + R·D/2 + 2R + 1`` numbers per group (no per-token coefficients).
"""

from __future__ import annotations

import math

import torch

from kvlocks.config import LocksConfig
from kvlocks.summary.build import build_summaries


def _round(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float16 values rounded outward (up or down) so the bound survives the rounding."""
    h = x.to(torch.float16)
    bad = (h.float() < x) if up else (h.float() > x)
    step = torch.nextafter(h, torch.full_like(h, math.inf if up else -math.inf))
    return torch.where(bad, step, h).float()


def bound_groups(keys: torch.Tensor, gcfg: LocksConfig) -> dict:
    """The bound's group summary of the full groups of ``keys [..., N, D]``, each group a super-page
    of ``gcfg`` (:meth:`kvlocks_lab.selectors.hier.Groups.config`): c, V (dequantized), lo, hi
    [..., NG, R], rho [..., NG], n."""
    ng = keys.shape[-2] // gcfg.page_size
    k = keys[..., : ng * gcfg.page_size, :].float().unflatten(-2, (ng, gcfg.page_size))  # [..., NG, n, D]
    s = build_summaries(k, gcfg)
    c, v = s.centroid_float(), s.basis_float()  # [..., NG, D], [..., NG, R, D]
    x = (k - c.unsqueeze(-2)).double()
    vd = v.double()
    a = x @ torch.linalg.pinv(vd)  # [..., NG, n, R]: least-squares coefficients (V may be rank-deficient)
    resid = x - a @ vd
    return {"c": c, "v": v, "lo": _round(a.amin(-2).float(), up=False), "hi": _round(a.amax(-2).float(), up=True),
            "rho": _round(resid.norm(dim=-1).amax(-1).float(), up=True), "n": gcfg.page_size}


def bound_scores(queries: torch.Tensor, groups: dict, *, scale: float) -> torch.Tensor:
    """Upper bounds ``[..., G, NG]`` of each group's log-sum-exp for ``queries [..., G, D]``."""
    q = queries.double().unsqueeze(-3)  # [..., 1, G, D]
    c, v = groups["c"].double().unsqueeze(-2), groups["v"].double()  # [..., NG, 1, D], [..., NG, R, D]
    p = q @ v.transpose(-1, -2)  # [..., NG, G, R]
    proj = p @ torch.linalg.pinv(v).transpose(-1, -2)  # [..., NG, G, D]: q projected on V's row space
    perp = (q - proj).norm(dim=-1)  # [..., NG, G]
    lo, hi = groups["lo"].double().unsqueeze(-2), groups["hi"].double().unsqueeze(-2)
    top = torch.maximum(p * lo, p * hi).sum(-1)  # [..., NG, G]
    u = (q * c).sum(-1) + top + groups["rho"].double().unsqueeze(-1) * perp
    return (math.log(groups["n"]) + scale * u).transpose(-1, -2).float()  # [..., G, NG]
