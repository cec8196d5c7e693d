"""Page scoring (Eq. 4), exact per-page log-sum-exp, per-head shares and GQA combine rules.

Pure PyTorch, float32 math, any device. Shapes use ``...`` for leading dims such as ``[Hkv]`` or
``[B, Hkv]``; G is the GQA group size, P the number of pages, S the page size.
"""

from __future__ import annotations

import math

import torch

from kvlocks.pages import full_pages
from kvlocks.summary.types import PageSummaries

NEG_INF = float("-inf")


def _scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def summary_logits(queries: torch.Tensor, summaries: PageSummaries, scale: float | None = None) -> torch.Tensor:
    """Reconstructed within-page logits ``(q.mu_j + (V_j^T q).c_i) * scale``.

    queries ``[..., G, D]`` -> float32 ``[..., G, P, S]``.
    """
    q = queries.float()
    basis = summaries.basis_float()  # [..., P, R, D]
    coef = summaries.coef_float()  # [..., P, S, R]
    mu = summaries.centroid_float()  # [..., P, D]
    proj = torch.einsum("...gd,...prd->...gpr", q, basis)  # [..., G, P, R]
    qmu = torch.einsum("...gd,...pd->...gp", q, mu)  # [..., G, P]
    logits = torch.einsum("...gpr,...psr->...gps", proj, coef) + qmu.unsqueeze(-1)  # [..., G, P, S]
    return logits * _scale(summaries.head_dim, scale)


def _masked_lse(logits: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """LSE over the last dim; ``token_mask [..., P, S]`` (True = real token) broadcasts over G."""
    if token_mask is not None:
        logits = logits.masked_fill(~token_mask.unsqueeze(-3), NEG_INF)
    return torch.logsumexp(logits, dim=-1)


def score_pages_from_summaries(
    queries: torch.Tensor,
    summaries: PageSummaries,
    *,
    scale: float | None = None,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 4: estimated log-sum-exp of each page's scaled logits, from the summary only.

    queries ``[..., G, D]``; token_mask optional bool ``[..., P, S]`` (padding excluded) ->
    float32 ``[..., G, P]``. A page with no real token scores ``-inf``.
    """
    return _masked_lse(summary_logits(queries, summaries, scale), token_mask)


def score_pages_from_centroids(
    queries: torch.Tensor,
    summaries: PageSummaries,
    *,
    scale: float | None = None,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 4 at rank 0: ``log n + scale * q.mu`` per page of ``n`` real tokens (``mu`` its centroid).

    At most the page's log-sum-exp by Jensen's inequality (up to the centroid's rounding), from
    ``D`` of the summary's numbers. queries ``[..., G, D]``; token_mask optional bool
    ``[..., P, S]`` -> float32 ``[..., G, P]``; a page with no real token scores ``-inf``.
    """
    qmu = torch.einsum("...gd,...pd->...gp", queries.float(), summaries.centroid_float())
    logits = qmu * _scale(summaries.head_dim, scale)
    if token_mask is None:
        return logits + math.log(summaries.page_size)
    n = token_mask.sum(-1).unsqueeze(-2).float()  # [..., 1, P]
    return torch.where(n > 0, logits + n.clamp_min(1).log(), NEG_INF)


def exact_page_lse(
    queries: torch.Tensor,
    keys: torch.Tensor,
    page_size: int,
    *,
    scale: float | None = None,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact log-sum-exp of ``q.k * scale`` over each full page (reads every key).

    queries ``[..., G, D]``, keys ``[..., N, D]`` token-major -> float32 ``[..., G, N // S]``.
    A trailing partial page is ignored. token_mask optional bool ``[..., N // S, S]``.
    """
    p = full_pages(keys.shape[-2], page_size)
    k = keys[..., : p * page_size, :].float().unflatten(-2, (p, page_size))  # [..., P, S, D]
    logits = torch.einsum("...gd,...psd->...gps", queries.float(), k)
    return _masked_lse(logits * _scale(keys.shape[-1], scale), token_mask)


def combine_group(page_scores: torch.Tensor, rule: str) -> torch.Tensor:
    """Combine per-head page scores ``[..., G, P]`` (log-masses) into one ranking ``[..., P]``.

    - ``mean_share`` (Eq. 5): average over heads of each head's page-mass share
      ``softmax_P(scores)``;
    - ``max_share``: the largest per-head share;
    - ``sum_mass``: log of the summed unnormalised masses, ``logsumexp_G(scores)``.
    """
    if rule == "mean_share":
        return torch.softmax(page_scores, dim=-1).mean(dim=-2)
    if rule == "max_share":
        return torch.softmax(page_scores, dim=-1).amax(dim=-2)
    if rule == "sum_mass":
        return torch.logsumexp(page_scores, dim=-2)
    raise ValueError(f"combine rule {rule!r}: allowed ('mean_share', 'max_share', 'sum_mass')")
