"""``report.md`` of the compaction study, written from ``summary.json`` alone."""

from __future__ import annotations

import json
from pathlib import Path


def _f(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e-3 and x != 0 else f"{x:.{digits}f}"
    return str(x)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_f(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _ratios(agg: dict) -> list[str]:
    lines = ["## Output error relative to AM (median over records x layers x KV heads)", "",
             "err = mean ||o_method - o_full|| / mean ||o_full|| of the prefix's attention output; "
             "near = held-out prefill queries, far = continuation queries (suffix, answer, far text).", ""]
    rows = []
    for ratio, cell in agg["ratio_vs_am"].items():
        for m, v in cell.items():
            if isinstance(v, dict) and "near" in v:
                rows.append([ratio, m, v["near"], v["far"]])
    lines += _table(["ratio", "method", "median err/err(am) near", "far"], rows)
    lines += ["Fold/AM far-error ratio by distance from the context (tokens):", ""]
    first = next(iter(agg["ratio_vs_am"].values()))
    labels = list(first["fold_far_by_delta"])
    lines += _table(["ratio"] + labels, [[r] + [c["fold_far_by_delta"][k] for k in labels]
                                         for r, c in agg["ratio_vs_am"].items()])
    return lines


def _qu(agg: dict) -> list[str]:
    qu = agg["qu_minus_1"]
    lines = ["## q . u - 1 on held-out queries", ""]
    keys = ["q01", "q05", "q25", "q50", "q75", "q95", "q99", "mean", "mean_abs", "n"]
    rows = [[w] + [qu[w][k] if qu[w] else None for k in keys] for w in ("near", "far")]
    lines += _table(["queries"] + keys, rows)
    per = qu["per_layer_mean_qu"]
    if per:
        worst = sorted(per, key=lambda p: -abs((p["far"] or 1.0) - 1.0))[:5]
        lines += ["Layers whose mean q . u (far) is furthest from 1: " + ", ".join(
            f"layer {p['layer']} ({_f(p['near'])} near, {_f(p['far'])} far)" for p in worst), ""]
        if per[0].get("far_dev") is not None:
            spread = sorted(per, key=lambda p: -(p["far_dev"] or 0.0))[:5]
            lines += ["Layers with the widest spread, median over heads of mean |q . u - 1| (far): "
                      + ", ".join(f"layer {p['layer']} ({_f(p['far_dev'])})" for p in spread)
                      + f"; median layer {_f(sorted(p['far_dev'] for p in per)[len(per) // 2])}.", ""]
    lines += ["Bound (b_max - b_min)/4 * D_V * |q . u - 1| (= (3/2) D_V |q . u - 1|): fraction of "
              "queries where ||o_fold - o_am|| is within it. `exact`: unrounded fold with AM's "
              "values (the setting the bound is proved for); `deployed`: the fold as served "
              "(bf16 keys, values refit without bias).", ""]
    rows = [[r, b["near_exact"], b["near_deployed"], b["far_exact"], b["far_deployed"]]
            for r, b in agg["bound"].items()]
    lines += _table(["ratio", "near exact", "near deployed", "far exact", "far deployed"], rows)
    return lines


def _kl(agg: dict) -> list[str]:
    kl = agg["kl"]
    lines = ["## KL to the full cache over answer tokens (teacher-forced on full's answer)", ""]
    methods = sorted({k for s in kl["settings"] for k in s} - {"task", "ratio"})
    lines += _table(["task", "ratio"] + methods,
                    [[s["task"], s["ratio"]] + [s.get(m) for m in methods] for s in kl["settings"]])
    lines += ["KL(fold) below the baseline: settings (task x ratio) and single records:", ""]
    lines += _table(["baseline", "settings", "records"],
                    [[b, w["settings"], w["records"]] for b, w in kl["fold_below"].items()])
    return lines


def _accuracy(agg: dict) -> list[str]:
    acc = agg["accuracy"]
    lines = ["## Task accuracy (task metric, greedy answer)", ""]
    by = {}
    for c in acc["cells"]:
        by.setdefault((c["task"], c["ratio"]), {})[c["method"]] = (c["accuracy"], c["n"])
    methods = sorted({c["method"] for c in acc["cells"]})
    full = {t: v for (t, r), v in by.items() if r is None}
    rows = []
    for (task, ratio), v in sorted(((k, v) for k, v in by.items() if k[1] is not None),
                                   key=lambda kv: (kv[0][0], -kv[0][1])):
        f = full.get(task, {}).get("full")
        rows.append([task, ratio, f[0] if f else None] +
                    [v[m][0] if m in v else None for m in methods if m != "full"] +
                    [next(iter(v.values()))[1]])
    lines += _table(["task", "ratio", "full"] + [m for m in methods if m != "full"] + ["n"], rows)
    lines += ["Fold - AM accuracy, paired bootstrap 95% interval over records:", ""]
    lines += _table(["task", "ratio", "fold - am", "low", "high", "n", "within noise"],
                    [[d["task"], d["ratio"], d["fold_minus_am"], d["low"], d["high"], d["n"],
                      d["within_noise"]] for d in acc["fold_minus_am"]])
    return lines


def _excess(agg: dict) -> list[str]:
    lines = ["## Where the fold's excess far error sits", "",
             "excess = (err(fold) - err(am)) x mean ||o_full|| per (record, layer, KV head), far queries.", ""]
    rows = []
    for r, e in agg["excess_far"].items():
        heads = ", ".join(f"L{w['layer']}h{w['head']}" for w in e["worst_heads"][:5])
        rows.append([r, e["share_worst_10pct"], e["worst_10pct_in_early_layers"],
                     e["early_layers_base_rate"], e["early_layers_share_of_excess"], heads])
    lines += _table(["ratio", "share of excess in worst 10%", "worst 10% in layers 0-6",
                     "base rate layers 0-6", "layers 0-6 share of excess", "worst heads (median)"], rows)
    lines += ["The same in relative terms (err(fold)/err(am) - 1 per case, ignoring each head's "
              "output norm):", ""]
    rows = []
    for r, e in agg["excess_far"].items():
        if "worst_heads_relative" not in e:
            continue
        heads = ", ".join(f"L{w['layer']}h{w['head']} ({w['median_ratio']:.3f})"
                          for w in e["worst_heads_relative"][:5])
        rows.append([r, e["share_worst_10pct_relative"], e["worst_10pct_relative_in_early_layers"],
                     e["early_layers_base_rate"], heads])
    lines += _table(["ratio", "share of relative excess in worst 10%", "worst 10% in layers 0-6",
                     "base rate layers 0-6", "worst heads (median fold/AM far ratio)"], rows)
    return lines


def write_report(summary: dict, out: Path) -> Path:
    """Write ``out/report.md`` from ``summary`` (the ``summary.json`` object); returns its path."""
    cfg = json.loads(summary["config"])
    agg = summary["aggregate"]
    lines = ["# Compaction study: AM, fold and baselines on task records", "",
             f"Model `{cfg['model']}`, tasks {', '.join(cfg['tasks'])}, lengths {cfg['lengths']}, "
             f"ratios {cfg['ratios']}, {summary['n_records']} records, methods {', '.join(cfg['methods'])}; "
             f"commit `{summary['commit'][:12]}`, {summary['versions']['threads']} threads, "
             f"wall {summary['wall_s'] / 60:.1f} min on {summary['device']}.", "",
             "Config: `" + summary["config"] + "`", "", "## Targets", ""]
    t = summary["targets"]
    rows = [[k, json.dumps(v)] for k, v in t.items()]
    lines += _table(["target", "holds"], rows)
    lines += _ratios(agg) + _qu(agg) + _kl(agg) + _accuracy(agg) + _excess(agg)
    lines += ["## Time to compact (capture + every head; mean per record, seconds)", ""]
    lines += _table(["method@ratio", "compact_s"], [[k, v] for k, v in agg["compact_s"].items()])
    if "bias_solvers" in agg:
        lines += ["## Bias solvers on real heads (first record of each task: 7 layers x KV heads)", "",
                  "rel_obj = (objective(trf) - objective(bvls)) / objective(bvls); max_dbeta = largest "
                  "|beta(trf) - beta(bvls)|.", ""]
        lines += _table(["T", "t", "fits", "trf s", "bvls s", "bvls/trf", "max rel_obj", "max dbeta"],
                        [[r["T"], r["t"], r["fits"], r["trf_s"], r["bvls_s"], r["speedup"],
                          r["max_rel_obj"], r["max_dbeta"]] for r in agg["bias_solvers"]["by_t"]])
    lines += ["Plots: `fold_am_heatmap.png`, `fold_am_by_delta.png`, `qu_hist.png`, "
              "`qu_per_layer.png`, `kl_settings.png`.", ""]
    path = Path(out) / "report.md"
    path.write_text("\n".join(lines))
    return path
