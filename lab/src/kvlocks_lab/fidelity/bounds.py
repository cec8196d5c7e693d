"""Theorem 1 measured: eta (Eq. 6), its spectral bound (Eq. 7), retention (Eq. 8), output (Eq. 9).

For one decode step (query step t) and one GQA group:

- Eq. 6: ``eta = max_{g, j} |s_hat_j(q_g) - s_j(q_g)|``, the worst page log-mass error;
- Eq. 7: ``eta <= max_{g, j} scale * ||(q_g)_perp_j|| * sqrt(tau_j)`` with ``(q)_perp_j`` the part
  of q outside page j's retained basis and ``tau_j`` the page's spectral tail. (The review
  writes ``1/sqrt(d)``; the model's softmax scale is used here, equal to it for this model.)
- Eq. 8: the group-mean coverage of the shared top-k by estimated ``mean_share`` is at least
  ``exp(-4 eta)`` times that of the exact selection (sink and recent pages included);
- Eq. 9: with ``R = max_i ||v_i||``, Eq. 1 gives ``||o - o_S|| <= 2 R (1 - gamma_S)`` per head, so
  with Eq. 8 the group-mean output error is at most ``2 R (1 - exp(-4 eta) gamma*)``. The
  review prints ``2 R (1 - exp(-4 eta)) gamma*``, which is 0 at eta = 0 although the exact
  selection itself drops mass; both forms are reported (``eq9`` and ``eq9_printed``).

Eq. 8 needs shares over the same pages the coverage counts: the fidelity prefix is whole pages,
so it holds exactly, not approximately.
"""

from __future__ import annotations

import torch


def eta(est_lse: torch.Tensor, exact_lse: torch.Tensor) -> torch.Tensor:
    """Eq. 6 per step: ``[..., G, P]`` estimated and exact page LSEs -> ``[...]``."""
    return (est_lse - exact_lse).abs().amax(dim=(-2, -1))


def eq7_bound(queries: torch.Tensor, basis: torch.Tensor, tau: torch.Tensor, scale: float) -> torch.Tensor:
    """Eq. 7 per step.

    queries ``[H, Q, G, D]``, basis ``[H, P, R, D]`` (orthonormal rows, unquantized; zero rows
    allowed), tau ``[H, P]`` -> ``[H, Q]``: ``max_{g,j} scale * ||q_g - V_j^T V_j q_g|| sqrt(tau_j)``.
    """
    q = queries.float()
    proj = torch.einsum("hqgd,hprd->hqgpr", q, basis)  # [H, Q, G, P, R]
    perp2 = (q * q).sum(-1).unsqueeze(-1) - (proj * proj).sum(-1)  # [H, Q, G, P]: ||q||^2 - ||Vq||^2
    bound = perp2.clamp_min(0).sqrt() * tau.clamp_min(0).sqrt()[:, None, None, :] * scale
    return bound.amax(dim=(-2, -1))


def value_radius(values: torch.Tensor) -> torch.Tensor:
    """R of Eq. 9: ``max_i ||v_i||``; values ``[..., N, D]`` -> ``[...]``."""
    return values.float().norm(dim=-1).amax(dim=-1)


def eq9_bounds(radius: torch.Tensor, eta_: torch.Tensor, gamma_star: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2R(1 - e^{-4 eta} gamma*), 2R(1 - e^{-4 eta}) gamma*)``; radius ``[H]``, eta/gamma ``[H, Q]``."""
    r = radius.unsqueeze(-1)
    keep = torch.exp(-4 * eta_)
    return 2 * r * (1 - keep * gamma_star), 2 * r * (1 - keep) * gamma_star
