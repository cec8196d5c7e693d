"""Measure one layer of one prompt: every variant x budget x KV head, the bounds, the ladder and
the quantization tails, as JSON-able rows (one per measurement).

Row kinds (all carry ``prompt``, ``task``, ``layer`` and, except ``quant``, ``kv_head``):

- ``scores`` (variant): ``lse_mae``, ``lse_bias``, ``logit_mae`` (summary-based variants only),
  ``spearman``, ``kendall`` (page scores against exact page LSE, per query head and step);
- ``selection`` (variant, budget): ``coverage`` (mean over steps and query heads),
  ``coverage_p5``, ``coverage_worst_qhead`` (the group's worst query head, mean over steps),
  ``out_rel_err``, and with a needle ``carrier`` (mean fraction of carrier pages selected),
  ``carrier_hot_hits`` / ``carrier_hot_n`` (the same over carrier-attending steps and query
  heads only) and ``carrier_of_oracle_hits`` / ``_n`` (carrier pages kept, out of those the
  exact selection keeps);
- ``eta``: per step ``eta`` (unquantized summaries, Eq. 6), ``eq7`` (its bound), ``eta_int4``;
- ``retention`` (budget): per step ``ratio`` (group-mean coverage of the unquantized LOCKS
  selection over the exact selection's), ``eq8`` (``exp(-4 eta)``), ``out_err`` (group-mean
  ``||o_S - o||``), ``eq9`` and ``eq9_printed`` (:mod:`kvlocks_lab.fidelity.bounds`);
- ``energy`` (scope): captured within-page energy at ranks 1.. (:mod:`kvlocks_lab.fidelity.ladder`);
- ``quant``: quantiles of the quantization log-mass errors over the layer's measured heads
  (adaptive-precision variants as ``adapt<PCT>[_rule]_vs_fp32`` / ``_vs_exact``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvlocks_lab.fidelity import bounds, ladder, metrics
from kvlocks_lab.fidelity.exact import ExactLayer, LayerData, exact_layer
from kvlocks_lab.fidelity.tails import TailStats, page_properties
from kvlocks_lab.fidelity.variants import Estimate, Resources, Variant, estimate, variant
from kvlocks.config import LocksConfig
from kvlocks.scoring.reference import score_pages_from_summaries
from kvlocks_lab.fidelity.group_bound import bound_groups, bound_scores
from kvlocks_lab.fidelity.group_centroids import centroid_group_scores
from kvlocks_lab.selectors.hier import Groups, group_summaries
from kvlocks.summary import spectral_basis

SCATTER = ("locks", "shadowkv", "global", "loki")  # variants sampled for the share figure


def _r(x, digits: int = 6):
    """Round floats for compact JSON (None and NaN become None); tensors and arrays become lists."""
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_r(v, digits) for v in x]
    x = float(x)
    return None if not np.isfinite(x) else float(f"{x:.{digits}g}")


class LayerMeasure:
    """Measures one layer; ``rows`` collects the results, ``scatter`` the share samples.

    Parameters
    ----------
    data : LayerData; heads : the KV head indices its H rows are (for the rows)
    res : Resources; budgets : tokens; variants : names; base : fields of every row
    hot_share, kendall_stride, scatter_pages : see :class:`~kvlocks_lab.fidelity.config.FidelityConfig`
    """

    def __init__(self, data: LayerData, heads: list[int], res: Resources, *, budgets, variants, base: dict,
                 hot_share: float, kendall_stride: int, scatter_pages: int, rng: np.random.Generator) -> None:
        self.data, self.heads, self.res, self.base = data, heads, res, base
        self.budgets, self.hot_share = budgets, hot_share
        self.kendall_stride, self.scatter_pages, self.rng = kendall_stride, scatter_pages, rng
        self.variants = [variant(v) for v in variants]
        self.exact: ExactLayer | None = None
        self.cache: dict[str, Estimate] = {}
        self._oracle: dict[int, torch.Tensor] = {}
        self._groups: dict[tuple, torch.Tensor] = {}  # (group pages, group rank, bound) -> scores
        self.spectral: tuple | None = None  # unquantized spectral_basis of the pages, set by run()
        self.rows: list[dict] = []
        self.scatter: dict[str, list[list[float]]] = {}

    def _row(self, kind: str, h: int | None, **fields) -> None:
        row = {"kind": kind, **self.base, "layer": self.data.layer}
        if h is not None:
            row["kv_head"] = self.heads[h]
        row.update(fields)
        self.rows.append(row)

    def estimate(self, name: str) -> Estimate:
        v = variant(name)
        key = f"{v.family}:{v.rank}:{v.bits}:{v.adapt}:{v.adapt_rule}"  # combine rules share one estimate
        if key not in self.cache:
            self.cache[key] = estimate(v, self.data, self.res, self.exact)
        return self.cache[key]

    def run(self, tails: TailStats) -> None:
        self.exact = exact_layer(self.data)
        self.spectral = spectral_basis(self.data.pages, self.res.rank)  # mu, basis, coef, tau, sigma
        for v in self.variants:
            est = self.estimate(v.name)
            self._scores(v, est)
            self._selection(v, est)
            if v.name in SCATTER:
                self._sample(v.name, est)
        self._theory()
        self._energy()
        self._tails(tails)

    def _scores(self, v: Variant, est: Estimate) -> None:
        ex = self.exact
        for h in range(len(self.heads)):
            s, e = est.scores[h], ex.lse[h]  # [Q, G, P]
            p = s.shape[-1]
            every = self.kendall_stride
            kend = metrics.kendall_rows(s[::every].reshape(-1, p), e[::every].reshape(-1, p))
            fields = {"spearman": _r(np.nanmean(metrics.spearman_rows(s.reshape(-1, p), e.reshape(-1, p)))),
                      "kendall": _r(np.nanmean(kend) if np.isfinite(kend).any() else np.nan)}
            if v.estimates_lse:
                fields["lse_mae"] = _r(metrics.mean_abs_error(s, e))
                fields["lse_bias"] = _r(float((s - e).mean()))
            if est.logits is not None and v.reconstructs_logits:
                fields["logit_mae"] = _r(metrics.mean_abs_error(est.logits[h], ex.logits[h]))
            self._row("scores", h, selector=v.name, **fields)

    def _selection(self, v: Variant, est: Estimate) -> None:
        ex, carriers = self.exact, self.data.carrier_mask()
        for budget in self.budgets:
            mask = metrics.selection_mask(est.scores, budget // self.data.page_size, combine=v.combine,
                                          per_head=v.per_head, exact=self._rerank_scores(v), rerank=v.rerank,
                                          rerank_min=v.rerank_min,
                                          group_scores=self._group_scores(v),
                                          group_pages=v.group_pages, group_keep=v.group_keep)  # [H, Q, G, P]
            cov = metrics.coverage(ex.share, mask)  # [H, Q, G]
            _, rel = metrics.output_errors(ex.share, ex.page_out, ex.out, mask)
            ret = None if carriers is None else metrics.carrier_retention(mask, carriers)
            hot = None if carriers is None else (ex.share * carriers).sum(-1) >= self.hot_share  # [H, Q, G]
            if carriers is not None:
                kept = self._oracle_mask(budget) & carriers  # [H, Q, G, P]: carriers the exact selection keeps
                of_oracle = ((mask & kept).sum(dim=(1, 2, 3)), kept.sum(dim=(1, 2, 3)))  # [H], [H]
            for h in range(len(self.heads)):
                c = cov[h]
                fields = {"coverage": _r(c.mean()), "coverage_p5": _r(torch.quantile(c.flatten(), 0.05)),
                          "coverage_worst_qhead": _r(c.mean(0).min()), "out_rel_err": _r(rel[h].mean())}
                if ret is not None:
                    fields.update(carrier=_r(ret[h].mean()), carrier_hot_hits=_r(ret[h][hot[h]].sum()),
                                  carrier_hot_n=int(hot[h].sum()), carrier_of_oracle_hits=int(of_oracle[0][h]),
                                  carrier_of_oracle_n=int(of_oracle[1][h]))
                self._row("selection", h, selector=v.name, budget=budget, **fields)

    def _rerank_scores(self, v: Variant) -> torch.Tensor:
        """What a re-rank reads for its candidates: the exact page log-sum-exp, or for a cascade
        the run's LOCKS (Eq. 4) estimates."""
        return self.estimate("locks").scores if v.cascade else self.exact.lse

    def _group_scores(self, v: Variant) -> torch.Tensor | None:
        """Scores ``[H, Q, G, NG]`` of the layer's groups of ``v.group_pages`` pages: Eq. 4 on group
        summaries of rank ``v.group_rank`` (None: the run's rank), the upper bound or the member
        centroids' score; None when ``v.group_pages`` is 0."""
        if not v.group_pages:
            return None
        key = (v.group_pages, v.group_rank or self.res.rank, v.group_bound, v.group_centroids)
        if key not in self._groups:
            cfg = LocksConfig(page_size=self.data.page_size, rank=self.res.rank, budget=2 * self.data.page_size)
            groups = Groups(pages=v.group_pages, rank=key[1])
            if v.group_centroids:
                scores = centroid_group_scores(self.data.flat_queries, self.data.keys, cfg, group_pages=v.group_pages,
                                               scale=self.data.scale)
            elif v.group_bound:
                scores = bound_scores(self.data.flat_queries, bound_groups(self.data.keys, groups.config(cfg)),
                                      scale=self.data.scale)
            else:
                scores = score_pages_from_summaries(self.data.flat_queries, group_summaries(self.data.keys, cfg, groups),
                                                    scale=self.data.scale)
            self._groups[key] = self.data.unflatten(scores)
        return self._groups[key]

    def _oracle_mask(self, budget: int) -> torch.Tensor:
        """The exact (``oracle``, ``mean_share``) selection at ``budget``: bool ``[H, Q, G, P]``."""
        if budget not in self._oracle:
            self._oracle[budget] = metrics.selection_mask(self.exact.lse, budget // self.data.page_size)
        return self._oracle[budget]

    def _sample(self, name: str, est: Estimate) -> None:
        """(exact share, estimated share) of random pages and the top pages of one random step."""
        if self.scatter_pages == 0:
            return
        ex = self.exact
        q, g, p = ex.share.shape[1:]
        pts = self.scatter.setdefault(name, [])
        for h in range(len(self.heads)):
            t, j = int(self.rng.integers(q)), int(self.rng.integers(g))
            exact_s, est_s = ex.share[h, t, j], torch.softmax(est.scores[h, t, j], dim=-1)
            top = torch.topk(exact_s, min(8, p)).indices.tolist()
            pick = sorted(set(top) | set(self.rng.choice(p, size=min(self.scatter_pages, p), replace=False).tolist()))
            pts.extend([_r(float(exact_s[i]), 4), _r(float(est_s[i]), 4)] for i in pick)

    def _theory(self) -> None:
        ex, data = self.exact, self.data
        unq, int4 = self.estimate("locks_fp32"), self.estimate("locks")
        _, basis, _, tau, _ = self.spectral
        eta = bounds.eta(unq.scores, ex.lse)  # [H, Q]
        eq7 = bounds.eq7_bound(data.queries, basis, tau, data.scale)
        eta4 = bounds.eta(int4.scores, ex.lse)
        for h in range(len(self.heads)):
            self._row("eta", h, eta=_r(eta[h]), eq7=_r(eq7[h]), eta_int4=_r(eta4[h]))
        radius = bounds.value_radius(data.values)  # [H]
        for budget in self.budgets:
            k = budget // data.page_size
            star = metrics.coverage(ex.share, self._oracle_mask(budget)).mean(-1)  # [H, Q]
            mask = metrics.selection_mask(unq.scores, k)
            got = metrics.coverage(ex.share, mask).mean(-1)
            err, _ = metrics.output_errors(ex.share, ex.page_out, ex.out, mask)
            eq9, eq9p = bounds.eq9_bounds(radius, eta, star)
            for h in range(len(self.heads)):
                self._row("retention", h, budget=budget, ratio=_r(got[h] / star[h]), eq8=_r(torch.exp(-4 * eta[h])),
                          out_err=_r(err[h].mean(-1)), eq9=_r(eq9[h]), eq9_printed=_r(eq9p[h]))

    def _energy(self) -> None:
        bases, d = self.res.global_bases, self.data.keys.shape[-1]
        rot = None if bases is None else bases.basis(self.data.layer, d)  # [H, D, D]
        curves = ladder.energy_by_scope(self.data.pages, rot)
        for scope, c in curves.items():
            for h in range(len(self.heads)):
                self._row("energy", h, scope=scope, energy=_r(c[h], 5))

    def _tails(self, tails: TailStats) -> None:
        ex, rank = self.exact, self.res.rank
        unq = self.estimate("locks_fp32").scores
        quantized = {8: self.estimate("locks_int8").scores, 4: self.estimate("locks").scores,
                     2: self.estimate("locks_int2").scores}
        extra = {}  # adaptive-precision variants, one entry per (percentile, rule)
        for v in self.variants:
            if v.adapt is not None:
                est = self.estimate(v.name)
                extra[f"adapt{v.adapt}" + ("" if v.adapt_rule == "prefill" else f"_{v.adapt_rule}")] = (
                    est.scores, est.promoted)
        if rank < self.data.page_size:  # sigma_{R+1} exists
            row = tails.add(ex.lse, unq, quantized, page_properties(self.data.pages, self.spectral[4], rank),
                            extra=extra)
        else:
            row = tails.add(ex.lse, unq, quantized, {}, tail_bits=-1, extra=extra)
        self._row("quant", None, **{k: {q: _r(x) for q, x in v.items()} for k, v in row.items()})

