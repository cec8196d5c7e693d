"""Eq. 4 page scores on CPU tensors: the reference's math in two batched matrix products.

Same semantics as :func:`kvlocks.scoring.reference.score_pages_from_summaries` and
:func:`~kvlocks.scoring.reference.score_pages_from_centroids` (tests check the pages they select);
only the order of float additions differs. The summaries are dequantized into a scoring layout,
basis and centroid as one ``[R+1, D]`` block per page and the coefficients transposed with a row
of ones, so a step's scores are one ``bmm`` over every page (``q @ W^T``) and one batched
``[G, R+1] @ [R+1, S]`` per page. Bundled model (D = 64, Hq = 9, Hkv = 3), fp32, two threads of an
AMD EPYC: ``bmm(q, W^T)`` took 0.09 ms at 4,096 tokens against 0.39 ms for ``bmm(W, q^T)``.

Two sources: :class:`ScoringBuffers` (one layer's rows, kept dequantized and extended by the new
pages only: the Hugging Face cache) and :func:`gather_buffers` (the pages a block table names, from
any store with ``gather(page_ids)``: a summary store keyed by physical page).
"""

from __future__ import annotations

import math

import torch

from kvlocks.summary.types import PageSummaries


def _scoring_layout(summ: PageSummaries, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w [rows, P, R+1, D], c [rows, P, R+1, S])`` float32 from summaries with ``rows``
    leading rows in all (e.g. ``[B, Hkv]`` flattened)."""
    basis, mu, coef = summ.basis_float(), summ.centroid_float(), summ.coef_float()
    p, r, d = basis.shape[-3], basis.shape[-2], basis.shape[-1]
    w = torch.cat([basis.reshape(rows, p, r, d), mu.reshape(rows, p, 1, d)], dim=2)  # [rows, P, R+1, D]
    ones = coef.new_ones((rows, p, 1, coef.shape[-2]))
    c = torch.cat([coef.reshape(rows, p, -1, r).transpose(-1, -2), ones], dim=2)  # [rows, P, R+1, S]
    return w, c


class ScoringBuffers:
    """One layer's dequantized summaries in scoring layout (float32, grown by doubling).

    ``w [rows, cap, R+1, D]``: rows ``0..R-1`` the basis of each page, row ``R`` its centroid;
    ``c [rows, cap, R+1, S]``: the coefficients transposed, row ``R`` all ones. ``rows = B * Hkv``
    (one KV head of one sequence each); ``pages`` of the ``cap`` slots are filled, logical page ``p``
    of row ``i`` in slot ``(i, p)``. Values are the summaries' own dequantized ones.
    """

    def __init__(self) -> None:
        self.w: torch.Tensor | None = None
        self.c: torch.Tensor | None = None
        self.pages = 0

    def sync(self, summaries: PageSummaries) -> None:
        """Add the pages of ``summaries`` (leading dims ``[B, Hkv]``) not yet here (they only grow)."""
        p = summaries.num_pages
        if p <= self.pages:
            return
        new = summaries.select_pages(slice(self.pages, p))  # its float views dequantize these only
        w, c = _scoring_layout(new, math.prod(new.lead_shape))
        self._grow(p, w, c)
        self.w[:, self.pages : p] = w
        self.c[:, self.pages : p] = c
        self.pages = p

    def _grow(self, need: int, w: torch.Tensor, c: torch.Tensor) -> None:
        cap = 0 if self.w is None else self.w.shape[1]
        if need <= cap:
            return
        cap = max(need, 2 * cap, 64)
        nw, nc = w.new_empty((w.shape[0], cap, *w.shape[2:])), c.new_empty((c.shape[0], cap, *c.shape[2:]))
        if self.pages:
            nw[:, : self.pages] = self.w[:, : self.pages]
            nc[:, : self.pages] = self.c[:, : self.pages]
        self.w, self.c = nw, nc

    def scores(self, q: torch.Tensor, scale: float, *, centroid: bool = False) -> torch.Tensor:
        """q ``[rows, G, D]`` -> float32 ``[rows, G, P]`` (P = ``pages``)."""
        return layout_scores(q, self.w[:, : self.pages], self.c[:, : self.pages], scale, centroid=centroid)


def layout_scores(q: torch.Tensor, w: torch.Tensor, c: torch.Tensor, scale: float, *,
                  centroid: bool = False) -> torch.Tensor:
    """Eq. 4 (or, with ``centroid``, Eq. 4 at rank 0: ``log S + scale q.mu``) from the scoring layout.

    q ``[rows, G, D]``, w ``[rows, P, R+1, D]``, c ``[rows, P, R+1, S]`` (views whose page axis may be
    sliced) -> float32 ``[rows, G, P]``.
    """
    rows, g, d = q.shape
    p, r1, s = w.shape[1], w.shape[2], c.shape[3]
    if p == 0:
        return q.new_zeros((rows, g, 0), dtype=torch.float32)
    qs = q.float() * scale
    if centroid:
        return torch.einsum("bgd,bpd->bgp", qs, w[:, :, r1 - 1]) + math.log(s)  # [rows, G, P]
    proj = torch.bmm(qs, w.reshape(rows, p * r1, d).transpose(1, 2))  # [rows, G, P*(R+1)]
    proj = proj.view(rows, g, p, r1).transpose(1, 2).reshape(rows * p, g, r1)  # [rows*P, G, R+1]
    logits = torch.bmm(proj, c.reshape(rows * p, r1, s))  # [rows*P, G, S]
    return torch.logsumexp(logits, dim=-1).view(rows, p, g).transpose(1, 2)  # [rows, G, P]


def gather_buffers(store, block_table: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scoring layout of the first ``width`` pages of every row of ``block_table [B, >= width]``
    from ``store`` (``gather(page_ids [N]) -> PageSummaries`` with leading dims ``[Hkv]``):
    ``(w [B * Hkv, width, R+1, D], c [B * Hkv, width, R+1, S])``, row ``b * Hkv + h``."""
    bsz = block_table.shape[0]
    summ = store.gather(block_table[:, :width].reshape(-1))  # leading [Hkv], B * width pages
    hkv = summ.lead_shape[0]
    w, c = _scoring_layout(summ, hkv)  # [Hkv, B*width, R+1, *]
    w = w.view(hkv, bsz, width, *w.shape[2:]).transpose(0, 1).reshape(bsz * hkv, width, *w.shape[2:])
    c = c.view(hkv, bsz, width, *c.shape[2:]).transpose(0, 1).reshape(bsz * hkv, width, *c.shape[2:])
    return w, c
