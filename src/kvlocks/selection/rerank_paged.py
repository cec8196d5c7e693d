"""The two-stage selection (:mod:`kvlocks.selection.rerank`) over the paged cache: fixed shapes,
no host synchronisation, so a decode step that re-ranks can be captured in a CUDA graph.

The candidate count is set by the block table's width (``config.rerank_candidates(W)``); rows
with fewer eligible pages get fewer useful candidates, which changes nothing (see
:func:`~kvlocks.selection.rerank.merge_exact`). The keys of the candidates and of the forced full
pages are gathered from the paged cache through the block table and their exact per-page
log-sum-exp computed in float32: PyTorch operations on any device, the reference's math.
"""

from __future__ import annotations

import torch

from kvlocks.config import LocksConfig
from kvlocks.pages import full_pages, num_pages
from kvlocks.scoring.reference import combine_group
from kvlocks.selection.rerank import NEG_INF, forced_pages, merge_exact, pick_candidates


def paged_rerank(queries: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 scores: torch.Tensor, config: LocksConfig, *, scale: float) -> torch.Tensor:
    """The ranking for :func:`kvlocks.plan.paged_select` after an exact re-rank of the candidates.

    queries ``[B, Hq, D]``, k_cache ``[NB, S, Hkv, D]``, block_table int32 ``[B, W]``, seq_lens
    int32 ``[B]``, scores float32 ``[B, Hkv, G, W]`` (summary estimates; entries past each row's
    full pages are ignored) -> float32 ``[B, Hkv, W]``: the combined masses on the useful
    candidates, ``-inf`` elsewhere.
    """
    bsz, hq, d = queries.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    g, width = hq // hkv, block_table.shape[1]
    lens = seq_lens.long()
    pc = full_pages(lens, s).view(bsz, 1, 1)
    valid = torch.arange(width, device=queries.device) < pc  # [B, 1, W] full pages
    est = scores.float().masked_fill(~valid.unsqueeze(-2), NEG_INF)  # [B, Hkv, G, W]
    ranking = combine_group(est, config.combine)
    ranking = torch.where(torch.isneginf(est).all(dim=-2), NEG_INF, ranking)  # [B, Hkv, W]
    forced = forced_pages(num_pages(lens, s), config).unsqueeze(1).expand(bsz, hkv, -1)  # [B, Hkv, F]
    forced_ok = forced < pc
    pick, cand = pick_candidates(ranking.masked_fill(~valid, NEG_INF), torch.where(forced_ok, forced, width),
                                 config.rerank_candidates(width))
    pages = torch.cat([cand, forced], dim=-1)  # [B, Hkv, M + F]
    pages = torch.where(pages < pc, pages, 0)  # pages past the full ones: read page 0, masked by the merge
    phys = block_table.long().gather(1, pages.flatten(1)).view(bsz, hkv, -1)
    keys = k_cache[phys, :, torch.arange(hkv, device=queries.device).view(1, hkv, 1)]  # [B, Hkv, M + F, S, D]
    logits = torch.einsum("bhgd,bhmsd->bhgms", queries.view(bsz, hkv, g, d).float(), keys.float()) * scale
    exact = torch.logsumexp(logits, dim=-1)  # [B, Hkv, G, M + F]
    return merge_exact(est, pick, cand, forced, forced_ok, exact, config.combine)
