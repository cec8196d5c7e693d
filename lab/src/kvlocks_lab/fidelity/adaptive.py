"""Adaptive basis precision: an int8 basis for the pages whose key-norm range is in the top tail
of their (layer, KV head), an int4 basis for the rest. A measurement variant of the fidelity
lab only; the Triton kernels and the paged summary store stay int4.

Why the norm range: ``docs/fidelity.md`` ("Quantization tails") found that of the worst 1 % of
pages by int4-vs-fp32 log-mass error, 71 % lie in the top 10 % by key-norm range
``max_i ||k_i|| - min_i ||k_i||`` (7x chance), a property of the page alone, known when the page
is built.

The threshold is a ``q`` quantile of page norm ranges; a page is promoted to int8 when its norm
range is strictly above it. Rules (which pages the quantile is over):

- ``prefill``: the quantile over the prefill's pages, computed once after prefill (a real system
  builds all prefill summaries in one batch, so it has them all; pages built during decode would
  use the frozen threshold). Every measured page of the fidelity lab is a prefill page, so this
  promotes the top ``1 - q`` of each (layer, KV head).
- ``causal``: the quantile over the pages built so far in that (layer, KV head), this page
  included (what a system that builds one page at a time knows). Early pages are promoted more
  often (page 1 is promoted whenever its range exceeds page 0's).
- ``calib``: one model-wide threshold, the ``q`` quantile of the norm ranges of the calibration
  prose's pages pooled over every layer and KV head (:func:`calibration_ranges`; computed once
  per model, offline). Layers and heads with wide norm ranges then get more int8 pages than
  others, and the promoted share on other text is whatever it turns out to be.
- ``random``: a control, not a predictor: per (layer, KV head) as many pages as ``prefill``
  promotes, chosen at random. Same bytes, no prediction.

``prefill`` and ``causal`` are per (layer, KV head) rather than pooled over a layer's KV heads:
the promoted share is then ``1 - q`` in every head, so the extra bytes are spread evenly over
the store's per-head pools. ``calib`` is the pooled alternative: the finding of
``docs/fidelity.md`` (71 % of the worst pages in the top decile) is for a decile pooled over all
layers, heads and prompts. Measured on the bundled model at q = 0.9 (``docs/fidelity.md``,
"Adaptive basis precision"): ``prefill`` promotes 10.1 % of the pages and 38 % of the worst 1 %,
``calib`` 13.4 % and 79 %.

Bytes: coefficients (int8, per-row scales) and centroid (int8) are the same at both basis
precisions; the basis costs ``D * R / 2`` B at int4 and ``D * R`` B at int8, with ``R`` float16
scales either way, and each page carries one flag byte (:data:`FLAG_BYTES`) saying which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlocks.config import LocksConfig
from kvlocks.summary import PageSummaries, build_summaries
from kvlocks.summary.types import summary_bytes as _page_bytes

RULES = ("prefill", "causal", "calib", "random")
LOW_BITS, HIGH_BITS = 4, 8
FLAG_BYTES = 1  # one uint8 per page and KV head saying int4 or int8 (a packed bit would be 1/8 B)


def norm_range(pages: torch.Tensor) -> torch.Tensor:
    """``max_i ||k_i|| - min_i ||k_i||`` per page: pages ``[H, P, S, D]`` -> float32 ``[H, P]``."""
    norms = pages.float().norm(dim=-1)  # [H, P, S]
    return norms.amax(-1) - norms.amin(-1)


def calibration_ranges(keys_per_layer, page_size: int) -> torch.Tensor:
    """Norm ranges of the whole pages of calibration keys, pooled: one ``[..., N, D]`` tensor per
    layer -> float32 ``[pages over all layers and heads]`` (the ``calib`` rule's statistic)."""
    out = []
    for k in keys_per_layer:
        n = k.shape[-2] // page_size * page_size
        out.append(norm_range(k[..., :n, :].unflatten(-2, (n // page_size, page_size))).flatten())  # [.. * P]
    return torch.cat(out) if out else torch.zeros(0)


def _check(q: float, rule: str) -> None:
    if not isinstance(q, (int, float)) or not 0.0 < float(q) < 1.0:
        raise ValueError(f"adaptive quantile q={q!r}: must be in (0, 1)")
    if rule not in RULES:
        raise ValueError(f"adaptive rule={rule!r}: allowed {RULES}")


def promote(pages: torch.Tensor, q: float, rule: str = "prefill", seed: int = 0,
            calib: torch.Tensor | None = None) -> torch.Tensor:
    """Which pages get an int8 basis: pages ``[H, P, S, D]`` -> bool ``[H, P]`` (True = int8).

    q : quantile of the (layer, KV head)'s norm ranges above which a page is promoted, in (0, 1)
    rule : one of :data:`RULES` (see the module docstring); seed : for "random"
    calib : for "calib", the pooled calibration norm ranges (:func:`calibration_ranges`)
    """
    _check(q, rule)
    x = norm_range(pages).double()  # [H, P]
    if rule == "calib":
        if calib is None or calib.numel() == 0:
            raise ValueError("adaptive rule 'calib' needs the calibration norm ranges (calib=)")
        return x > torch.quantile(calib.double(), q)
    if x.shape[-1] == 0:
        return torch.zeros(x.shape, dtype=torch.bool)
    if rule == "causal":
        thr = torch.stack([torch.quantile(x[:, : j + 1], q, dim=-1) for j in range(x.shape[-1])], dim=-1)  # [H, P]
        return x > thr
    flags = x > torch.quantile(x, q, dim=-1, keepdim=True)  # [H, P]
    if rule == "prefill":
        return flags
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros_like(flags)
    for h, n in enumerate(flags.sum(-1).tolist()):
        out[h, torch.randperm(x.shape[-1], generator=gen)[:n]] = True
    return out


def summary_bytes(config: LocksConfig, head_dim: int, basis_bits: int) -> tuple[int, int]:
    """``(payload, scales)`` of one page at ``basis_bits`` (= ``PageSummaries.bytes_per_page``)."""
    return _page_bytes(config.page_size, config.rank, head_dim, basis_bits, config.coef_bits)


def mixed_bytes(config: LocksConfig, head_dim: int, promoted_share: float) -> dict[str, float]:
    """Mean bytes per page and KV head when ``promoted_share`` of the pages store an int8 basis."""
    lo, hi = summary_bytes(config, head_dim, LOW_BITS), summary_bytes(config, head_dim, HIGH_BITS)
    payload = lo[0] + promoted_share * (hi[0] - lo[0])
    scales = lo[1] + promoted_share * (hi[1] - lo[1])
    return {"payload": payload, "scales": scales, "flags": FLAG_BYTES, "total": payload + scales + FLAG_BYTES,
            "int4": sum(lo), "int8": sum(hi)}


@dataclass(frozen=True, eq=False)
class AdaptiveSummaries:
    """Per-page int4/int8 basis summaries of ``[H, P]`` pages.

    low, high : the int4 and int8 builds of the same pages (identical coefficients and centroid)
    promoted : bool ``[H, P]``, True where the page uses ``high``'s basis
    """

    low: PageSummaries
    high: PageSummaries
    promoted: torch.Tensor

    def basis_float(self) -> torch.Tensor:
        """float32 ``[H, P, R, D]``: the int8 basis on promoted pages, the int4 basis elsewhere."""
        return torch.where(self.promoted[..., None, None], self.high.basis_float(), self.low.basis_float())

    def coef_float(self) -> torch.Tensor:
        """float32 ``[H, P, S, R]`` (the same at both basis precisions)."""
        return self.low.coef_float()

    def centroid_float(self) -> torch.Tensor:
        """float32 ``[H, P, D]`` (the same at both basis precisions)."""
        return self.low.centroid_float()

    def bytes_per_page(self) -> dict[str, float]:
        """Mean payload, scales and flag bytes per page and KV head (see :func:`mixed_bytes`)."""
        share = float(self.promoted.float().mean()) if self.promoted.numel() else 0.0
        cfg = LocksConfig(page_size=self.low.page_size, rank=self.low.rank, budget=2 * self.low.page_size,
                          coef_bits=self.low.coef_bits)
        return mixed_bytes(cfg, self.low.head_dim, share)


def build_adaptive(pages: torch.Tensor, config: LocksConfig, promoted: torch.Tensor) -> AdaptiveSummaries:
    """Build both precisions of ``pages`` ``[H, P, S, D]`` and mark ``promoted`` bool ``[H, P]``."""
    if promoted.shape != pages.shape[:-2] or promoted.dtype != torch.bool:
        raise ValueError(f"promoted must be bool {tuple(pages.shape[:-2])}, got {promoted.dtype} "
                         f"{tuple(promoted.shape)}")
    low = build_summaries(pages, config.replace(basis_bits=LOW_BITS))
    high = build_summaries(pages, config.replace(basis_bits=HIGH_BITS))
    return AdaptiveSummaries(low=low, high=high, promoted=promoted)
