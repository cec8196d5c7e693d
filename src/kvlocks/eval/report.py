"""Aggregate task-suite rows into summary.json, a markdown table and PNG plots."""

from __future__ import annotations

import json
import platform
import subprocess
from collections import defaultdict
from pathlib import Path

from kvlocks.eval.metrics import paired_bootstrap_ci

MIN_FULL_SCORE = 0.30  # a task counts towards accuracy averages only where full scores this much


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions() -> dict:
    import torch
    import transformers

    import kvlocks
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "kvlocks": kvlocks.__version__}


def _ci(rows_a: dict, rows_b: dict, field: str) -> dict | None:
    idx = sorted(set(rows_a) & set(rows_b))
    if not idx:
        return None
    ci = paired_bootstrap_ci([rows_a[i][field] for i in idx], [rows_b[i][field] for i in idx], n_boot=2000, seed=0)
    return {"mean": ci.mean, "low": ci.low, "high": ci.high, "n": ci.n}


def summarize(rows: list[dict]) -> list[dict]:
    """One cell per task x length x method x budget with means, n and paired CIs."""
    by_cell: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in rows:
        by_cell[(r["task"], r["length"], r["method"], r["budget"])][r["index"]] = r
    cells = []
    for (task, length, method, budget), recs in sorted(by_cell.items(), key=lambda kv: tuple(map(str, kv[0]))):
        vals = list(recs.values())
        n = len(vals)
        cell = {"task": task, "length": length, "method": method, "budget": budget, "n": n}
        for f in ("score", "strict", "exact_agree", "agree16", "kl", "top1", "stats_read_fraction"):
            xs = [v[f] for v in vals if v.get(f) is not None]
            cell[f] = sum(xs) / len(xs) if xs else None
        full = by_cell.get((task, length, "full", None), {})
        oracle = by_cell.get((task, length, "oracle", budget), {})
        cell["diff_vs_full"] = _ci(recs, full, "score") if method != "full" else None
        cell["diff_vs_oracle"] = _ci(recs, oracle, "score") if method not in ("full", "oracle") else None
        cells.append(cell)
    return cells


def headline(cells: list[dict]) -> list[dict]:
    """Per length x method x budget: accuracy averaged over tasks where full >= 30 %, and
    agreement / KL averaged over all tasks."""
    full = {(c["task"], c["length"]): c["score"] for c in cells if c["method"] == "full"}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in cells:
        groups[(c["length"], c["method"], c["budget"])].append(c)
    out = []
    for (length, method, budget), cs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        acc = [c["score"] for c in cs if (full.get((c["task"], length)) or 0) >= MIN_FULL_SCORE]
        mean = lambda f: (sum(c[f] for c in cs if c[f] is not None) / max(1, sum(c[f] is not None for c in cs)))
        out.append({"length": length, "method": method, "budget": budget,
                    "accuracy": sum(acc) / len(acc) if acc else None, "tasks_in_accuracy": len(acc),
                    "exact_agree": mean("exact_agree"), "agree16": mean("agree16"), "kl": mean("kl"),
                    "top1": mean("top1"), "read_fraction": mean("stats_read_fraction")})
    return out


def markdown(head: list[dict], cells: list[dict]) -> str:
    def f(x, pct=False):
        return "—" if x is None else (f"{100 * x:.1f}" if pct else f"{x:.3g}")
    lines = ["| length | method | budget | accuracy % (tasks) | exact agree % | first-16 agree % | KL | top-1 % | read % of full |",
             "|---|---|---|---|---|---|---|---|---|"]
    for h in head:
        lines.append(f"| {h['length']} | {h['method']} | {h['budget'] or '—'} | {f(h['accuracy'], True)} ({h['tasks_in_accuracy']}) | "
                     f"{f(h['exact_agree'], True)} | {f(h['agree16'], True)} | {f(h['kl'])} | {f(h['top1'], True)} | {f(h['read_fraction'], True)} |")
    lines += ["", "Per task (score %, paired 95% CI of the difference to full):", "",
              "| task | length | method | budget | n | score % | Δ vs full [95% CI] | Δ vs oracle [95% CI] | KL |", "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        d = lambda ci: "—" if not ci else f"{100 * ci['mean']:+.1f} [{100 * ci['low']:+.1f}, {100 * ci['high']:+.1f}]"
        lines.append(f"| {c['task']} | {c['length']} | {c['method']} | {c['budget'] or '—'} | {c['n']} | {f(c['score'], True)} | "
                     f"{d(c['diff_vs_full'])} | {d(c['diff_vs_oracle'])} | {f(c['kl'])} |")
    return "\n".join(lines) + "\n"


def write_report(rows: list[dict], out: Path, *, config: dict, device: str) -> dict:
    cells = summarize(rows)
    head = headline(cells)
    summary = {"config": config, "commit": _commit(), "device": device, "versions": _versions(),
               "n_rows": len(rows), "headline": head, "cells": cells}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(markdown(head, cells))
    from kvlocks.eval.plots import plot_all

    plot_all(rows, cells, out)
    return summary
