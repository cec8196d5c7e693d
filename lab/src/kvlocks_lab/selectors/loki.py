"""Loki baseline: one global PCA basis per layer and KV head, calibrated offline.

Loki observes that keys live near a low-dimensional subspace that is stable across inputs, so it
fits a PCA basis once, offline, on calibration text, keeps the keys rotated into that basis and
scores with the first ``r`` dimensions only. Here (page-level, like every selector in kvlocks):

- calibration: for each layer and KV head, the eigenvectors of the keys' second-moment matrix
  ``sum_i k_i k_i^T`` (uncentred PCA, float64), by decreasing eigenvalue. Uncentred, so that the
  full rotation preserves ``q.k`` exactly and rank ``r`` keeps the directions of largest
  ``E[(u.k)^2]``;
- scoring: ``q_r = P_r^T q`` and ``k_r = P_r^T k`` (``P_r [D, r]``), logits ``scale * q_r.k_r``,
  page score = the exact log-sum-exp of those logits over the page's real tokens. At ``r = D``
  and ``bits = 32`` this is the exact page log-sum-exp.

The calibration must come from different text than the evaluation (that is Loki's premise, and
a fair comparison). Build it with :meth:`LokiCalibration.fit` from keys, or :func:`calibrate`
from a model and calibration token ids, and pass it in:
``LocksCache(model.config, method=LokiSelector(calibration), config=...)``. The layer index
reaches :meth:`LokiSelector.page_scores` through ``LayerView.layer`` (set by the HF decode path).

Bytes: the reference projects ``view.keys`` each step; a deployed Loki keeps the rotated keys
resident and reads ``S * r`` values per page at ``bits`` (8: int8 with one float16 scale per key;
16; 32), plus the ``[D, r]`` float16 basis once per KV head and step to project the query.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlocks.config import LocksConfig
from kvlocks.selection.pages import (
    check_bits, check_rank, fake_quant, full_pages, mask_empty_pages, masked_page_lse, page_mask,
)
from kvlocks_lab.selectors.matched_bytes import loki_bytes, matched_loki

HOW_TO_CALIBRATE = (
    "the 'loki' selector needs an offline PCA calibration, fitted on text different from the "
    "evaluation text: calib = kvlocks_lab.selectors.loki.calibrate(model, calibration_ids) (or "
    "LokiCalibration.fit([keys of each layer, [B, Hkv, N, D]])), then "
    "LocksCache(model.config, method=LokiSelector(calib), config=...)"
)


@dataclass(frozen=True, eq=False, repr=False)
class LokiCalibration:
    """Per-layer PCA bases.

    bases : tuple of float32 ``[Hkv, D, D]``, one per layer; column ``i`` is the i-th principal
        direction (decreasing second moment)
    energy : tuple of float32 ``[Hkv, D]``, the matching eigenvalues (diagnostics)
    """

    bases: tuple[torch.Tensor, ...]
    energy: tuple[torch.Tensor, ...]

    @classmethod
    def fit(cls, keys_per_layer: Sequence[torch.Tensor]) -> "LokiCalibration":
        """Fit from calibration keys, one tensor ``[..., Hkv, N, D]`` per layer (all rows pooled)."""
        if isinstance(keys_per_layer, torch.Tensor) or not len(keys_per_layer):
            raise ValueError("LokiCalibration.fit expects a non-empty sequence of per-layer key tensors")
        bases, energy = [], []
        for i, k in enumerate(keys_per_layer):
            if k.dim() < 3:
                raise ValueError(f"calibration keys of layer {i}: expected [..., Hkv, N, D], got {tuple(k.shape)}")
            x = k.reshape(-1, *k.shape[-3:]).transpose(0, 1).flatten(1, 2).double()  # [Hkv, rows*N, D]
            evals, evecs = torch.linalg.eigh(x.transpose(-1, -2) @ x)  # ascending
            bases.append(evecs.flip(-1).float())  # [Hkv, D, D]
            energy.append(evals.flip(-1).float())  # [Hkv, D]
        return cls(bases=tuple(bases), energy=tuple(energy))

    @property
    def num_layers(self) -> int:
        return len(self.bases)

    def __repr__(self) -> str:
        hkv, d, _ = self.bases[0].shape
        return f"LokiCalibration(layers={self.num_layers}, Hkv={hkv}, D={d})"

    def basis(self, layer: int | None, rank: int) -> torch.Tensor:
        """Float32 ``[Hkv, D, r]``: the first ``rank`` principal directions of ``layer``."""
        if layer is None:
            if self.num_layers != 1:
                raise ValueError(
                    f"LayerView.layer is None but the Loki calibration has {self.num_layers} layers; "
                    "pass LayerView(..., layer=i)"
                )
            layer = 0
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer}: the Loki calibration has layers 0..{self.num_layers - 1}")
        return self.bases[layer][..., :rank]


@torch.inference_mode()
def calibrate(model, calibration_ids: torch.Tensor) -> LokiCalibration:
    """Run a dense prefill of ``calibration_ids [B, T]`` and fit a calibration on its post-RoPE keys."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    # newer transformers take the cache as ``cache``, older ones as ``past_key_values``
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    model(input_ids=calibration_ids.to(model.device), use_cache=True, **{kw: cache})
    return LokiCalibration.fit([layer.keys for layer in cache.layers])


class LokiSelector:
    """Exact page LSE of rank-r PCA-projected logits; see the module docstring.

    Parameters
    ----------
    calibration : LokiCalibration, required to score (a clear error says how to build one)
    rank : r, at most D; ``None`` = the rank whose bytes per page match LOCKS's
        (:func:`kvlocks_lab.selectors.matched_bytes.matched_loki`)
    bits : 8, 16 (the published Loki keeps float16 keys) or 32, precision of the projected keys
    """

    name = "loki"
    needs_summaries = False
    reads_all_keys = False

    def __init__(self, calibration: LokiCalibration | None = None, *, rank: int | None = None, bits: int = 16) -> None:
        if calibration is not None and not isinstance(calibration, LokiCalibration):
            raise ValueError(f"LokiSelector.calibration must be a LokiCalibration, got {type(calibration).__name__}")
        check_rank("LokiSelector", rank)
        check_bits("LokiSelector", bits)
        self.calibration = calibration
        self.rank = rank
        self.bits = bits

    def prepare(self, model, tokenizer, prompt: str) -> "LokiSelector":
        """This selector calibrated on 2,048 tokens of stdlib prose sharing no sentence with
        ``prompt`` (Loki's PCA must be fitted on other text than it is evaluated on)."""
        import torch

        from kvlocks.corpus import calibration_text

        ids, _ = calibration_text(tokenizer, tokens=2049, avoid=[prompt], seed=0)  # as the fidelity lab's
        calib = calibrate(model, torch.tensor([ids], device=model.device))
        return LokiSelector(calib, rank=self.rank, bits=self.bits)

    def __repr__(self) -> str:
        layers = None if self.calibration is None else self.calibration.num_layers
        return f"LokiSelector(calibration_layers={layers}, rank={self.rank}, bits={self.bits})"

    def resolved_rank(self, config: LocksConfig, head_dim: int) -> int:
        if self.rank is None:
            return matched_loki(config, head_dim, bits=self.bits)["rank"]
        if self.rank > head_dim:
            raise ValueError(f"LokiSelector.rank={self.rank}: must be <= head_dim={head_dim}")
        return self.rank

    def _basis(self, view, head_dim: int, rank: int) -> torch.Tensor:
        if self.calibration is None:
            raise ValueError(HOW_TO_CALIBRATE)
        p = self.calibration.basis(view.layer, rank)  # [Hkv, D, r]
        hkv = view.keys.shape[-3] if view.keys.dim() >= 3 else 1
        if p.shape[0] != hkv or p.shape[1] != head_dim:
            raise ValueError(
                f"Loki calibration has Hkv={p.shape[0]}, D={p.shape[1]} but the keys have Hkv={hkv}, D={head_dim}"
            )
        p = p.to(view.keys.device)
        return p if self.bits == 32 else p.half().float()  # the basis is stored in float16

    def page_scores(self, queries: torch.Tensor, view, config: LocksConfig) -> torch.Tensor:
        """queries ``[..., G, D]`` -> float32 ``[..., G, Pc]`` page LSEs in the rank-r PCA space."""
        d = queries.shape[-1]
        p = self._basis(view, d, self.resolved_rank(config, d))  # [Hkv, D, r]
        if view.keys.dim() < 3:
            p = p[0]  # keys [N, D]: a single KV head
        pages = full_pages(view.keys, config.page_size)  # [..., Pc, S, D]
        pm = page_mask(view.token_mask, config.page_size, pages.shape[-3])
        k_r = fake_quant(pages @ p.unsqueeze(-3), self.bits)  # [..., Pc, S, r]
        q_r = queries.float() @ p  # [..., G, r]
        logits = torch.einsum("...gr,...psr->...gps", q_r, k_r) * view.scale  # [..., G, Pc, S]
        return mask_empty_pages(masked_page_lse(logits, pm), pm)

    def bytes_per_page(self, config: LocksConfig, head_dim: int, elem_size: int) -> tuple[int, int]:
        """``(payload, scales)`` bytes read per page, one KV head (basis excluded)."""
        return loki_bytes(config.page_size, self.resolved_rank(config, head_dim), self.bits)

    def selection_bytes(self, config: LocksConfig, head_dim: int, elem_size: int, full_pages: int) -> float:
        """Bytes read to score ``full_pages`` pages, one KV head: projected keys + the float16 basis."""
        per_page = sum(self.bytes_per_page(config, head_dim, elem_size))
        return float(full_pages * per_page + 2 * head_dim * self.resolved_rank(config, head_dim))
