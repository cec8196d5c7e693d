"""Fidelity metrics: selection, coverage, carrier retention, score errors, rank correlation.

Pure functions on tensors; shapes use H (KV heads), Q (query steps), G (query heads per KV
head), P (pages), S (page size), D (head dim). Every function works on any leading dims
``...`` unless it says otherwise.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvlocks.config import LocksConfig
from kvlocks.scoring.reference import combine_group
from kvlocks.selection.rerank import forced_pages, merge_exact, pick_candidates
from kvlocks.selection.topk import select_top_pages
from kvlocks_lab.selectors.hier import Groups, hierarchical_ranking


def selection_mask(scores: torch.Tensor, pages_per_step: int, *, combine: str = "mean_share",
                   per_head: bool = False, sink_pages: int = 1, recent_pages: int = 1,
                   exact: torch.Tensor | None = None, rerank: int = 0, rerank_min: int = 0, group_scores: torch.Tensor | None = None,
                   group_pages: int = 0, group_keep: int = 1) -> torch.Tensor:
    """Which pages each query head attends: bool ``[..., G, P]``.

    scores ``[..., G, P]`` per-head log-masses; shared selection (``per_head=False``): the
    ``combine`` rule gives one ranking per group and all G heads get the same pages (the rule
    of :func:`kvlocks.selection.choose_pages`); ``per_head``: each head its own top-k. Always
    sink + recent + the best of the rest, ``min(k, P)`` pages. ``rerank`` (shared selection):
    the two-stage selection of :mod:`kvlocks.selection.rerank` with ``exact [..., G, P]`` the
    exact page log-sum-exp its candidates read, at least ``rerank_min`` of them. ``group_pages`` (shared selection): hierarchical
    scoring (:mod:`kvlocks_lab.selectors.hier`) with ``group_scores [..., G, NG]`` the groups' Eq. 4
    scores.
    """
    p = scores.shape[-1]
    ranking = scores if per_head else combine_group(scores, combine)  # [..., G, P] or [..., P]
    if group_pages and not per_head:
        hcfg = LocksConfig(budget=16 * pages_per_step, sink_pages=sink_pages, recent_pages=recent_pages,
                           combine=combine, rerank=0)
        ranking, scores = hierarchical_ranking(scores, group_scores, hcfg, Groups(pages=group_pages, keep=group_keep))
    if rerank and not per_head:
        cfg = LocksConfig(budget=16 * pages_per_step, sink_pages=sink_pages, recent_pages=recent_pages,
                          rerank=rerank)
        forced = forced_pages(p, cfg).to(scores.device).expand(*ranking.shape[:-1], sink_pages + recent_pages)
        n_cand = cfg.rerank_candidates(p)
        pick, cand = pick_candidates(ranking, forced, min(p, max(n_cand, rerank_min)) if rerank_min else n_cand)
        idx = torch.cat([cand, forced], dim=-1)
        got = exact.gather(-1, idx.unsqueeze(-2).expand(*idx.shape[:-1], scores.shape[-2], idx.shape[-1]))
        ranking = merge_exact(scores, pick, cand, forced, forced < p, got, combine)
    chosen = select_top_pages(ranking, p, pages_per_step, sink_pages=sink_pages, recent_pages=recent_pages)
    mask = torch.zeros(ranking.shape, dtype=torch.bool, device=scores.device)
    mask.scatter_(-1, chosen, True)
    return mask if per_head else mask.unsqueeze(-2).expand(scores.shape)


def coverage(share: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Exact softmax mass in the selected pages: share ``[..., P]`` (sums to 1), mask bool -> ``[...]``."""
    return (share * mask).sum(-1)


def carrier_retention(mask: torch.Tensor, carriers: torch.Tensor) -> torch.Tensor:
    """Fraction of carrier pages selected: mask bool ``[..., P]``, carriers bool ``[P]`` -> ``[...]``."""
    n = int(carriers.sum())
    if n == 0:
        raise ValueError("carrier_retention needs at least one carrier page")
    return (mask & carriers).sum(-1).float() / n


def output_errors(share: torch.Tensor, page_out: torch.Tensor, out: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(||o_S - o||, ||o_S - o|| / ||o||)`` for attention restricted to the selected pages.

    share ``[..., P]``, page_out ``[..., P, D]`` (each page's own attention output), out
    ``[..., D]`` (dense output), mask bool ``[..., P]`` -> two ``[...]``. ``o_S`` renormalises the
    selected pages' mass: ``sum_S m_j o_j / sum_S m_j`` (exactly sparse attention's output).
    """
    w = share * mask
    o_sel = (w.unsqueeze(-1) * page_out).sum(-2) / w.sum(-1, keepdim=True).clamp_min(1e-30)
    err = (o_sel - out).norm(dim=-1)
    return err, err / out.norm(dim=-1).clamp_min(1e-30)


def mean_abs_error(estimate: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean absolute difference (logit MAE, LSE MAE)."""
    return float((estimate.float() - exact.float()).abs().mean())


def _rank_rows(x: np.ndarray) -> np.ndarray:
    from scipy.stats import rankdata

    return rankdata(x, axis=-1)  # average ranks for ties, like scipy.stats.spearmanr


def spearman_rows(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Spearman rho between matching rows: ``[R, P]`` x ``[R, P]`` -> ``[R]`` (nan: a constant row).

    Equal to ``scipy.stats.spearmanr(a[i], b[i])`` row by row (Pearson of average ranks),
    vectorised.
    """
    ra = _rank_rows(a.reshape(-1, a.shape[-1]).double().numpy())
    rb = _rank_rows(b.reshape(-1, b.shape[-1]).double().numpy())
    ra -= ra.mean(-1, keepdims=True)
    rb -= rb.mean(-1, keepdims=True)
    den = np.sqrt((ra * ra).sum(-1) * (rb * rb).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (ra * rb).sum(-1) / np.where(den > 0, den, 1.0), np.nan)


def kendall_rows(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Kendall tau-b between matching rows (``scipy.stats.kendalltau``): ``[R, P]`` -> ``[R]``."""
    from scipy.stats import kendalltau

    x = a.reshape(-1, a.shape[-1]).double().numpy()
    y = b.reshape(-1, b.shape[-1]).double().numpy()
    out = np.full(x.shape[0], np.nan)
    for i in range(x.shape[0]):
        if np.ptp(x[i]) > 0 and np.ptp(y[i]) > 0:
            out[i] = kendalltau(x[i], y[i]).statistic
    return out


def distribution(values) -> dict:
    """``{"mean", "p5", "min", "n"}`` of finite values (None entries when there are none)."""
    v = np.asarray([x for x in np.ravel(np.asarray(values, dtype=float)) if math.isfinite(x)])
    if v.size == 0:
        return {"mean": None, "p5": None, "min": None, "n": 0}
    return {"mean": float(v.mean()), "p5": float(np.percentile(v, 5)), "min": float(v.min()), "n": int(v.size)}
