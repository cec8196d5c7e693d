"""Attention over selected pages of a paged cache on CPU tensors, for a whole batch at once.

Same result as :func:`kvlocks.attention.reference.sparse_decode` per sequence (tests check it);
the selected pages are gathered with one index per K and V straight from the paged cache (no
per-token index tensor) and attended in float32 with two batched matrix products.
"""

from __future__ import annotations

import torch


def paged_decode(queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, page_list: torch.Tensor, *, scale: float,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``queries [B, Hq, D]`` over the listed pages.

    k_cache/v_cache ``[num_pages, S, Hkv, D]``; block_table int ``[B, W]``; seq_lens int ``[B]``;
    page_list int ``[B, Hkv, K]`` logical pages, -1 padded. Returns out ``[B, Hq, D]`` (queries'
    dtype, or written into ``out``) and lse float32 ``[B, Hq]``.
    """
    bsz, hq, d = queries.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    g, k = hq // hkv, page_list.shape[-1]
    pages = page_list.long()
    phys = block_table.long().gather(1, pages.clamp_min(0).reshape(bsz, -1)).view(bsz, hkv, k)  # [B, Hkv, K]
    if hkv == 1:  # one head per row (the Hugging Face cache's view): a plain index_select
        keys = k_cache.index_select(0, phys.reshape(-1)).view(bsz, 1, k * s, d)  # [B, 1, K*S, D]
        vals = v_cache.index_select(0, phys.reshape(-1)).view(bsz, 1, k * s, d)
    else:
        heads = torch.arange(hkv, device=queries.device).view(1, hkv, 1)
        keys = k_cache[phys, :, heads].reshape(bsz, hkv, k * s, d)  # [B, Hkv, K*S, D]
        vals = v_cache[phys, :, heads].reshape(bsz, hkv, k * s, d)
    tok = (pages.unsqueeze(-1) * s + torch.arange(s, device=queries.device)).flatten(-2)  # [B, Hkv, K*S]
    real = (tok < seq_lens.long().view(bsz, 1, 1)) & (pages >= 0).repeat_interleave(s, dim=-1)
    q = queries.view(bsz, hkv, g, d).float()
    logits = torch.matmul(q, keys.float().transpose(-1, -2)) * scale  # [B, Hkv, G, K*S]
    logits = logits.masked_fill(~real.unsqueeze(-2), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, Hkv, G]
    vals = vals.float()
    if not bool(real.all()):  # unwritten slots may hold anything (NaN too): their weight 0 must stay 0
        vals = vals.masked_fill(~real.unsqueeze(-1), 0.0)
    o = torch.matmul(torch.exp(logits - lse.unsqueeze(-1)), vals)  # [B, Hkv, G, D]
    out = torch.empty_like(queries) if out is None else out
    out.copy_(o.reshape(bsz, hq, d))
    return out, lse.reshape(bsz, hq)
