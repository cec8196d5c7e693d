"""Attention with per-query-head page lists: each head of a GQA group reads its own pages.

Selectors that choose pages per query head (``per_head = True``, such as the lab's per-head
oracle) return int64 ``[..., G, K]`` page ids; this attends with them by treating G as one more
leading dimension. :func:`distinct_pages` counts the K/V pages a KV head then really reads.
"""

from __future__ import annotations

import torch

from kvlocks.attention.reference import sparse_decode


def sparse_decode_per_head(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, page_ids: torch.Tensor,
                           page_size: int, *, scale: float | None = None,
                           token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of each query head over its own selected pages.

    Parameters
    ----------
    queries : ``[..., G, D]``
    keys, values : ``[..., N, D]`` token-major (shared by the G heads of a group)
    page_ids : int64 ``[..., G, K]`` per-head page ids
    page_size : int
    scale : softmax scale, default ``1/sqrt(D)``
    token_mask : bool ``[..., N]`` optional

    Returns
    -------
    out : ``[..., G, D]`` in the queries' dtype
    lse : float32 ``[..., G]``
    """
    g = queries.shape[-2]
    q = queries.unsqueeze(-2)  # [..., G, 1, D]
    k = keys.unsqueeze(-3).expand(*keys.shape[:-2], g, *keys.shape[-2:])  # [..., G, N, D], no copy
    v = values.unsqueeze(-3).expand(*values.shape[:-2], g, *values.shape[-2:])
    m = None if token_mask is None else token_mask.unsqueeze(-2).expand(*token_mask.shape[:-1], g, token_mask.shape[-1])
    out, lse = sparse_decode(q, k, v, page_ids, page_size, scale=scale, token_mask=m)
    return out.squeeze(-2), lse.squeeze(-1)  # [..., G, D], [..., G]


def distinct_pages(page_ids: torch.Tensor, total_pages: int) -> float:
    """Mean over KV heads (and batch rows) of the distinct pages the G heads select together.

    page_ids int64 ``[..., G, K]`` -> a float in ``[K, min(G * K, total_pages)]`` (host sync).
    """
    hit = torch.zeros((*page_ids.shape[:-2], total_pages), dtype=torch.bool, device=page_ids.device)
    hit.scatter_(-1, page_ids.flatten(-2), True)  # [..., total]
    return float(hit.sum(-1).float().mean())
