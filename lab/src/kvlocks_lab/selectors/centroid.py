"""Centroid baseline: each page is summarised by its mean key alone.

Score of a page with ``n`` real tokens and mean key ``mu``: ``log(n) + scale * q.mu`` — the
log-sum-exp the page would have if every key equalled the centroid, i.e. LOCKS's Eq. 4 at rank 0.
By Jensen's inequality (``log mean exp >= mean``) it is a lower bound on the page's true
log-sum-exp, tight when the page's logits are all equal.

Knobs (to spend more or fewer bytes, see :mod:`kvlocks_lab.selectors.matched_bytes`):

- ``bits``: ``None`` (key dtype), 32, 16 (float16) or 8 (int8, one float16 scale per centroid).
- ``sub_pages``: centroids per page, over contiguous blocks; the page scores
  ``logsumexp_b(log n_b + scale * q.mu_b)`` (still a Jensen lower bound).

Like Quest, this reference recomputes the centroids from ``view.keys`` each step; the byte
accounting counts the centroids only.
"""

from __future__ import annotations

import torch

from kvlocks.config import LocksConfig
from kvlocks.selection.pages import (
    NEG_INF, block_bounds, check_bits, fake_quant, full_pages, mask_empty_pages, page_mask, token_weights,
)
from kvlocks_lab.selectors.matched_bytes import centroid_bytes


def page_centroids(
    pages: torch.Tensor, pmask: torch.Tensor | None, sub_pages: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of each block's real keys.

    pages float32 ``[..., Pc, S, D]``, pmask bool ``[..., Pc, S]`` or None ->
    (mu float32 ``[..., Pc, M, D]`` (zero for an empty block), count float32 ``[..., Pc, M]``).
    """
    w = token_weights(pmask, pages)  # [..., Pc, S]
    mus, counts = [], []
    for a, b in block_bounds(pages.shape[-2], sub_pages):
        n = w[..., a:b].sum(-1)  # [..., Pc]
        total = (pages[..., a:b, :] * w[..., a:b, None]).sum(-2)  # [..., Pc, D]
        mus.append(total / n.clamp_min(1.0).unsqueeze(-1))
        counts.append(n)
    return torch.stack(mus, dim=-2), torch.stack(counts, dim=-1)


class CentroidSelector:
    """Page score = log(real tokens) + scale * q . (page mean key); see the module docstring.

    Parameters
    ----------
    bits : None (key dtype), 32, 16 or 8
    sub_pages : centroids per page (1 = one mean key per page)
    """

    name = "centroid"
    needs_summaries = False
    reads_all_keys = False

    def __init__(self, *, bits: int | None = None, sub_pages: int = 1) -> None:
        if bits is not None:
            check_bits("CentroidSelector", bits)
        if isinstance(sub_pages, bool) or not isinstance(sub_pages, int) or sub_pages < 1:
            raise ValueError(f"CentroidSelector.sub_pages={sub_pages!r}: must be an integer >= 1")
        self.bits = bits
        self.sub_pages = sub_pages

    def __repr__(self) -> str:
        return f"CentroidSelector(bits={self.bits}, sub_pages={self.sub_pages})"

    def _check(self, config: LocksConfig) -> None:
        if self.sub_pages > config.page_size:
            raise ValueError(f"CentroidSelector.sub_pages={self.sub_pages}: must be <= page_size={config.page_size}")

    def page_scores(self, queries: torch.Tensor, view, config: LocksConfig) -> torch.Tensor:
        """queries ``[..., G, D]`` -> float32 ``[..., G, Pc]``, Jensen lower bounds on page LSEs."""
        self._check(config)
        pc = view.keys.shape[-2] // config.page_size
        pm = page_mask(view.token_mask, config.page_size, pc)
        mu, count = page_centroids(full_pages(view.keys, config.page_size), pm, self.sub_pages)
        mu = mu.to(view.keys.dtype).float() if self.bits is None else fake_quant(mu, self.bits)
        logits = torch.einsum("...gd,...pmd->...gpm", queries.float(), mu) * view.scale  # [..., G, Pc, M]
        logn = torch.where(count > 0, count.clamp_min(1.0).log(), NEG_INF).unsqueeze(-3)  # [..., 1, Pc, M]
        return mask_empty_pages(torch.logsumexp(logits + logn, dim=-1), pm)

    def bytes_per_page(self, config: LocksConfig, head_dim: int, elem_size: int) -> tuple[int, int]:
        """``(payload, scales)`` bytes of one page's centroids, one KV head."""
        self._check(config)
        return centroid_bytes(head_dim, self.sub_pages, self.bits, elem_size)

    def selection_bytes(self, config: LocksConfig, head_dim: int, elem_size: int, full_pages: int) -> float:
        return float(full_pages * sum(self.bytes_per_page(config, head_dim, elem_size)))


