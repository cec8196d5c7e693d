"""Aggregate the study's rows into ``summary.json``: rows, aggregate block, targets.

``rows`` (the issue's schema: ``method``, ``ratio``, ``layer``, ``head``, ``err_near``,
``err_far``, ``kl``, ``accuracy``, ``compact_s``, plus ``kind``, ``task`` and ``n``):

* ``kind="head"``: one per (method, ratio, layer, head); errors are medians over records,
  ``compact_s`` the median time of that head, ``kl``/``accuracy``/``task`` null;
* ``kind="task"``: one per (method, ratio, task), ``full`` included (ratio null); errors are
  medians over records, layers and heads, ``kl``/``accuracy`` means over records, ``compact_s``
  the mean time to compact the whole prefix (capture included), ``layer``/``head`` null.

``aggregate`` holds the comparisons of the issue (see :func:`summarize`).
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvlocks_lab.eval.metrics import paired_bootstrap_ci

from .config import StudyConfig
from .measure import DELTA_EDGES, QU_EDGES
from .metrics import excess_share, median_ratio, quantiles

EARLY_LAYERS = 7  # "early" = layers 0..6, as in the paper's layer study
BASELINES = ("drop", "drop_refit", "am", "rank1", "merge_fold")


def commit() -> str:
    """``$KVLOCKS_COMMIT`` when set (the GPU machine receives a working tree whose git state, if any,
    is not its commit), else ``git rev-parse HEAD`` of the source tree, else ``"unknown"``."""
    from kvlocks import env

    if env.get("KVLOCKS_COMMIT"):
        return env.get("KVLOCKS_COMMIT")
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def versions() -> dict:
    """Python, torch, transformers, scipy and kvlocks versions and torch's thread count."""
    import scipy
    import torch
    import transformers

    import kvlocks
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "scipy": scipy.__version__,
            "kvlocks": kvlocks.__version__, "threads": torch.get_num_threads()}


def _r(x):
    return None if x is None else float(f"{x:.5g}")


def _median(xs):
    xs = [x for x in xs if x is not None]
    return _r(float(np.median(xs))) if xs else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return _r(float(np.mean(xs))) if xs else None


def _rec(row) -> tuple:
    return (row["task"], row["length"], row["index"])


def _rows(heads: list[dict], records: list[dict]) -> list[dict]:
    by_head, by_task_err = defaultdict(list), defaultdict(list)
    for h in heads:
        by_head[(h["method"], h["ratio"], h["layer"], h["head"])].append(h)
        by_task_err[(h["method"], h["ratio"], h["task"])].append(h)
    rows = []
    for (m, r, layer, head), hs in sorted(by_head.items()):
        rows.append({"kind": "head", "method": m, "ratio": r, "layer": layer, "head": head,
                     "task": None, "err_near": _median(h["err_near"] for h in hs),
                     "err_far": _median(h["err_far"] for h in hs), "kl": None, "accuracy": None,
                     "compact_s": _median(h["compact_s"] for h in hs), "n": len(hs)})
    by_task = defaultdict(list)
    for rec in records:
        by_task[(rec["method"], rec["ratio"], rec["task"])].append(rec)
    for (m, r, task), rs in sorted(by_task.items(), key=lambda kv: tuple(map(str, kv[0]))):
        hs = by_task_err.get((m, r, task), [])
        rows.append({"kind": "task", "method": m, "ratio": r, "layer": None, "head": None,
                     "task": task, "err_near": _median(h["err_near"] for h in hs),
                     "err_far": _median(h["err_far"] for h in hs),
                     "kl": _mean(x["kl"] for x in rs), "accuracy": _mean(x["accuracy"] for x in rs),
                     "compact_s": _mean(x["compact_s"] for x in rs), "n": len(rs)})
    return rows


def _pairs(heads, method, ratio, field):
    """Aligned (method, am) values of ``field`` over (record, layer, head)."""
    am = {(_rec(h), h["layer"], h["head"]): h for h in heads if h["method"] == "am" and h["ratio"] == ratio}
    a, b, keys = [], [], []
    for h in heads:
        if h["method"] == method and h["ratio"] == ratio:
            ref = am.get((_rec(h), h["layer"], h["head"]))
            if ref is not None and h[field] is not None and ref[field] is not None:
                a.append(h[field])
                b.append(ref[field])
                keys.append(h)
    return np.asarray(a, dtype=float), np.asarray(b, dtype=float), keys


def _ratio_block(heads, cfg, edges):
    out = {}
    labels = [f"{lo}-{hi - 1}" for lo, hi in zip(edges[:-1], edges[1:])] + [f">={edges[-1]}"]
    for ratio in cfg.ratios:
        cell = {}
        for m in cfg.methods:
            if m == "am":
                continue
            near = median_ratio(*_pairs(heads, m, ratio, "err_near")[:2])
            far = median_ratio(*_pairs(heads, m, ratio, "err_far")[:2])
            cell[m] = {"near": _r(near), "far": _r(far)}
        a, b, keys = _pairs(heads, "fold", ratio, "err_far")
        am = {(_rec(h), h["layer"], h["head"]): h for h in heads
              if h["method"] == "am" and h["ratio"] == ratio}
        bins = {}
        for i, label in enumerate(labels):
            num, den = [], []
            for h in keys:
                ref = am[(_rec(h), h["layer"], h["head"])]
                if h["err_far_bins"][i] is not None and ref["err_far_bins"][i] is not None:
                    num.append(h["err_far_bins"][i])
                    den.append(ref["err_far_bins"][i])
            bins[label] = _r(median_ratio(num, den)) if num else None
        cell["fold_far_by_delta"] = bins
        cell["n"] = int(a.size)
        out[str(ratio)] = cell
    return out


def _excess_block(heads, cfg):
    out = {}
    for ratio in cfg.ratios:
        a, b, keys = _pairs(heads, "fold", ratio, "err_far")
        if not keys:
            continue
        excess = (a - b) * np.asarray([h["norm_far"] for h in keys], dtype=float)  # absolute
        order = np.argsort(-excess)
        top = order[: int(np.ceil(0.1 * excess.size))]
        pos = np.clip(excess, 0, None)
        early = np.asarray([h["layer"] < EARLY_LAYERS for h in keys])
        worst = defaultdict(list)
        for h, e in zip(keys, excess):
            worst[(h["layer"], h["head"])].append(e)
        ranked = sorted(worst.items(), key=lambda kv: -float(np.median(kv[1])))[:8]
        # the same in relative terms: fold/AM ratio - 1, which ignores each head's output norm
        rel = a / np.where(b > 0, b, np.nan) - 1.0
        rel = np.where(np.isfinite(rel), rel, 0.0)
        top_rel = np.argsort(-rel)[: int(np.ceil(0.1 * rel.size))]
        by_head = defaultdict(list)
        for h, x in zip(keys, rel):
            by_head[(h["layer"], h["head"])].append(x)
        ranked_rel = sorted(by_head.items(), key=lambda kv: -float(np.median(kv[1])))[:8]
        out[str(ratio)] = {
            "share_worst_10pct": _r(excess_share(excess, 0.1)),
            "worst_10pct_in_early_layers": _r(float(early[top].mean())),
            "early_layers_base_rate": _r(float(early.mean())),
            "early_layers_share_of_excess": _r(float(pos[early].sum() / pos.sum())) if pos.sum() > 0 else None,
            "worst_heads": [{"layer": l, "head": h, "median_excess": _r(float(np.median(v)))}
                            for (l, h), v in ranked],
            "share_worst_10pct_relative": _r(excess_share(rel, 0.1)),
            "worst_10pct_relative_in_early_layers": _r(float(early[top_rel].mean())),
            "worst_heads_relative": [{"layer": l, "head": h, "median_ratio": _r(1.0 + float(np.median(v)))}
                                     for (l, h), v in ranked_rel],
        }
    return out


def _bound_block(heads, cfg):
    out = {}
    for ratio in cfg.ratios:
        fold = [h for h in heads if h["method"] == "fold" and h["ratio"] == ratio]
        out[str(ratio)] = {f"{w}_{k}": _mean(h[f"bound_{w}_{k}"] for h in fold)
                           for w in ("near", "far") for k in ("exact", "deployed")}
    return out


def _kl_block(records, cfg):
    by = defaultdict(dict)
    for r in records:
        if r["method"] != "full":
            by[(r["task"], r["ratio"])].setdefault(r["method"], {})[_rec(r)] = r["kl"]
    settings = []
    for (task, ratio), ms in sorted(by.items()):
        settings.append({"task": task, "ratio": ratio,
                         **{m: _r(float(np.mean(list(v.values())))) for m, v in ms.items()}})
    wins = {}
    for base in BASELINES:
        if base not in cfg.methods:
            continue
        s = [x for x in settings if base in x and "fold" in x]
        per = [(v, by[k][base][rec]) for k, ms in by.items() if base in ms
               for rec, v in ms["fold"].items() if rec in ms[base]]
        wins[base] = {"settings": f"{sum(x['fold'] < x[base] for x in s)}/{len(s)}",
                      "settings_frac": _r(sum(x["fold"] < x[base] for x in s) / len(s)) if s else None,
                      "records": f"{sum(a < b for a, b in per)}/{len(per)}",
                      "records_frac": _r(sum(a < b for a, b in per) / len(per)) if per else None}
    return {"settings": settings, "fold_below": wins}


def _accuracy_block(records, cfg):
    by = defaultdict(dict)
    for r in records:
        by[(r["task"], r["ratio"], r["method"])][_rec(r)] = r["accuracy"]
    cells = [{"task": t, "ratio": r, "method": m, "accuracy": _mean(v.values()), "n": len(v)}
             for (t, r, m), v in sorted(by.items(), key=lambda kv: tuple(map(str, kv[0])))]
    diffs = []
    for ratio in cfg.ratios:
        for task in list(cfg.tasks) + [None]:
            fold, am = {}, {}
            for (t, r, m), v in by.items():
                if r == ratio and (task is None or t == task) and m in ("fold", "am"):
                    (fold if m == "fold" else am).update(v)
            common = sorted(set(fold) & set(am))
            if common:
                ci = paired_bootstrap_ci([fold[k] for k in common], [am[k] for k in common],
                                         n_boot=2000, seed=0)
                diffs.append({"task": task or "all", "ratio": ratio, "fold_minus_am": _r(ci.mean),
                              "low": _r(ci.low), "high": _r(ci.high), "n": ci.n,
                              "within_noise": ci.contains(0.0)})
    return {"cells": cells, "fold_minus_am": diffs}


def qu_layers_from_heads(heads: list[dict]) -> list[dict]:
    """Per (record, layer, head): the fold rows' q.u diagnostics (u does not depend on the ratio)."""
    first = min((h["ratio"] for h in heads if h["method"] == "fold"), default=None)
    keep = ("task", "length", "index", "layer", "head", "qu_near_mean", "qu_far_mean",
            "qu_near_dev", "qu_far_dev")
    return [{k: h.get(k) for k in keep} for h in heads
            if h["method"] == "fold" and h["ratio"] == first]


def summarize(cfg: StudyConfig, heads: list[dict], records: list[dict], qu_layers: list[dict],
              hist: dict, qu: dict, *, wall_s: float, device: str, extra: dict | None = None,
              delta_edges: tuple[int, ...] = DELTA_EDGES, run_commit: str | None = None,
              run_versions: dict | None = None) -> dict:
    """The ``summary.json`` object (module docstring).

    ``qu_layers``: :func:`qu_layers_from_heads`; ``hist``: q.u - 1 histograms (``near``/``far``);
    ``qu``: pooled q.u - 1 samples (arrays) for the quantiles; ``extra``: more aggregate blocks;
    ``delta_edges``: the distance bins the rows' ``err_far_bins`` were measured with;
    ``run_commit``, ``run_versions``: those of the run (default: the current ones).
    """
    ratios = _ratio_block(heads, cfg, tuple(delta_edges))
    kl = _kl_block(records, cfg)
    per_layer = defaultdict(lambda: defaultdict(list))
    for row in qu_layers:
        for where in ("near", "far"):
            per_layer[row["layer"]][where].append(row[f"qu_{where}_mean"])
            per_layer[row["layer"]][f"{where}_dev"].append(row.get(f"qu_{where}_dev"))
    times = defaultdict(list)
    for r in records:
        if r["method"] != "full":
            times[(r["method"], r["ratio"])].append(r["compact_s"])
    drop = kl["fold_below"].get("drop", {})
    trips = [r["file_roundtrip_equal"] for r in records if "file_roundtrip_equal" in r]
    targets = {
        "median_fold_am_near_le_1.02": {str(r): (c["fold"]["near"] is not None and c["fold"]["near"] <= 1.02)
                                        for r, c in ratios.items()},
        "median_fold_am_far_le_1.05": {str(r): (c["fold"]["far"] is not None and c["fold"]["far"] <= 1.05)
                                       for r, c in ratios.items()},
        "kl_fold_lt_drop_ge_90pct_settings": (drop.get("settings_frac") or 0) >= 0.9,
        "file_roundtrip_gives_in_memory_tokens": bool(trips) and all(trips),
    }
    aggregate = {
        "ratio_vs_am": ratios,
        "qu_minus_1": {"near": quantiles(qu.get("near")) if qu.get("near") is not None else None,
                       "far": quantiles(qu.get("far")) if qu.get("far") is not None else None,
                       "per_layer_mean_qu": [{"layer": l, "near": _mean(v["near"]), "far": _mean(v["far"]),
                                              "near_dev": _median(v["near_dev"]),
                                              "far_dev": _median(v["far_dev"])}
                                             for l, v in sorted(per_layer.items())],
                       "hist": {"edges": list(QU_EDGES), "near": hist.get("near"), "far": hist.get("far"),
                                "layout": "[under, bins..., over]"}},
        "bound": _bound_block(heads, cfg),
        "kl": kl,
        "accuracy": _accuracy_block(records, cfg),
        "excess_far": _excess_block(heads, cfg),
        "compact_s": {f"{m}@{r}": _mean(v) for (m, r), v in sorted(times.items())},
        "delta_edges": list(delta_edges),
        "file_roundtrip": f"{sum(trips)}/{len(trips)} fold caches loaded from their file decode "
                          "exactly the in-memory cache's greedy tokens",
    }
    if extra:
        aggregate.update(extra)
    return {"config": cfg.to_json(), "compaction_defaults": cfg.compaction("fold", cfg.ratios[0]).to_json(),
            "commit": run_commit or commit(), "versions": run_versions or versions(), "device": device,
            "wall_s": round(wall_s, 1), "n_records": len({_rec(r) for r in records}),
            "targets": targets, "aggregate": aggregate, "rows": _rows(heads, records)}
