"""Aggregate task-suite rows into summary.json, markdown tables and PNG plots.

summary.json: ``config``, ``commit`` (HEAD when the report was written), ``row_commits`` (the
commits whose code produced the rows: a resumed run may mix them; "unrecorded" for rows written
before rows carried it), ``device``, ``versions``, ``n_rows``;
``headline`` (per length x method x budget, over the scored tasks); ``cells`` (per scored task x
length x method x budget: means, n, paired CIs of the score against full and oracle);
``perplexity`` (per length x method x budget of ``ppl_continuation``: mean NLL and perplexity,
paired CIs of their differences against full and oracle, KL, top-1). Compaction cells
(``fold@0.1``, budget None) also carry ``ratio``, ``kept`` (mean entries per layer and KV head)
and ``compact_s`` (mean capture + fit seconds).
"""

from __future__ import annotations

import json
import math
import platform
import subprocess
from collections import defaultdict
from pathlib import Path

from kvlocks_lab.eval.continuation import PPL_TASK
from kvlocks_lab.eval.metrics import paired_bootstrap_ci

MIN_FULL_SCORE = 0.30  # a task counts towards accuracy averages only where full scores this much


def git_commit() -> str:
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


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def _ci(rows_a: dict, rows_b: dict, field: str) -> dict | None:
    """Paired bootstrap CI of ``a - b`` over the records both have (finite values only)."""
    idx = sorted(i for i in set(rows_a) & set(rows_b) if _finite(rows_a[i].get(field)) and _finite(rows_b[i].get(field)))
    if not idx:
        return None
    ci = paired_bootstrap_ci([rows_a[i][field] for i in idx], [rows_b[i][field] for i in idx], n_boot=2000, seed=0)
    return {"mean": ci.mean, "low": ci.low, "high": ci.high, "n": ci.n}


def _mean(vals: list[dict], f: str):
    xs = [v[f] for v in vals if v.get(f) is not None]
    return sum(xs) / len(xs) if xs else None


def _by_cell(rows: list[dict]) -> dict[tuple, dict[int, dict]]:
    by_cell: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in rows:
        by_cell[(r["task"], r["length"], r["method"], r["budget"])][r["index"]] = r
    return by_cell


def _cell_order(kv):
    return tuple(map(str, kv[0]))


COMPACTION_FIELDS = ("ratio", "kept", "compact_s")


def summarize(rows: list[dict]) -> list[dict]:
    """One cell per scored task x length x method x budget with means, n and paired CIs."""
    by_cell = _by_cell([r for r in rows if r["task"] != PPL_TASK])
    cells = []
    for (task, length, method, budget), recs in sorted(by_cell.items(), key=_cell_order):
        vals = list(recs.values())
        cell = {"task": task, "length": length, "method": method, "budget": budget, "n": len(vals)}
        for f in ("score", "strict", "exact_agree", "agree16", "kl", "top1", "stats_read_fraction"):
            cell[f] = _mean(vals, f)
        if any(v.get("ratio") is not None for v in vals):
            cell.update({f: _mean(vals, f) for f in COMPACTION_FIELDS})
        full = by_cell.get((task, length, "full", None), {})
        oracle = by_cell.get((task, length, "oracle", budget), {})
        cell["diff_vs_full"] = _ci(recs, full, "score") if method != "full" else None
        cell["diff_vs_oracle"] = _ci(recs, oracle, "score") if method not in ("full", "oracle") else None
        cells.append(cell)
    return cells


def summarize_ppl(rows: list[dict]) -> list[dict]:
    """One cell per length x method x budget of ``ppl_continuation``.

    ``ppl`` is the mean per-record perplexity; ``ppl_ratio_vs_full`` is exp of the mean paired
    NLL difference (the ratio of the geometric-mean perplexities over the paired records).
    """
    by_cell = _by_cell([r for r in rows if r["task"] == PPL_TASK])
    cells = []
    for (task, length, method, budget), recs in sorted(by_cell.items(), key=_cell_order):
        vals = list(recs.values())
        cell = {"task": task, "length": length, "method": method, "budget": budget, "n": len(vals)}
        for f in ("nll", "ppl", "kl", "top1", "stats_read_fraction", "new_tokens"):
            cell[f] = _mean(vals, f)
        if any(v.get("ratio") is not None for v in vals):
            cell.update({f: _mean(vals, f) for f in COMPACTION_FIELDS})
        refs = {"full": by_cell.get((task, length, "full", None), {}),
                "oracle": by_cell.get((task, length, "oracle", budget), {})}
        for ref, recs_ref in refs.items():
            skip = method == "full" or (ref == "oracle" and method == "oracle")
            for f in ("ppl", "nll"):
                cell[f"{f}_diff_vs_{ref}"] = None if skip else _ci(recs, recs_ref, f)
        d = cell["nll_diff_vs_full"]
        cell["ppl_ratio_vs_full"] = 1.0 if method == "full" else (math.exp(d["mean"]) if d else None)
        cells.append(cell)
    return cells


def headline(cells: list[dict], min_full_score: float = MIN_FULL_SCORE) -> list[dict]:
    """Per length x method x budget: accuracy averaged over tasks where full scores at least
    ``min_full_score`` (30 %), and agreement / KL averaged over all tasks."""
    full = {(c["task"], c["length"]): c["score"] for c in cells if c["method"] == "full"}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in cells:
        groups[(c["length"], c["method"], c["budget"])].append(c)
    out = []
    for (length, method, budget), cs in sorted(groups.items(), key=_cell_order):
        acc = [c["score"] for c in cs if (full.get((c["task"], length)) or 0) >= min_full_score]
        mean = lambda f: _mean(cs, f)
        h = {"length": length, "method": method, "budget": budget,
             "accuracy": sum(acc) / len(acc) if acc else None, "tasks_in_accuracy": len(acc),
             "exact_agree": mean("exact_agree"), "agree16": mean("agree16"), "kl": mean("kl"),
             "top1": mean("top1"), "read_fraction": mean("stats_read_fraction")}
        if any(c.get("ratio") is not None for c in cs):
            h.update({f: mean(f) for f in COMPACTION_FIELDS})
        out.append(h)
    return out


def _f(x, pct=False):
    return "—" if x is None else (f"{100 * x:.1f}" if pct else f"{x:.3g}")


def _budget(c) -> str:
    if c.get("kept") is not None:
        kept = f"kept {c['kept']:.0f}"
        return kept if c["budget"] is None else f"{c['budget']} of {kept}"
    return str(c["budget"]) if c["budget"] is not None else "—"


def _d(ci, scale=100.0, fmt="+.1f") -> str:
    """``mean [low, high]`` of a paired CI (scaled: 100 for percentages), or a dash."""
    if not ci:
        return "—"
    return f"{scale * ci['mean']:{fmt}} [{scale * ci['low']:{fmt}}, {scale * ci['high']:{fmt}}]"


def markdown(head: list[dict], cells: list[dict], ppl: list[dict] | None = None) -> str:
    lines = []
    if head:
        lines += ["| length | method | budget | accuracy % (tasks) | exact agree % | first-16 agree % | KL | top-1 % | read % of full |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for h in head:
            lines.append(f"| {h['length']} | {h['method']} | {_budget(h)} | {_f(h['accuracy'], True)} ({h['tasks_in_accuracy']}) | "
                         f"{_f(h['exact_agree'], True)} | {_f(h['agree16'], True)} | {_f(h['kl'])} | {_f(h['top1'], True)} | "
                         f"{_f(h['read_fraction'], True)} |")
    if ppl:
        lines += ([""] if lines else []) + [
            "Perplexity of natural-text continuations (teacher-forced, method active; paired 95% CIs):", "",
            "| length | method | budget | n | ppl | Δppl vs full [95% CI] | Δppl vs oracle [95% CI] | ppl ÷ full | KL | top-1 % | read % of full |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in ppl:
            lines.append(f"| {c['length']} | {c['method']} | {_budget(c)} | {c['n']} | {_f(c['ppl'])} | "
                         f"{_d(c['ppl_diff_vs_full'], 1.0, '+.4g')} | {_d(c['ppl_diff_vs_oracle'], 1.0, '+.4g')} | "
                         f"{_f(c['ppl_ratio_vs_full'])} | {_f(c['kl'])} | {_f(c['top1'], True)} | {_f(c['stats_read_fraction'], True)} |")
    if cells:
        lines += ["", "Per task (score %, paired 95% CI of the difference to full):", "",
                  "| task | length | method | budget | n | score % | Δ vs full [95% CI] | Δ vs oracle [95% CI] | KL |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in cells:
            lines.append(f"| {c['task']} | {c['length']} | {c['method']} | {_budget(c)} | {c['n']} | {_f(c['score'], True)} | "
                         f"{_d(c['diff_vs_full'])} | {_d(c['diff_vs_oracle'])} | {_f(c['kl'])} |")
    return "\n".join(lines) + "\n"


def write_report(rows: list[dict], out: Path, *, config: dict, device: str,
                 min_full_score: float = MIN_FULL_SCORE) -> dict:
    """summary.json, results.md and the plots of ``rows``; ``min_full_score``: see :func:`headline`."""
    cells = summarize(rows)
    head = headline(cells, min_full_score)
    ppl = summarize_ppl(rows)
    row_commits = sorted({r.get("commit", "unrecorded") for r in rows})
    summary = {"config": config, "commit": git_commit(), "row_commits": row_commits, "device": device,
               "versions": _versions(),
               "n_rows": len(rows), "headline": head, "cells": cells, "perplexity": ppl}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(markdown(head, cells, ppl))
    from kvlocks_lab.eval.plots import plot_all

    plot_all(rows, cells, out, ppl=ppl)
    return summary
