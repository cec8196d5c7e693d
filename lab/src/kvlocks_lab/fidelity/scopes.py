"""Representation scope: the same Eq. 4 summary form with a basis fitted per page, per sequence
or once globally, and the token logits each one reconstructs.

- per page (LOCKS): :func:`page_local_logits`, from :func:`kvlocks.summary.spectral_basis`
  (unquantized) or from quantized :class:`~kvlocks.summary.PageSummaries`;
- per sequence (ShadowKV scope): one basis per (sequence, layer, KV head) fitted on that
  sequence's page-centred deviations (:func:`kvlocks_lab.selectors.shadowkv.sequence_basis`);
- global: one basis per (layer, KV head) fitted on page-centred deviations of *calibration*
  prose (:class:`GlobalBases`), i.e. ShadowKV's form at cache-wide scope. Loki (uncentred PCA
  of the keys themselves, no centroid) is the published global-scope selector and is measured
  too (:func:`loki_logits`).

Per-sequence and global summaries store per page a centroid and ``S x r`` coefficients at
``bits`` (like ShadowKV: int8 with one float16 scale per key and per centroid) and the shared
basis in float16, so at equal rank they cost the same bytes per page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlocks.selection.pages import fake_quant, full_pages
from kvlocks_lab.selectors.shadowkv import sequence_basis


def centred(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages ``[..., P, S, D]`` -> (centroids ``[..., P, D]``, deviations ``[..., P, S, D]``)."""
    mu = pages.float().mean(dim=-2)
    return mu, pages.float() - mu.unsqueeze(-2)


def shared_basis_logits(queries: torch.Tensor, pages: torch.Tensor, basis: torch.Tensor, bits: int,
                        scale: float) -> torch.Tensor:
    """Eq. 4 logits with one shared basis: ``scale * (q.mu_j + (W q).c_i)``, ``c_i = W (k_i - mu_j)``.

    queries ``[H, M, D]``, pages ``[H, P, S, D]``, basis ``[H, r, D]`` (orthonormal rows),
    bits 8/16/32 for coefficients and centroids (basis stored float16 unless 32)
    -> float32 ``[H, M, P, S]``. Same arithmetic as :class:`~kvlocks.selection.ShadowKVSelector`.
    """
    mu, dev = centred(pages)
    coef = fake_quant(dev @ basis.transpose(-1, -2).unsqueeze(-3), bits)  # [H, P, S, r]
    w = basis if bits == 32 else basis.half().float()
    proj = queries.float() @ w.transpose(-1, -2)  # [H, M, r]
    qmu = torch.einsum("hmd,hpd->hmp", queries.float(), fake_quant(mu, bits))  # [H, M, P]
    return (torch.einsum("hmr,hpsr->hmps", proj, coef) + qmu.unsqueeze(-1)) * scale


def sequence_logits(queries, pages, rank: int, bits: int, scale: float) -> torch.Tensor:
    """Per-sequence scope (ShadowKV): basis from this sequence's deviations. Shapes as above."""
    _, dev = centred(pages)
    return shared_basis_logits(queries, pages, sequence_basis(dev, rank), bits, scale)


def loki_logits(queries: torch.Tensor, pages: torch.Tensor, basis: torch.Tensor, bits: int,
                scale: float) -> torch.Tensor:
    """Loki: ``scale * (P_r^T q).(P_r^T k)``; basis ``[H, D, r]`` columns, float16 unless bits=32.

    queries ``[H, M, D]``, pages ``[H, P, S, D]`` -> float32 ``[H, M, P, S]`` (same arithmetic as
    :class:`~kvlocks.selection.LokiSelector`).
    """
    p = basis if bits == 32 else basis.half().float()
    k_r = fake_quant(pages.float() @ p.unsqueeze(-3), bits)  # [H, P, S, r]
    q_r = queries.float() @ p  # [H, M, r]
    return torch.einsum("hmr,hpsr->hmps", q_r, k_r) * scale


def page_local_logits(queries: torch.Tensor, mu: torch.Tensor, basis: torch.Tensor, coef: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Eq. 4 logits from per-page float summaries: ``scale * (q.mu_j + (V_j q).c_i)``.

    queries ``[H, M, D]``, mu ``[H, P, D]``, basis ``[H, P, R, D]``, coef ``[H, P, S, R]``
    -> float32 ``[H, M, P, S]``.
    """
    q = queries.float()
    proj = torch.einsum("hmd,hprd->hmpr", q, basis)
    qmu = torch.einsum("hmd,hpd->hmp", q, mu)
    return (torch.einsum("hmpr,hpsr->hmps", proj, coef) + qmu.unsqueeze(-1)) * scale


@dataclass(frozen=True, eq=False)
class GlobalBases:
    """Per-layer global bases fitted on calibration keys.

    rotations : tuple of float32 ``[Hkv, D, D]`` per layer; row i is the i-th principal
        direction of the calibration text's page-centred deviations (decreasing energy)
    """

    rotations: tuple[torch.Tensor, ...]

    @classmethod
    def fit(cls, keys_per_layer, page_size: int) -> "GlobalBases":
        """From calibration keys, one ``[Hkv, N, D]`` tensor per layer."""
        rots = []
        for k in keys_per_layer:
            _, dev = centred(full_pages(k, page_size))  # [Hkv, P, S, D]
            rots.append(sequence_basis(dev, k.shape[-1]))  # [Hkv, D, D]
        return cls(rotations=tuple(rots))

    def basis(self, layer: int, rank: int, heads: list[int] | None = None) -> torch.Tensor:
        """Float32 ``[H, r, D]``: the first ``rank`` directions of ``layer`` (for ``heads``)."""
        r = self.rotations[layer][:, :rank]
        return r if heads is None else r[heads]

