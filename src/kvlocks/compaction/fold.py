"""The bias fold: move a per-key logit bias into the keys along one direction u per KV head.

With logits ``q . k * scale``, the folded key ``k' = k + (beta / scale) u`` gives
``q . k' * scale = q . k * scale + beta (q . u)``: the bias is reproduced exactly for every
query with ``q . u = 1``. For the default ``scale = 1/sqrt(D)`` the update is ``beta sqrt(D) u``.

u is the minimum-variance direction with mean ``q . u = 1`` over the context queries:
``u = (Sigma + lam I)^-1 mu / (mu^T (Sigma + lam I)^-1 mu)``, ``lam = fold_lambda tr(Sigma)/D``
(mu, Sigma: mean and 1/n covariance of the pooled context queries). Since ``mu . u = 1``
by construction, the mean of ``q . u`` over those queries is exactly 1.

For the same values, the output error against the biased cache is at most
``(b_max - b_min) / 4 * D_V * |q . u - 1|`` (D_V: largest distance between two of the values).
Proof sketch: along the logit path ``l + s beta`` the output's derivative is
``Cov_p(v, beta)``; for any unit e, ``|Cov_p(e.v, beta)| <= (D_V/2)((b_max - b_min)/2)`` by
Cauchy-Schwarz and Popoviciu; integrate s from 0 to ``q . u - 1``. With beta in [-3, 3]: 3/2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import default_scale
from .values import refit_values

_ROUND = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def query_moments(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance (1/n normalisation) of the context queries, in float64.

    Parameters
    ----------
    q : Tensor [n, D]

    Returns
    -------
    mu : Tensor [D], float64
    sigma : Tensor [D, D], float64
    """
    x = q.to(torch.float64)
    mu = x.mean(dim=0)  # [D]
    xc = x - mu[None, :]  # [n, D]
    return mu, (xc.T @ xc) / x.shape[0]


def fold_direction(q: torch.Tensor, *, fold_lambda: float = 1e-2) -> torch.Tensor:
    """Closed-form fold direction u of one KV head (module docstring).

    ``lam`` is floored at ``1e-12 * (tr(Sigma) + |mu|^2) / D`` so the solve stays defined when
    Sigma is singular (e.g. n < D, or all queries identical: then u = mu / |mu|^2).

    Parameters
    ----------
    q : Tensor [n, D]
        Context queries, pooled over the GQA group's query heads.
    fold_lambda : float
        >= 0.

    Returns
    -------
    Tensor [D], float32

    Raises
    ------
    ValueError
        If the query mean is zero (no direction has mean ``q . u = 1``).
    """
    if fold_lambda < 0:
        raise ValueError(f"fold_lambda={fold_lambda!r}: must be >= 0")
    mu, sigma = query_moments(q)
    d = mu.shape[0]
    tr = float(torch.trace(sigma))
    mu2 = float(mu @ mu)
    if mu2 == 0.0:
        raise ValueError("fold_direction: the context queries have zero mean; u is undefined")
    lam = max(fold_lambda * tr / d, 1e-12 * (tr + mu2) / d)
    x = torch.linalg.solve(sigma + lam * torch.eye(d, dtype=torch.float64), mu)  # [D]
    return (x / (mu @ x)).to(torch.float32)


def query_alignment(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Diagnostic ``q . u`` (1 means the fold is exact for that query).

    Parameters
    ----------
    q : Tensor [..., D]
    u : Tensor [D]

    Returns
    -------
    Tensor [...], float32
    """
    return q.to(torch.float32) @ u.to(torch.float32)


def fold_error_bound(q: torch.Tensor, u: torch.Tensor, values: torch.Tensor, *,
                     beta_min: float = -3.0, beta_max: float = 3.0) -> torch.Tensor:
    """Bound on ``||out_fold(q) - out_biased(q)||`` for the same compacted values.

    ``(beta_max - beta_min) / 4 * D_V * |q . u - 1|``; with the default box that is the
    paper's ``(3/2) D_V |q . u - 1|``. Holds for the exact fold (no key rounding, no value
    refit) and any bias within [beta_min, beta_max].

    Parameters
    ----------
    q : Tensor [n, D]
    u : Tensor [D]
    values : Tensor [t, Dv]
        The compacted values both caches read.
    beta_min, beta_max : float
        Range of the folded bias (for log-count merging: 0 and log of the largest count).

    Returns
    -------
    Tensor [n], float32
    """
    v = values.to(torch.float32)
    d_v = torch.cdist(v, v).max() if v.shape[0] > 1 else v.new_zeros(())  # largest distance
    return (beta_max - beta_min) / 4.0 * d_v * (query_alignment(q, u) - 1.0).abs()


def fold_keys(keys: torch.Tensor, beta: torch.Tensor, u: torch.Tensor, *,
              scale: float | None = None, round_dtype: str = "bfloat16") -> torch.Tensor:
    """Folded keys ``k + (beta / scale) u``, rounded to ``round_dtype`` and returned as float32.

    Parameters
    ----------
    keys : Tensor [t, D]
    beta : Tensor [t]
    u : Tensor [D]
    scale : float, optional
        Default ``1/sqrt(D)`` (then the update is ``beta sqrt(D) u``).
    round_dtype : str
        ``"bfloat16"``, ``"float16"`` or ``"float32"`` (no rounding).

    Returns
    -------
    Tensor [t, D], float32 (values representable in ``round_dtype``)
    """
    if round_dtype not in _ROUND:
        raise ValueError(f"round_dtype={round_dtype!r}: allowed {tuple(_ROUND)}")
    s = default_scale(keys.shape[-1], scale)
    step = (beta.to(torch.float32) / s)[:, None]  # [t, 1]
    folded = keys.to(torch.float32) + step * u.to(torch.float32)[None, :]  # [t, D]
    return folded.to(_ROUND[round_dtype]).to(torch.float32)  # [t, D]


@dataclass(frozen=True)
class FoldResult:
    """Output of :func:`fold_head`.

    Attributes
    ----------
    u : Tensor [D], float32
    keys : Tensor [t, D], float32
        Folded, rounded keys.
    values : Tensor [t, Dv], float32
        Values refit on ``keys`` with no bias.
    """

    u: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def fold_head(keys: torch.Tensor, beta: torch.Tensor, q: torch.Tensor, target: torch.Tensor, *,
              scale: float | None = None, fold_lambda: float = 1e-2,
              round_dtype: str = "bfloat16", ridge: float = 1e-6,
              anchor: torch.Tensor | None = None, anchor_weight: float = 0.0) -> FoldResult:
    """Fold a compacted head's bias into its keys and refit its values for a plain kernel.

    Parameters
    ----------
    keys : Tensor [t, D]
        Compacted keys (read with bias ``beta``).
    beta : Tensor [t]
        Per-key logit bias to fold.
    q : Tensor [n, D]
        Context (reference) queries: give u and the value fit.
    target : Tensor [n, Dv]
        Full-cache attention outputs of ``q``, reproduced by the value refit.
    scale, fold_lambda, round_dtype, ridge, anchor, anchor_weight
        See :func:`fold_keys`, :func:`fold_direction`, :func:`~.values.refit_values`.

    Returns
    -------
    FoldResult
    """
    u = fold_direction(q, fold_lambda=fold_lambda)  # [D]
    folded = fold_keys(keys, beta, u, scale=scale, round_dtype=round_dtype)  # [t, D]
    values = refit_values(folded, q, target, scale=scale, bias=None, ridge=ridge,
                          anchor=anchor, anchor_weight=anchor_weight)  # [t, Dv]
    return FoldResult(u=u, keys=folded, values=values)
