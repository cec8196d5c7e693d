"""AM's bias fit: per-key logit biases that make the kept keys carry the full cache's mass.

For reference query j the full cache's partition function, shifted by the query's largest
logit ``m_j`` so nothing overflows, is ``Z_j = sum_i exp(q_j . k_i * scale - m_j)`` (so
``1 <= Z_j <= T``). With kept keys ``k_sel`` and weights ``w_i = exp(beta_i)``, the compacted
cache's partition function is ``(A w)_j`` with ``A[j, i] = exp(q_j . k_sel_i * scale - m_j)``.

Row scaling (a design decision): each row is divided by ``Z_j``, i.e. we fit the *relative*
error ``(A w)_j / Z_j - 1``. To first order that is the error of the log-sum-exp, which is what
decides how much attention mass the compacted span takes from other tokens (e.g. later ones in
the same softmax). Unscaled rows would weight queries by ``Z_j``, which spans 1..T: queries that
spread their attention would dominate and sharply focused queries would be nearly ignored.
"""

from __future__ import annotations

import math

import torch

from .common import default_scale, logits
from .config import BIAS_SOLVERS
from .solvers import bounded_lstsq


def partition_targets(keys: torch.Tensor, q: torch.Tensor, *, scale: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Max-shifted partition functions of the full cache.

    Parameters
    ----------
    keys : Tensor [T, D]
        All keys of the head.
    q : Tensor [n, D]
        Reference queries.
    scale : float, optional
        Default ``1/sqrt(D)``.

    Returns
    -------
    z : Tensor [n], float64
        ``Z_j = sum_i exp(l_ji - m_j)``; in [1, T].
    shift : Tensor [n], float64
        ``m_j = max_i l_ji`` over all T logits ``l_ji = q_j . k_i * scale``.
    """
    s = default_scale(q.shape[-1], scale)
    lg = logits(q, keys, s, dtype=torch.float64)  # [n, T]
    shift = lg.max(dim=1).values  # [n]
    z = lg.sub_(shift[:, None]).exp_().sum(dim=1)  # [n]; in place: [n, T] float64 is the big one
    return z, shift


def mass_design(kept_keys: torch.Tensor, q: torch.Tensor, shift: torch.Tensor, *,
                scale: float | None = None) -> torch.Tensor:
    """Design matrix ``A[j, i] = exp(q_j . k_sel_i * scale - m_j)``.

    Parameters
    ----------
    kept_keys : Tensor [t, D]
    q : Tensor [n, D]
    shift : Tensor [n]
        Per-query shift ``m_j`` from :func:`partition_targets` (max over the FULL cache, so
        every entry is in [0, 1]).
    scale : float, optional
        Default ``1/sqrt(D)``.

    Returns
    -------
    Tensor [n, t], float64
    """
    s = default_scale(q.shape[-1], scale)
    lg = logits(q, kept_keys, s, dtype=torch.float64)  # [n, t]
    return lg.sub_(shift.to(torch.float64)[:, None]).exp_()  # in place


def fit_bias(keys: torch.Tensor, indices: torch.Tensor, q: torch.Tensor, *,
             scale: float | None = None, beta_min: float = -3.0, beta_max: float = 3.0,
             solver: str = "active_set") -> torch.Tensor:
    """Box-constrained least-squares fit of the kept keys' logit biases.

    Solves ``min_w sum_j ((A w)_j / Z_j - 1)^2`` subject to
    ``exp(beta_min) <= w_i <= exp(beta_max)`` in float64 with
    :func:`~.solvers.bounded_lstsq` (started from ``w = 1``, i.e. beta = 0) and returns
    ``beta = log w``. See the module docstring for the row scaling.

    Parameters
    ----------
    keys : Tensor [T, D]
        All keys of the head (post-RoPE).
    indices : Tensor [t], int64
        Kept positions.
    q : Tensor [n, D]
        Reference queries.
    scale : float, optional
        Default ``1/sqrt(D)``.
    beta_min, beta_max : float
        Box for beta (beta_min < beta_max).
    solver : str
        ``"active_set"``, the exact active-set solver of :mod:`.solvers` (the only one; see
        ``CompactionConfig.bias_solver``).

    Returns
    -------
    Tensor [t], float32
        beta, each in [beta_min, beta_max].
    """
    if not beta_min < beta_max:
        raise ValueError(f"beta_min={beta_min!r}, beta_max={beta_max!r}: need beta_min < beta_max")
    if solver not in BIAS_SOLVERS:
        raise ValueError(f"solver={solver!r}: allowed {BIAS_SOLVERS}")
    z, shift = partition_targets(keys, q, scale=scale)
    a = mass_design(keys[indices], q, shift, scale=scale) / z[:, None]  # [n, t], rows / Z_j
    lo, hi = math.exp(beta_min), math.exp(beta_max)
    start = torch.ones(a.shape[1], dtype=torch.float64).clamp(lo, hi)  # beta = 0, in the box
    w = bounded_lstsq(a, torch.ones(a.shape[0], dtype=torch.float64), lo, hi, x0=start)  # [t]
    beta = torch.log(w).to(torch.float32)  # [t]
    # log(exp(b)) may round a hair outside the box; the contract is beta in [beta_min, beta_max]
    return beta.clamp(beta_min, beta_max)
