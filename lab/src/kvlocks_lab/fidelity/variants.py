"""The selector variants a fidelity run measures, and their per-head page-score estimates.

Every variant turns one layer's captured queries into per-head page scores ``[H, Q, G, P]``
(log-masses, except the positional ``streaming`` and ``random``), plus, for summary-based
variants, the token logits they reconstruct ``[H, Q, G, P, S]``. Scores come from the
library's selectors (:mod:`kvlocks.selection`) wherever one exists; a GQA combine rule (or
per-head selection) then turns them into a selection (:mod:`kvlocks_lab.fidelity.metrics`).

======================  ===================================================================
name                    what
======================  ===================================================================
oracle                  exact page LSE, ``mean_share`` (reads every key)
oracle_max_share/_sum   exact page LSE with the ``max_share`` / ``sum_mass`` combine rule
oracle_per_head         exact page LSE, each query head its own top-k (G x the work)
locks                   Eq. 4 from LOCKS summaries: rank R, int4 basis, int8 coefficients
locks_max_share/_sum    the same scores with the other combine rules
locks_fp32              unquantized summaries (float32 spectral basis): Theorem 1's setting
locks_fp16/int8/int2    basis at float16 / int8 / int2 (coefficients int8; fp16: float16)
locks_r<R>_b<B>         rank R, basis bits B in (2, 4, 8, 16, 32), ``mean_share``
locks_rerank<C>[_r<R>]  locks's scores (rank R if given) choose C x (k - 2) candidates, their
                        exact page LSE the pages (:mod:`kvlocks.selection.rerank`,
                        ``LocksConfig.rerank = C``)
locks_hier<M>[_k<K>]    hierarchical scoring: groups of M pages with their own summaries (rank as
                        the run's), the best K x (k - 2) groups' pages scored (K = 1 by default;
                        :mod:`kvlocks_lab.selectors.hier`); ``locks_hierb``: groups scored by
                        an upper bound (:mod:`.group_bound`), ``locks_hierc``: by their pages'
                        centroids (:mod:`.group_centroids`)
locks_cascade<C>_r<R>   two tiers of page summaries: rank-R LOCKS summaries (int4 basis) of every
                        page choose C x (k - 2) candidates, the run's LOCKS summaries of the
                        candidates rank them (Eq. 4 on both tiers; the re-rank of
                        ``locks_rerank`` with Eq. 4 in place of the exact log-sum-exp)
locks_adapt<PCT>[_rule] int8 basis on pages whose key-norm range is above the PCT-th percentile
                        of their (layer, KV head), int4 elsewhere; rule prefill (default),
                        causal, calib (one model-wide threshold from the calibration prose) or
                        random (:mod:`kvlocks_lab.fidelity.adaptive`); not in the defaults
quest                   min/max envelope at matched bytes (float16, one envelope per page)
centroid                page mean key only (float16)
centroid_rerank<C>[_min<M>]  int8 page centroids choose C x (k - 2) candidates (at least M),
                        their exact page LSE the pages
loki                    global calibrated PCA (uncentred), rank matched to LOCKS's bytes
shadowkv                per-sequence basis + centroid + int8 coefficients, matched bytes
global                  ShadowKV's form with a global basis (calibration prose), matched bytes
streaming               sink + most recent pages
random                  sink + recent + random pages (a fresh seed per query step)
======================  ===================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvlocks.config import LocksConfig
from kvlocks_lab.fidelity import adaptive, scopes
from kvlocks.scoring.reference import summary_logits
from kvlocks.selection import LayerView
from kvlocks_lab.selectors import (
    CentroidSelector, QuestSelector, RandomSelector, StreamingSelector, locks_page_bytes, matched_selector,
    matched_settings,
)
from kvlocks.summary import build_summaries, spectral_basis

DEFAULT_VARIANTS = (
    "oracle", "oracle_per_head", "oracle_max_share", "oracle_sum_mass",
    "locks", "locks_max_share", "locks_sum_mass", "locks_fp32", "locks_int8", "locks_int2",
    "quest", "centroid", "loki", "shadowkv", "global", "streaming", "random",
)
COMBINES = ("mean_share", "max_share", "sum_mass")
_FIXED = {"quest", "centroid", "loki", "shadowkv", "global", "streaming", "random", "oracle_per_head"}
_LOCKS_BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4, "int2": 2}
_LOCKS = re.compile(r"^locks(?:_r(\d+))?(?:_b(2|4|8|16|32)|_(fp32|fp16|int8|int4|int2))?"
                    r"(?:_(mean_share|max_share|sum_mass))?$")
_ADAPT = re.compile(r"^locks_adapt(\d+)(?:_(causal|calib|random))?(?:_(mean_share|max_share|sum_mass))?$")
_ORACLE = re.compile(r"^oracle(?:_(mean_share|max_share|sum_mass))?$")
_RERANK = re.compile(r"^locks_rerank(\d+)(?:_r(\d+))?$")
_CENTROID_RERANK = re.compile(r"^centroid_rerank(\d+)(?:_min(\d+))?$")
_CASCADE = re.compile(r"^locks_cascade(\d+)_r(\d+)$")
_HIER = re.compile(r"^locks_hier(b|c)?(\d+)(?:_k(\d+))?(?:_r(\d+))?$")


@dataclass(frozen=True)
class Variant:
    """A parsed variant name.

    family : "oracle", "locks", or a baseline name
    combine : GQA combine rule (ignored when ``per_head``)
    rank, bits : LOCKS summary rank (None = the run's rank) and basis bits
    adapt, adapt_rule : adaptive precision: the percentile (1-99) of the page key-norm ranges
        above which the basis is int8 (``bits`` = 4 elsewhere), and the threshold rule
    """

    name: str
    family: str
    combine: str = "mean_share"
    per_head: bool = False
    rank: int | None = None
    bits: int = 4
    adapt: int | None = None
    adapt_rule: str = "prefill"
    rerank: int = 0
    rerank_min: int = 0  # at least this many candidates (pages), whatever the multiple gives
    group_pages: int = 0
    group_keep: int = 1
    group_rank: int | None = None  # rank of the group summaries (None: the run's rank)
    group_bound: bool = False  # groups scored by the upper bound of .group_bound, not Eq. 4
    group_centroids: bool = False  # groups scored by their pages' centroids (.group_centroids)
    cascade: bool = False  # the re-rank reads the run's LOCKS estimates of the candidates, not exact keys

    @property
    def estimates_lse(self) -> bool:
        """Scores estimate each page's log-sum-exp (so LSE MAE means something)."""
        return self.family not in ("streaming", "random")

    @property
    def needs_calibration(self) -> bool:
        """Fitted on the calibration prose: Loki's basis, the global bases, the ``calib`` adaptive rule."""
        return self.family in ("loki", "global") or (self.adapt is not None and self.adapt_rule == "calib")

    @property
    def reconstructs_logits(self) -> bool:
        return self.family in ("oracle", "locks", "loki", "shadowkv", "global")


def variant(name: str) -> Variant:
    """Parse a variant name (``ValueError`` naming the allowed forms)."""
    if name in _FIXED:
        return Variant(name=name, family="oracle" if name == "oracle_per_head" else name,
                       per_head=name == "oracle_per_head")
    m = _ORACLE.match(name)
    if m:
        return Variant(name=name, family="oracle", combine=m.group(1) or "mean_share")
    m = _RERANK.match(name)
    if m:
        c, rank = int(m.group(1)), m.group(2) and int(m.group(2))
        if not 2 <= c <= 64:
            raise ValueError(f"selector {name!r}: the candidate multiple must be in 2..64, got {c}")
        if rank is not None and not 1 <= rank <= 16:
            raise ValueError(f"selector {name!r}: the rank of the summaries choosing candidates must be in 1..16")
        return Variant(name=name, family="locks", rerank=c, rank=rank)
    m = _CENTROID_RERANK.match(name)
    if m:
        c, floor = int(m.group(1)), int(m.group(2) or 0)
        if not 2 <= c <= 64:
            raise ValueError(f"selector {name!r}: the candidate multiple must be in 2..64, got {c}")
        return Variant(name=name, family="centroid", bits=8, rerank=c, rerank_min=floor)
    m = _CASCADE.match(name)
    if m:
        c, rank = int(m.group(1)), int(m.group(2))
        if not 2 <= c <= 64 or not 1 <= rank <= 16:
            raise ValueError(f"selector {name!r}: the candidate multiple must be in 2..64 and the coarse rank in 1..16")
        return Variant(name=name, family="locks", rank=rank, rerank=c, cascade=True)
    m = _HIER.match(name)
    if m:
        pages, keep, rank = int(m.group(2)), int(m.group(3) or 1), m.group(4) and int(m.group(4))
        if not 2 <= pages <= 256 or keep < 1 or rank is not None and not 1 <= rank <= 16:
            raise ValueError(f"selector {name!r}: group pages must be in 2..256, K >= 1 and the group rank in 1..16")
        return Variant(name=name, family="locks", group_pages=pages, group_keep=keep, group_rank=rank,
                       group_bound=m.group(1) == "b", group_centroids=m.group(1) == "c")
    m = _ADAPT.match(name)
    if m:
        pct = int(m.group(1))
        if not 1 <= pct <= 99:
            raise ValueError(f"selector {name!r}: the adaptive percentile must be in 1..99, got {pct}")
        return Variant(name=name, family="locks", combine=m.group(3) or "mean_share", adapt=pct,
                       adapt_rule=m.group(2) or "prefill")
    m = _LOCKS.match(name)
    if m:
        rank = None if m.group(1) is None else int(m.group(1))
        if rank is not None and rank < 1:
            raise ValueError(f"selector {name!r}: rank must be >= 1")
        bits = int(m.group(2)) if m.group(2) else _LOCKS_BITS[m.group(3)] if m.group(3) else 4
        return Variant(name=name, family="locks", combine=m.group(4) or "mean_share", rank=rank, bits=bits)
    raise ValueError(f"unknown selector {name!r}; allowed {sorted(_FIXED | {'oracle', 'locks'})}, "
                     "oracle_<combine>, locks_<fp32|fp16|int8|int4|int2>[_<combine>], "
                     f"locks_r<R>_b<2|4|8|16|32>[_<combine>], locks_adapt<1..99>[_causal|_calib|_random][_<combine>], "
                     "locks_rerank<2..64>[_r<R>], centroid_rerank<2..64>[_min<pages>], locks_cascade<2..64>_r<1..16>, locks_hier[b|c]<2..256>[_k<K>][_r<R>] "
                     f"with combine in {COMBINES}")


def check_variant(name: str) -> None:
    variant(name)


@dataclass(frozen=True, eq=False)
class Resources:
    """What variants need beyond one layer's activations.

    page_size, rank : the LOCKS configuration measured
    loki : :class:`~kvlocks.selection.LokiCalibration` for the measured KV heads (or None)
    global_bases : :class:`~kvlocks_lab.fidelity.scopes.GlobalBases` (or None)
    seed : for ``random`` (and the ``random`` adaptive rule)
    calib_norm_ranges : float32 ``[pages]``, the calibration prose's page key-norm ranges pooled
        over layers and KV heads, for the ``calib`` adaptive rule (or None)
    """

    page_size: int
    rank: int
    loki: object = None
    global_bases: object = None
    seed: int = 0
    calib_norm_ranges: object = None

    def locks_config(self, rank: int | None = None, basis_bits: int = 4, coef_bits: int = 8) -> LocksConfig:
        return LocksConfig(page_size=self.page_size, rank=rank or self.rank, budget=2 * self.page_size,
                           basis_bits=basis_bits, coef_bits=coef_bits)


@dataclass(frozen=True, eq=False)
class Estimate:
    """scores float32 ``[H, Q, G, P]``; logits float32 ``[H, Q, G, P, S]`` or None;
    promoted bool ``[H, P]`` (adaptive variants: pages with an int8 basis) or None."""

    scores: torch.Tensor
    logits: torch.Tensor | None = None
    promoted: torch.Tensor | None = None


def bytes_per_page(v: Variant, res: Resources, head_dim: int, elem_size: int = 2,
                   promoted_share: float | None = None) -> int | float | None:
    """Resident summary bytes per page and KV head (payload + scales); None: reads the keys.

    ``elem_size``: bytes of a key element, for selectors stored in the key dtype.
    ``promoted_share``: adaptive variants only, the measured share of int8 pages (default: the
    nominal ``1 - adapt / 100``); their bytes are a mean over pages and include the flag byte.
    """
    cfg = res.locks_config()
    if v.family == "oracle":
        return None
    if v.adapt is not None:
        share = 1 - v.adapt / 100 if promoted_share is None else promoted_share
        return adaptive.mixed_bytes(res.locks_config(v.rank or res.rank), head_dim, share)["total"]
    if v.family == "locks":
        r = v.rank or res.rank
        if v.bits == 32:  # float32 basis, coefficients and centroid, no scales
            return 4 * (head_dim * r + res.page_size * r + head_dim)
        return locks_page_bytes(res.locks_config(r, v.bits, 16 if v.bits == 16 else 8), head_dim)
    selector = {"quest": lambda: QuestSelector(**matched_settings("quest", cfg, head_dim)),
                "centroid": lambda: CentroidSelector(bits=16),
                "loki": lambda: matched_selector("loki", cfg, head_dim),
                "shadowkv": lambda: matched_selector("shadowkv", cfg, head_dim),
                "global": lambda: matched_selector("shadowkv", cfg, head_dim),  # the same layout
                "streaming": StreamingSelector, "random": RandomSelector}[v.family]()
    return sum(selector.bytes_per_page(cfg, head_dim, elem_size))


def matched_rank(res: Resources, head_dim: int) -> int:
    """Rank of a shared basis (int8 coefficients + centroid) at LOCKS's bytes per page."""
    return matched_settings("shadowkv", res.locks_config(), head_dim, bits=8)["rank"]


def _locks(v: Variant, data, res: Resources) -> Estimate:
    q = data.flat_queries  # [H, M, D], M = Q*G
    rank = v.rank or res.rank
    if v.adapt is not None:
        promoted = adaptive.promote(data.pages, v.adapt / 100, v.adapt_rule, seed=res.seed * 100_003 + data.layer,
                                    calib=res.calib_norm_ranges)
        summ = adaptive.build_adaptive(data.pages, res.locks_config(rank), promoted)
        logits = data.unflatten(scopes.page_local_logits(q, summ.centroid_float(), summ.basis_float(),
                                                         summ.coef_float(), data.scale))  # [H, Q, G, P, S]
        return Estimate(scores=torch.logsumexp(logits, dim=-1), logits=logits, promoted=promoted)
    if v.bits == 32:
        mu, basis, coef, _, _ = spectral_basis(data.pages, rank)
        logits = scopes.page_local_logits(q, mu, basis, coef, data.scale)
    else:
        cfg = res.locks_config(rank, v.bits, 16 if v.bits == 16 else 8)
        logits = summary_logits(q, build_summaries(data.pages, cfg), scale=data.scale)  # [H, M, P, S]
    logits = data.unflatten(logits)
    return Estimate(scores=torch.logsumexp(logits, dim=-1), logits=logits)


def _view(data) -> LayerView:
    return LayerView(keys=data.keys, summaries=None, token_mask=None, scale=data.scale, layer=data.layer)


def _scores(selector, data, res: Resources) -> torch.Tensor:
    cfg = res.locks_config()
    return data.unflatten(selector.page_scores(data.flat_queries, _view(data), cfg))  # [H, Q, G, P]


def estimate(v: Variant, data, res: Resources, exact) -> Estimate:
    """Per-head page scores (and reconstructed logits) of variant ``v`` on one layer.

    data : :class:`~kvlocks_lab.fidelity.exact.LayerData`; exact : its
    :class:`~kvlocks_lab.fidelity.exact.ExactLayer` (the oracle's scores).
    """
    d = data.keys.shape[-1]
    cfg = res.locks_config()
    if v.family == "oracle":
        return Estimate(scores=exact.lse, logits=exact.logits)
    if v.family == "locks":
        return _locks(v, data, res)
    if v.family == "quest":
        return Estimate(scores=_scores(QuestSelector(**matched_settings("quest", cfg, d)), data, res))
    if v.family == "centroid":
        return Estimate(scores=_scores(CentroidSelector(bits=v.bits if v.rerank else 16), data, res))
    if v.family == "streaming":
        return Estimate(scores=_scores(StreamingSelector(), data, res))
    if v.family == "random":
        view, qs = _view(data), data.queries
        rows = [RandomSelector(seed=res.seed * 100_003 + t).page_scores(qs[:, t], view, cfg)
                for t in range(qs.shape[1])]
        return Estimate(scores=torch.stack(rows, dim=1))  # [H, Q, G, P]
    if v.family == "loki":
        if res.loki is None:
            raise ValueError("the 'loki' variant needs a calibration (Resources.loki)")
        sel = matched_selector("loki", cfg, d, calibration=res.loki)
        basis = res.loki.basis(data.layer, sel.resolved_rank(cfg, d))  # [H, D, r]
        logits = scopes.loki_logits(data.flat_queries, data.pages, basis, sel.bits, data.scale)
        return Estimate(scores=_scores(sel, data, res), logits=data.unflatten(logits))
    if v.family == "shadowkv":
        sel = matched_selector("shadowkv", cfg, d)
        logits = scopes.sequence_logits(data.flat_queries, data.pages, sel.resolved_rank(cfg, d), sel.bits, data.scale)
        return Estimate(scores=_scores(sel, data, res), logits=data.unflatten(logits))
    if v.family == "global":
        if res.global_bases is None:
            raise ValueError("the 'global' variant needs calibrated bases (Resources.global_bases)")
        w = res.global_bases.basis(data.layer, matched_rank(res, d))
        logits = data.unflatten(scopes.shared_basis_logits(data.flat_queries, data.pages, w, 8, data.scale))
        return Estimate(scores=torch.logsumexp(logits, dim=-1), logits=logits)
    raise ValueError(f"no estimator for variant family {v.family!r}")
