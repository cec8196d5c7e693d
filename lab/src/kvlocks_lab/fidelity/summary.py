"""Aggregate fidelity rows into ``summary.json``.

Distributions are over *units*, one unit being one (prompt, layer, KV head): ``mean`` is the
mean of the units' values, ``p5_head`` their 5th percentile and ``worst_head`` their minimum.
Within a unit, coverage is already a mean over query steps and query heads; the unit also
records its worst query head (``coverage_worst_qhead``) and its 5th-percentile (step, query
head) coverage (``coverage_p5``). Carrier retention is averaged over needle units only;
``carrier_hot`` pools the (step, query head) samples where the carrier pages hold at least
``hot_share`` of the exact mass, and ``carrier_of_oracle`` the carrier pages the exact
(``oracle``) selection keeps: the share of those the selector keeps too.
"""

from __future__ import annotations

import dataclasses
import platform
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvlocks_lab.fidelity.adaptive import mixed_bytes
from kvlocks_lab.fidelity.ladder import bytes_axes, matched_shared_rank
from kvlocks_lab.fidelity.metrics import distribution
from kvlocks_lab.fidelity.variants import bytes_per_page, matched_rank, variant

SCORE_FIELDS = ("lse_mae", "lse_bias", "logit_mae", "spearman", "kendall")
_TOL = 1e-5


def commit() -> str:
    """The checked-out commit, read from ``.git`` files (no git process)."""
    for parent in Path(__file__).resolve().parents:
        git = parent / ".git"
        if git.is_dir():
            try:
                head = (git / "HEAD").read_text().strip()
                if not head.startswith("ref: "):
                    return head
                ref = head[5:]
                if (git / ref).is_file():
                    return (git / ref).read_text().strip()
                for line in (git / "packed-refs").read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
            except OSError:
                pass
            return "unknown"
    return "unknown"


def versions() -> dict:
    import scipy
    import torch
    import transformers

    import kvlocks

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "scipy": scipy.__version__, "kvlocks": kvlocks.__version__}


def _mean(xs) -> float | None:
    v = [x for x in xs if x is not None and np.isfinite(x)]
    return float(np.mean(v)) if v else None


def _adapt_key(v) -> str:
    """The name :class:`~kvlocks_lab.fidelity.tails.TailStats` keeps an adaptive variant under."""
    return f"adapt{v.adapt}" + ("" if v.adapt_rule == "prefill" else f"_{v.adapt_rule}")


def _selectors(rows, config, res, head_dim, tails: dict | None = None) -> dict:
    sel, scores = defaultdict(list), defaultdict(list)
    for r in rows:
        if r["kind"] == "selection":
            sel[(r["selector"], r["budget"])].append(r)
        elif r["kind"] == "scores":
            scores[r["selector"]].append(r)
    out = {}
    for name in config.selectors:
        sc = {f: distribution([r.get(f) for r in scores[name] if r.get(f) is not None]) for f in SCORE_FIELDS}
        v = variant(name)
        share = None  # adaptive variants: bytes at the measured share of int8 pages
        if v.adapt is not None and tails:
            share = tails.get("adaptive", {}).get(_adapt_key(v), {}).get("promoted_share")
        entry = {"bytes_per_page": bytes_per_page(v, res, head_dim, promoted_share=share), "scores": sc,
                 "budgets": {}}
        for b in config.budgets:
            rs = sel[(name, b)]
            cov = distribution([r["coverage"] for r in rs])
            needle = [r for r in rs if "carrier" in r]
            hits, n = sum(r["carrier_hot_hits"] for r in needle), sum(r["carrier_hot_n"] for r in needle)
            o_hits = sum(r["carrier_of_oracle_hits"] for r in needle)
            o_n = sum(r["carrier_of_oracle_n"] for r in needle)
            by_task = defaultdict(list)
            for r in needle:
                by_task[r["task"]].append(r["carrier"])
            entry["budgets"][str(b)] = {
                "coverage": cov["mean"], "coverage_p5_head": cov["p5"], "coverage_worst_head": cov["min"],
                "coverage_worst_qhead": _mean(r["coverage_worst_qhead"] for r in rs),
                "coverage_p5_step": _mean(r["coverage_p5"] for r in rs),
                "out_rel_err": _mean(r["out_rel_err"] for r in rs),
                "carrier": _mean(r["carrier"] for r in needle), "carrier_hot": hits / n if n else None,
                "carrier_hot_samples": n, "carrier_of_oracle": o_hits / o_n if o_n else None,
                "carrier_by_task": {t: _mean(v) for t, v in sorted(by_task.items())},
                **{f: sc[f]["mean"] for f in ("lse_mae", "logit_mae", "spearman", "kendall")},
            }
        out[name] = entry
    return out


def _flat(rows, kind, field, **match) -> np.ndarray:
    vals = [x for r in rows if r["kind"] == kind and all(r.get(k) == v for k, v in match.items())
            for x in r[field]]
    return np.array([np.nan if x is None else x for x in vals], dtype=float)


def _bounds(rows, budgets) -> dict:
    eta, eq7, eta4 = (_flat(rows, "eta", f) for f in ("eta", "eq7", "eta_int4"))
    ok = np.isfinite(eq7) & (eq7 > 0)
    out = {"eta": {"median": float(np.nanmedian(eta)), "p99": float(np.nanpercentile(eta, 99)),
                   "max": float(np.nanmax(eta)),
                   "eq7_median": float(np.nanmedian(eq7)), "eq7_holds": float(np.mean(eta <= eq7 * (1 + 1e-4) + _TOL)),
                   "eta_over_eq7_median": float(np.median(eta[ok] / eq7[ok])) if ok.any() else None,
                   "int4_median": float(np.nanmedian(eta4)), "int4_p99": float(np.nanpercentile(eta4, 99)),
                   "int4_max": float(np.nanmax(eta4)), "steps": int(eta.size)},
           "retention": {}}
    for b in budgets:
        ratio, eq8 = _flat(rows, "retention", "ratio", budget=b), _flat(rows, "retention", "eq8", budget=b)
        err, eq9, eq9p = (_flat(rows, "retention", f, budget=b) for f in ("out_err", "eq9", "eq9_printed"))
        out["retention"][str(b)] = {
            "ratio_median": float(np.nanmedian(ratio)), "ratio_min": float(np.nanmin(ratio)),
            "eq8_median": float(np.nanmedian(eq8)), "eq8_holds": float(np.mean(ratio >= eq8 - _TOL)),
            "eq8_vacuous": float(np.mean(eq8 < 0.05)),
            "out_err_median": float(np.nanmedian(err)), "eq9_median": float(np.nanmedian(eq9)),
            "eq9_holds": float(np.mean(err <= eq9 + _TOL)), "eq9_printed_holds": float(np.mean(err <= eq9p + _TOL)),
        }
    return out


def _energy(rows, config, head_dim) -> dict:
    curves = defaultdict(list)
    for r in rows:
        if r["kind"] == "energy":
            curves[r["scope"]].append(r["energy"])
    mean = {s: np.mean(np.array(c, dtype=float), axis=0).tolist() for s, c in curves.items()}
    axes = bytes_axes(config.page_size, head_dim)
    r, r_shared = config.rank, matched_shared_rank(config.page_size, config.rank, head_dim)
    matched = {"page": {"rank": r, "bytes_per_page": axes["page"][r - 1], "energy": mean["page"][r - 1]}}
    for s in ("sequence", "global"):
        if s in mean:
            matched[s] = {"rank": r_shared, "bytes_per_page": axes[s][r_shared - 1], "energy": mean[s][r_shared - 1],
                          "energy_at_rank_r": mean[s][r - 1]}
    return {"curves": mean, "bytes_per_page": axes, "matched": matched}


def _claims(sel: dict, budgets) -> dict:
    """The numbers the docs compare with the paper's claims (only selectors that were run)."""
    def pick(names, fields):
        return {str(b): {n: {f: sel[n]["budgets"][str(b)][f] for f in fields} for n in names if n in sel}
                for b in budgets}

    cov = ("coverage", "coverage_worst_qhead", "coverage_p5_step", "coverage_worst_head", "carrier", "carrier_hot",
           "carrier_of_oracle")
    return {
        "scope_at_matched_bytes": pick(("locks", "locks_fp32", "shadowkv", "global", "loki"),
                                       cov + ("lse_mae", "logit_mae", "spearman", "kendall")),
        "carriers": pick(("oracle", "oracle_per_head", "locks", "quest", "centroid", "shadowkv", "global", "loki",
                          "streaming", "random"), ("carrier", "carrier_hot", "carrier_of_oracle", "coverage")),
        "combine": pick(("oracle", "oracle_max_share", "oracle_sum_mass", "oracle_per_head", "locks",
                         "locks_max_share", "locks_sum_mass"), cov),
        "precision": pick(("locks_fp32", "locks_fp16", "locks_int8", "locks", "locks_int2", "centroid"),
                          cov + ("lse_mae", "spearman")),
        "adaptive": pick(("locks_fp32", "locks_int8", "locks",
                          *(n for n in sel if variant(n).adapt is not None)), cov + ("lse_mae", "spearman")),
    }


def summarize(rows, *, config, prompts, calib, calib_overlap, layers, heads, tails, timings, env, res,
              head_dim) -> dict:
    """The ``summary.json`` dict (see the module docstring)."""
    quant_tails = tails.summary()
    sel = _selectors(rows, config, res, head_dim, quant_tails)
    for name in sel:
        v = variant(name)
        entry = quant_tails.get("adaptive", {}).get(_adapt_key(v)) if v.adapt is not None else None
        if entry is not None:
            entry["bytes_per_page"] = mixed_bytes(res.locks_config(v.rank or res.rank), head_dim,
                                                  entry["promoted_share"])
    return {
        "config": dataclasses.asdict(config), "commit": commit(), "versions": versions(), "env": env,
        "timings": timings, "layers": layers, "kv_heads": heads, "head_dim": head_dim,
        "prompts": [p.meta() | {"carrier_pages": sorted({t // config.page_size for t in p.carrier_tokens})}
                    for p in prompts],
        "calibration": {"tokens": len(calib.ids) if calib is not None else 0,
                        "shared_sentences_with_prompts": calib_overlap},
        "matched": {"locks_bytes_per_page": sel.get("locks", {}).get("bytes_per_page"),
                    "shared_rank": matched_rank(res, head_dim)},
        "selectors": sel, "bounds": _bounds(rows, config.budgets), "energy": _energy(rows, config, head_dim),
        "quant_tails": quant_tails, "claims": _claims(sel, config.budgets),
    }


def adaptive_report(summary: dict) -> list[dict]:
    """One row per basis precision (int8, int4 and each adaptive variant that was run): bytes per
    page, |log-mass error| quantiles vs fp32 and vs exact, per-page mean-error quantiles, and the
    selection metrics at every budget. Empty when no adaptive variant was run."""
    qt, sel = summary["quant_tails"], summary["selectors"]
    names = [n for n in sel if variant(n).adapt is not None]
    if not names:
        return []
    rows = []
    for name, key in (("locks_int8", "int8"), ("locks", "int4"), *((n, _adapt_key(variant(n))) for n in names)):
        ad = qt.get("adaptive", {}).get(key, {})
        row = {"selector": name, "tails_key": key, "bytes_per_page": sel.get(name, {}).get("bytes_per_page"),
               "promoted_share": ad.get("promoted_share", 1.0 if key == "int8" else 0.0),
               "worst1pct_int4_pages_promoted": ad.get("worst1pct_int4_pages_promoted")}
        for ref in ("fp32", "exact"):
            for stat, x in qt["quantiles"].get(f"{key}_vs_{ref}", {}).items():
                row[f"vs_{ref}_{stat}"] = x
        for stat, x in qt.get("page_quantiles", {}).get(key, {}).items():
            row[f"page_mean_vs_fp32_{stat}"] = x
        for b, cell in sel.get(name, {}).get("budgets", {}).items():
            for f in ("coverage", "coverage_worst_qhead", "carrier_hot", "carrier_of_oracle"):
                row[f"{f}@{b}"] = cell[f]
        if name in sel:
            row["lse_mae"] = sel[name]["scores"]["lse_mae"]["mean"]
            row["spearman"] = sel[name]["scores"]["spearman"]["mean"]
        rows.append(row)
    return rows
