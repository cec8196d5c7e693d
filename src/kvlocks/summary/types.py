"""The per-page summary container: quantized storage, dequantized views and byte accounting."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlocks.summary.quant import unpack_bits


def summary_bytes(page_size: int, rank: int, head_dim: int, basis_bits: int, coef_bits: int) -> tuple[int, int]:
    """``(payload, scales)`` bytes of one page's summary for one KV head: basis ``D x R`` at
    ``basis_bits``, coefficients ``S x R`` and centroid ``D`` at ``coef_bits``; float16 scales per
    basis row, per coefficient row and for the centroid unless that part is float16 itself."""
    s, r, d = page_size, rank, head_dim
    payload = (d * r * basis_bits) // 8 + (s * r * coef_bits) // 8 + (d * coef_bits) // 8
    scales = (2 * r if basis_bits != 16 else 0) + (2 * (s + 1) if coef_bits != 16 else 0)
    return payload, scales


@dataclass
class PageSummaries:
    """LOCKS summaries of full pages, for any leading dims ``...`` (e.g. ``[Hkv]`` or ``[B, Hkv]``).

    Storage (what a decode step reads):

    - ``basis``: the rank-R orthonormal basis, one basis vector per row, ``[..., P, R, D]``.
      int4/int2: uint8 packed along D, ``[..., P, R, D * bits / 8]``; int8: int8;
      16 bits: float16.
    - ``basis_scale``: float16 ``[..., P, R]`` (one scale per basis vector = per column of V),
      ``None`` at 16 bits.
    - ``coef``: coefficients of each key's centred deviation in that basis, ``[..., P, S, R]``,
      int8 (or float16 at 16 bits); ``coef_scale`` float16 ``[..., P, S]`` (per row).
    - ``centroid``: page mean key ``[..., P, D]`` int8 (float16 at 16 bits); ``centroid_scale``
      float16 ``[..., P]`` (one scale per page).

    Diagnostics (never read at decode, never counted): ``tau`` float32 ``[..., P]``, the spectral
    tail sum_{k>R} sigma_k^2 (plus any retained directions dropped as numerically zero), and
    ``sigma`` float32 ``[..., P, min(S, R + 1)]``, the leading singular values.
    """

    page_size: int
    rank: int
    head_dim: int
    basis_bits: int
    coef_bits: int
    basis: torch.Tensor
    basis_scale: torch.Tensor | None
    coef: torch.Tensor
    coef_scale: torch.Tensor | None
    centroid: torch.Tensor
    centroid_scale: torch.Tensor | None
    tau: torch.Tensor
    sigma: torch.Tensor
    # dequantized views, computed once: the stored tensors are never modified in place
    _float: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    # the axis that indexes pages, per stored field
    _PAGE_AXIS = {"basis": -3, "coef": -3, "basis_scale": -2, "coef_scale": -2, "centroid": -2,
                  "sigma": -2, "centroid_scale": -1, "tau": -1}

    @property
    def num_pages(self) -> int:
        return self.coef.shape[-3]

    @property
    def lead_shape(self) -> tuple[int, ...]:
        return tuple(self.coef.shape[:-3])

    # page axis of each dequantized view, for extending the cache on cat()
    _FLOAT_AXIS = {"basis": -3, "coef": -3, "centroid": -2}

    def _cached(self, name: str, fn) -> torch.Tensor:
        t = self._float.get(name)
        if t is None:
            t = self._float[name] = fn()
        return t

    def basis_float(self) -> torch.Tensor:
        """Dequantized basis, float32 ``[..., P, R, D]`` (computed once per object)."""
        return self._cached("basis", self._basis_float)

    def coef_float(self) -> torch.Tensor:
        """Dequantized coefficients, float32 ``[..., P, S, R]`` (computed once per object)."""
        return self._cached("coef", self._coef_float)

    def centroid_float(self) -> torch.Tensor:
        """Dequantized centroids, float32 ``[..., P, D]`` (computed once per object)."""
        return self._cached("centroid", self._centroid_float)

    def _basis_float(self) -> torch.Tensor:
        if self.basis_bits == 16:
            return self.basis.float()
        q = self.basis if self.basis_bits == 8 else unpack_bits(self.basis, self.basis_bits)
        return q.float() * self.basis_scale.float()[..., None]

    def _coef_float(self) -> torch.Tensor:
        if self.coef_bits == 16:
            return self.coef.float()
        return self.coef.float() * self.coef_scale.float()[..., None]

    def _centroid_float(self) -> torch.Tensor:
        if self.coef_bits == 16:
            return self.centroid.float()
        return self.centroid.float() * self.centroid_scale.float()[..., None]

    def bytes_per_page(self) -> tuple[int, int]:
        """``(payload, scales)`` bytes for one page of one KV head.

        At D=128, S=16, R=8 with int4 basis and int8 coefficients: payload 512 + 128 + 128 = 768,
        scales 2 * (8 + 16 + 1) = 50 (float16).
        """
        return summary_bytes(self.page_size, self.rank, self.head_dim, self.basis_bits, self.coef_bits)

    def _map(self, fn) -> "PageSummaries":
        kw = {f: (None if getattr(self, f) is None else fn(f, getattr(self, f))) for f in self._PAGE_AXIS}
        return PageSummaries(
            page_size=self.page_size, rank=self.rank, head_dim=self.head_dim,
            basis_bits=self.basis_bits, coef_bits=self.coef_bits, **kw,
        )

    def to(self, device) -> "PageSummaries":
        return self._map(lambda _, t: t.to(device))

    def select_pages(self, index: slice) -> "PageSummaries":
        """Summaries of a range of pages (slice over P)."""
        def take(name, t):
            axis = self._PAGE_AXIS[name]
            idx = [slice(None)] * t.dim()
            idx[t.dim() + axis] = index
            return t[tuple(idx)]
        return self._map(take)

    def index_lead(self, index: torch.Tensor) -> "PageSummaries":
        """Index the first leading dim (the batch), e.g. to reorder or repeat sequences."""
        return self._map(lambda _, t: t.index_select(0, index.to(t.device)))

    def cat(self, other: "PageSummaries") -> "PageSummaries":
        """Append ``other``'s pages after this one's (same config and leading dims)."""
        if (self.page_size, self.rank, self.head_dim, self.basis_bits, self.coef_bits) != (
            other.page_size, other.rank, other.head_dim, other.basis_bits, other.coef_bits
        ):
            raise ValueError("cannot concatenate summaries built with different configs")
        out = self._map(lambda f, t: torch.cat([t, getattr(other, f)], dim=self._PAGE_AXIS[f]))
        for name, t in self._float.items():  # extend the dequantized views: only the new pages are converted
            out._float[name] = torch.cat([t, getattr(other, f"{name}_float")()], dim=self._FLOAT_AXIS[name])
        return out
