"""ShadowKV-scope baseline: LOCKS's summary form with one low-rank basis per sequence.

The LOCKS paper attributes ShadowKV's loss at small budgets to the *scope* of its low-rank key
representation: one basis per (sequence, layer, KV head) instead of one per page. This module
isolates that choice. For each sequence, layer and KV head:

- every full page keeps its centroid ``mu_j`` (mean of its real keys);
- one orthonormal basis ``V [r, D]`` is fitted on the whole sequence's centred deviations
  ``k_i - mu_j`` (the top-r eigenvectors of ``sum_i (k_i - mu_j)(k_i - mu_j)^T``, float64), i.e.
  the rank-r SVD of all deviations of the sequence;
- each key keeps its coefficients ``c_i = V (k_i - mu_j)``;
- a page scores like Eq. 4: ``logsumexp_i scale * (q.mu_j + (V q).c_i)``.

At ``rank = D`` (and ``bits = 32``) the reconstruction is exact and the score is the exact page
log-sum-exp. Coefficients and centroids are stored at ``bits`` (8: int8 with one float16 scale
per key and per centroid, like LOCKS's ``coef_bits=8``; 16; 32) and the shared basis in float16.

Reference semantics: the basis is refitted from ``view.keys`` (all current full pages) at every
step. A deployed version fits it once at prefill and projects later pages into it; the two agree
whenever the basis has full rank. Byte accounting counts per page ``S * r`` coefficients and one
centroid, plus the shared basis (``2 * D * r`` bytes per KV head per step, read to project q).
"""

from __future__ import annotations

import torch

from kvlocks.config import LocksConfig
from kvlocks.selection.pages import (
    check_bits, check_rank, fake_quant, full_pages, mask_empty_pages, masked_page_lse, page_mask,
    token_weights,
)
from kvlocks_lab.selectors.matched_bytes import matched_shadowkv, shadowkv_bytes


def sequence_basis(dev: torch.Tensor, rank: int) -> torch.Tensor:
    """Top-``rank`` right singular vectors of all deviations of a sequence.

    dev float32 ``[..., Pc, S, D]`` (zero rows for padding) -> float32 ``[..., r, D]``, orthonormal rows.
    """
    x = dev.flatten(-3, -2).double()  # [..., Pc*S, D]
    gram = x.transpose(-1, -2) @ x  # [..., D, D]
    _, evecs = torch.linalg.eigh(gram)  # ascending eigenvalues
    return evecs.flip(-1)[..., :rank].transpose(-1, -2).float()  # [..., r, D]


class ShadowKVSelector:
    """Per-sequence low-rank basis + per-page centroid and per-key coefficients, Eq. 4 scores.

    Parameters
    ----------
    rank : r, at most D; ``None`` = the rank whose bytes per page match LOCKS's
        (:func:`kvlocks_lab.selectors.matched_bytes.matched_shadowkv`)
    bits : 8, 16 or 32, precision of coefficients and centroids
    """

    name = "shadowkv"
    needs_summaries = False
    reads_all_keys = False

    def __init__(self, *, rank: int | None = None, bits: int = 8) -> None:
        check_rank("ShadowKVSelector", rank)
        check_bits("ShadowKVSelector", bits)
        self.rank = rank
        self.bits = bits

    def __repr__(self) -> str:
        return f"ShadowKVSelector(rank={self.rank}, bits={self.bits})"

    def resolved_rank(self, config: LocksConfig, head_dim: int) -> int:
        if self.rank is None:
            return matched_shadowkv(config, head_dim, bits=self.bits)["rank"]
        if self.rank > head_dim:
            raise ValueError(f"ShadowKVSelector.rank={self.rank}: must be <= head_dim={head_dim}")
        return self.rank

    def page_scores(self, queries: torch.Tensor, view, config: LocksConfig) -> torch.Tensor:
        """queries ``[..., G, D]`` -> float32 ``[..., G, Pc]`` estimated page log-sum-exps."""
        s = config.page_size
        pages = full_pages(view.keys, s)  # [..., Pc, S, D]
        pm = page_mask(view.token_mask, s, pages.shape[-3])
        w = token_weights(pm, pages).unsqueeze(-1)  # [..., Pc, S, 1]
        mu = (pages * w).sum(-2) / w.sum(-2).clamp_min(1.0)  # [..., Pc, D]
        dev = (pages - mu.unsqueeze(-2)) * w  # [..., Pc, S, D]
        basis = sequence_basis(dev, self.resolved_rank(config, pages.shape[-1]))  # [..., r, D]
        coef = fake_quant(dev @ basis.transpose(-1, -2).unsqueeze(-3), self.bits)  # [..., Pc, S, r]
        if self.bits != 32:
            basis = basis.half().float()  # stored in float16
        q = queries.float()
        proj = q @ basis.transpose(-1, -2)  # [..., G, r]
        qmu = torch.einsum("...gd,...pd->...gp", q, fake_quant(mu, self.bits))  # [..., G, Pc]
        logits = torch.einsum("...gr,...psr->...gps", proj, coef) + qmu.unsqueeze(-1)  # [..., G, Pc, S]
        return mask_empty_pages(masked_page_lse(logits * view.scale, pm), pm)

    def bytes_per_page(self, config: LocksConfig, head_dim: int, elem_size: int) -> tuple[int, int]:
        """``(payload, scales)`` bytes of one page's summary, one KV head (basis excluded)."""
        return shadowkv_bytes(head_dim, config.page_size, self.resolved_rank(config, head_dim), self.bits)

    def selection_bytes(self, config: LocksConfig, head_dim: int, elem_size: int, full_pages: int) -> float:
        """Bytes read to score ``full_pages`` pages, one KV head: page summaries + the shared basis."""
        per_page = sum(self.bytes_per_page(config, head_dim, elem_size))
        return float(full_pages * per_page + 2 * head_dim * self.resolved_rank(config, head_dim))
