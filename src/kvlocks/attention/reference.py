"""Exact attention for one decode query per head: over selected pages, and dense (FullKV).

Pure PyTorch, float32 softmax/LSE, any device. Keys and values are token-major ``[..., N, D]``;
``N`` need not be a multiple of the page size (the partial last page is masked).
"""

from __future__ import annotations

import math

import torch

from kvlocks.pages import num_pages
from kvlocks._checks import (
    check_bool_tensor, check_index_tensor, check_positive_int, check_same, check_same_device, check_scale,
    check_tensor,
)


def _attend(q, k, v, valid, scale):
    """q ``[..., G, D]``, k/v ``[..., T, D]``, valid bool ``[..., T]`` -> (out, lse)."""
    logits = torch.einsum("...gd,...td->...gt", q.float(), k.float()) * scale  # [..., G, T]
    logits = logits.masked_fill(~valid.unsqueeze(-2), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [..., G]
    probs = torch.exp(logits - lse.unsqueeze(-1))
    out = torch.einsum("...gt,...td->...gd", probs, v.float())
    return out, lse


def check_qkv(queries, keys, values, token_mask, scale):
    """Metadata checks only (no host sync): types, dims, shapes, devices, the mask and the scale."""
    check_tensor("queries", queries, 2)
    check_tensor("keys", keys, 2)
    check_tensor("values", values, 2)
    check_same("head_dim", "queries.shape[-1]", queries.shape[-1], "keys.shape[-1]", keys.shape[-1])
    check_same("keys/values shape", "keys", tuple(keys.shape), "values", tuple(values.shape))
    check_same("leading dims", "queries", tuple(queries.shape[:-2]), "keys", tuple(keys.shape[:-2]))
    check_same_device(queries=queries, keys=keys, values=values, token_mask=token_mask)
    if keys.shape[-2] == 0:
        raise ValueError("empty context: keys has 0 tokens; at least one token is required")
    if token_mask is not None:
        check_bool_tensor("token_mask", token_mask, tuple(keys.shape[:-1]), "keys.shape[:-1] ([..., N])")
    return check_scale(scale)


def sparse_decode(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, page_ids: torch.Tensor,
                  page_size: int, *, scale: float | None = None,
                  token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over the full K/V of the selected pages only.

    Parameters
    ----------
    queries : ``[..., G, D]``
    keys, values : ``[..., N, D]`` token-major
    page_ids : integer ``[..., K]`` distinct page ids in ``[0, ceil(N / page_size))``
    page_size : int >= 1
    scale : softmax scale, default ``1/sqrt(D)``
    token_mask : bool ``[..., N]`` optional (False = padding, never attended)

    Returns
    -------
    out : ``[..., G, D]`` in the queries' dtype
    lse : float32 ``[..., G]``, natural-log log-sum-exp of the selected scaled logits
    """
    scale = check_qkv(queries, keys, values, token_mask, scale)
    check_positive_int("page_size", page_size)
    check_index_tensor("page_ids", page_ids)
    check_same_device(keys=keys, page_ids=page_ids)
    n, d = keys.shape[-2], keys.shape[-1]
    total = num_pages(n, page_size)
    if page_ids.shape[:-1] != keys.shape[:-2]:
        raise ValueError(f"page_ids leading dims {tuple(page_ids.shape[:-1])} != keys' {tuple(keys.shape[:-2])}")
    if page_ids.numel() and bool(((page_ids < 0) | (page_ids >= total)).any()):  # one host sync
        raise ValueError(f"page_ids must lie in [0, {total}) for N={n} tokens at page_size={page_size}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    tok = (page_ids.unsqueeze(-1) * page_size + torch.arange(page_size, device=keys.device)).flatten(-2)  # [..., K*S]
    valid = tok < n
    tok = tok.clamp_max(n - 1)
    if token_mask is not None:
        valid = valid & torch.gather(token_mask, -1, tok)
    idx = tok.unsqueeze(-1).expand(*tok.shape, d)
    k_sel = torch.gather(keys, -2, idx)  # [..., K*S, D]
    v_sel = torch.gather(values, -2, idx)
    out, lse = _attend(queries, k_sel, v_sel, valid, scale)
    return out.to(queries.dtype), lse


def dense_decode(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scale: float | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FullKV reference: exact attention over every token. Same shapes as :func:`sparse_decode`."""
    scale = check_qkv(queries, keys, values, token_mask, scale)
    scale = 1.0 / math.sqrt(keys.shape[-1]) if scale is None else scale
    valid = torch.ones(keys.shape[:-1], dtype=torch.bool, device=keys.device) if token_mask is None else token_mask
    out, lse = _attend(queries, keys, values, valid, scale)
    return out.to(queries.dtype), lse
