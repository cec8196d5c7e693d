"""Quantization tails: the log-mass error that int8 / int4 / int2 summaries add, its extremes, and
whether the tail pages are predictable from page properties.

Per page and query head the error is ``|s_hat_bits - s_hat_fp32|`` (the quantized Eq. 4 score
against the unquantized one), and ``|s_hat - s|`` against the exact LSE for context. Pages are
then described by properties known at build time:

- ``norm_range``: ``max_i ||k_i|| - min_i ||k_i||`` over the page's keys;
- ``gap``: ``sigma_R / sigma_{R+1}``, the spectral gap at the summary rank (log10, capped at 6);
- ``sigma1``: the largest singular value of the centred page (the scale of its coefficients).

:class:`TailStats` accumulates pages over layers and prompts; :meth:`TailStats.summary` gives
pooled quantiles and, per property, the Spearman correlation with the page's mean error (pooled,
and the mean over units of the correlation within one layer and prompt) and the share of the
worst 1 % of pages that fall in the property's most extreme 10 % (10 % by chance).

Adaptive-precision variants (:mod:`kvlocks_lab.fidelity.adaptive`) come in as ``extra``: their
errors against fp32 and exact, sampled with one generator per variant (seeded by its name) so
that every other comparison draws exactly the same samples with or without it, and their
promoted (int8) pages, to report the promoted share and how many of the worst 1 % int4 pages
they promote. ``page_quantiles`` gives quantiles of the per-page mean error (over query heads
and steps) for every precision.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

QUANTILES = {"median": 50.0, "p95": 95.0, "p99": 99.0}
PROPERTIES = ("norm_range", "gap", "sigma1")
SAMPLE = 4096  # default errors kept per (unit, bits) for pooled quantiles; the max is tracked exactly


def page_properties(pages: torch.Tensor, sigma: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
    """pages ``[H, P, S, D]``, sigma ``[H, P, >= R+1]`` (descending singular values) -> ``[H, P]`` each."""
    norms = pages.float().norm(dim=-1)  # [H, P, S]
    s_r, s_next = sigma[..., rank - 1], sigma[..., rank]
    gap = torch.where(s_next > 0, s_r / s_next.clamp_min(1e-30), torch.full_like(s_r, 1e6))
    return {"norm_range": norms.amax(-1) - norms.amin(-1), "gap": gap.clamp(1, 1e6).log10(), "sigma1": sigma[..., 0]}


def quantiles(x: np.ndarray) -> dict:
    out = {k: float(np.percentile(x, q)) for k, q in QUANTILES.items()}
    out["max"] = float(x.max())
    return out


class TailStats:
    """Accumulates quantization errors and page properties (see the module docstring)."""

    def __init__(self, seed: int = 0, *, sample: int = SAMPLE) -> None:
        self.sample = sample  # errors kept per (unit, bits) for the pooled quantiles
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        self.extra_rng: dict[str, np.random.Generator] = {}  # one per adaptive variant, seeded by its name
        self.page_mean: dict[str, list[np.ndarray]] = {}  # per-page mean error vs fp32, by precision
        self.promoted: dict[str, list[np.ndarray]] = {}
        self.samples: dict[str, list[np.ndarray]] = {}
        self.maxima: dict[str, float] = {}
        self.page_err: list[np.ndarray] = []
        self.props: dict[str, list[np.ndarray]] = {p: [] for p in PROPERTIES}

    def _keep(self, key: str, err: torch.Tensor, rng: np.random.Generator | None = None) -> dict:
        x = err.flatten().numpy()
        idx = (rng or self.rng).choice(x.size, size=min(self.sample, x.size), replace=False)
        self.samples.setdefault(key, []).append(x[idx])
        self.maxima[key] = max(self.maxima.get(key, 0.0), float(x.max()))
        return quantiles(x)

    def add(self, exact_lse: torch.Tensor, unq: torch.Tensor, quantized: dict[int, torch.Tensor],
            props: dict[str, torch.Tensor], tail_bits: int = 4,
            extra: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict:
        """One unit: scores ``[H, Q, G, P]``; props ``[H, P]``; extra: name -> (scores, promoted
        bool ``[H, P]``). Returns the unit's quantiles."""
        row = {"fp32_vs_exact": self._keep("fp32_vs_exact", (unq - exact_lse).abs())}
        for bits, s in sorted(quantized.items(), reverse=True):
            row[f"int{bits}_vs_fp32"] = self._keep(f"int{bits}_vs_fp32", (s - unq).abs())
            row[f"int{bits}_vs_exact"] = self._keep(f"int{bits}_vs_exact", (s - exact_lse).abs())
        for name, (s, _) in (extra or {}).items():
            rng = self.extra_rng.setdefault(name, np.random.default_rng([self.seed, zlib.crc32(name.encode())]))
            row[f"{name}_vs_fp32"] = self._keep(f"{name}_vs_fp32", (s - unq).abs(), rng)
            row[f"{name}_vs_exact"] = self._keep(f"{name}_vs_exact", (s - exact_lse).abs(), rng)
        if tail_bits in quantized:
            err = (quantized[tail_bits] - unq).abs().mean(dim=(1, 2))  # [H, P]
            self.page_err.append(err.flatten().numpy())
            for p in PROPERTIES:
                self.props[p].append(props[p].flatten().numpy())
            per_page = {f"int{b}": s for b, s in quantized.items()} | {n: s for n, (s, _) in (extra or {}).items()}
            for name, s in per_page.items():
                self.page_mean.setdefault(name, []).append((s - unq).abs().mean(dim=(1, 2)).flatten().numpy())
            for name, (_, flags) in (extra or {}).items():
                self.promoted.setdefault(name, []).append(flags.flatten().numpy())
        return row

    def summary(self, tail_bits: int = 4) -> dict:
        """Pooled quantiles per comparison, and the tail-predictability study."""
        from scipy.stats import spearmanr

        out = {"quantiles": {}, "tail_bits": tail_bits, "predictability": {}}
        for key, parts in self.samples.items():
            q = quantiles(np.concatenate(parts))
            q["max"] = self.maxima[key]
            out["quantiles"][key] = q
        if not self.page_err:
            return out
        err = np.concatenate(self.page_err)
        worst = err >= np.percentile(err, 99)
        out["pages"] = int(err.size)
        out["page_quantiles"] = {k: quantiles(np.concatenate(v)) for k, v in self.page_mean.items()}
        out["adaptive"] = {}
        for name, parts in self.promoted.items():
            flags = np.concatenate(parts)
            out["adaptive"][name] = {"promoted_share": float(flags.mean()),
                                     "worst1pct_int4_pages_promoted": float(flags[worst].mean())}
        for p in PROPERTIES:
            x = np.concatenate(self.props[p])
            rho = float(spearmanr(x, err).statistic)
            hi = x >= np.percentile(x, 90) if rho >= 0 else x <= np.percentile(x, 10)
            within = [spearmanr(a, e).statistic for a, e in zip(self.props[p], self.page_err) if np.ptp(a) > 0]
            out["predictability"][p] = {"spearman": rho, "spearman_within_unit": float(np.nanmean(within)),
                                        "worst1pct_in_extreme10pct": float(hi[worst].mean())}
        return out
