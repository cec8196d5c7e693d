"""Summary and plot of the retention run (:mod:`.retention`), made from its ``records.jsonl``.

``summary.json``: per task, full's accuracy; per (task, query set, selection, method, ratio) the
number of
records, mean accuracy, mean KL, mean top-1 agreement and mean ``carriers_kept``, and the
accuracy difference to full with a paired bootstrap 95 % interval over records. Rows without a
``selection`` (runs made before the coverage guard and the value anchor existed) are ``plain``.
``retention.png``: accuracy (top) and KL (bottom) against the ratio, one column per task.
"""

from __future__ import annotations

import json
import random
import statistics
from collections import defaultdict
from pathlib import Path


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.fmean(xs), 4) if xs else None


def _paired_ci(diffs: list[float], reps: int = 2000, seed: int = 0) -> list[float]:
    """95 % bootstrap interval of the mean of paired differences."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(reps))
    return [round(means[int(0.025 * reps)], 4), round(means[int(0.975 * reps) - 1], 4)]


def aggregate(rows: list[dict]) -> dict:
    """The summary's ``full`` and ``cells`` (module docstring) from the record rows."""
    full = {(r["task"], r["index"]): r["accuracy"] for r in rows if r["method"] == "full"}
    by_task = defaultdict(list)
    for (task, _), acc in full.items():
        by_task[task].append(acc)
    cells = defaultdict(list)
    for r in rows:
        if r["method"] != "full":
            cells[(r["task"], r["queries"], r.get("selection", "plain"), r["method"], r["ratio"])].append(r)
    out = []
    for (task, qs, sel, m, ratio), rs in sorted(cells.items(), key=lambda x: (*x[0][:4], -x[0][4])):
        diffs = [r["accuracy"] - full[(task, r["index"])] for r in rs]
        out.append({"task": task, "queries": qs, "selection": sel, "method": m, "ratio": ratio, "t": rs[0]["t"],
                    "n": len(rs), "accuracy": _mean(r["accuracy"] for r in rs),
                    "full_accuracy": _mean(full[(task, r["index"])] for r in rs),
                    "minus_full": _mean(diffs), "minus_full_ci95": _paired_ci(diffs),
                    "kl": _mean(r["kl"] for r in rs), "top1": _mean(r["top1"] for r in rs),
                    "carriers_kept": _mean(r["carriers_kept"] for r in rs)})
    return {"full": {t: {"n": len(a), "accuracy": _mean(a)} for t, a in sorted(by_task.items())},
            "cells": out}


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted(summary["full"])
    fig, axes = plt.subplots(2, len(tasks), figsize=(5 * len(tasks), 7), squeeze=False)
    lines = defaultdict(list)
    for c in summary["cells"]:
        lines[(c["task"], c["queries"], c.get("selection", "plain"), c["method"])].append(c)
    for j, task in enumerate(tasks):
        top, bottom = axes[0][j], axes[1][j]
        top.axhline(100 * summary["full"][task]["accuracy"], color="k", lw=1, label="full (original context)")
        for (tk, qs, sel, m), cs in sorted(lines.items()):
            if tk != task:
                continue
            cs = sorted(cs, key=lambda c: c["ratio"])
            x = [c["ratio"] for c in cs]
            style = "-" if qs == "default" else ("--" if qs == "question" else ":")
            label = (m if qs == "default" else f"{m}, +{qs} queries") + ("" if sel == "guarded" else f" ({sel})")
            top.plot(x, [100 * c["accuracy"] for c in cs], style, marker="o", label=label)
            bottom.plot(x, [c["kl"] for c in cs], style, marker="o", label=label)
        ratios = sorted({c["ratio"] for c in summary["cells"] if c["task"] == task})
        for ax in (top, bottom):
            ax.set_xscale("log")
            ax.set_xticks(ratios, [f"{r:g}" for r in ratios])
            ax.minorticks_off()
        n = summary["full"][task]["n"]
        top.set(title=f"{task} ({n} records)", ylabel="accuracy %", ylim=(-5, 105))
        bottom.set(yscale="log", xlabel="ratio kept", ylabel="KL to full (nats)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_summary(out: Path) -> dict:
    """Read ``out/records.jsonl``; write ``summary.json`` and ``retention.png``."""
    rows = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines() if x.strip()]
    run = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    summary = {**run, **aggregate(rows)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(summary, out / "retention.png")
    return summary
