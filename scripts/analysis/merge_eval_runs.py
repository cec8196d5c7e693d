"""Merge the run folders of several ``kvlocks eval`` jobs (one model, several tasks or lengths, as
``scripts/gpu/eval_grid.py`` runs them side by side) into one result folder with the eval's report.

    python scripts/analysis/merge_eval_runs.py OUT RUN [RUN ...] [--device "NVIDIA H200"]

Writes ``OUT/rows.jsonl`` (the runs' rows in order; a repeated (task, length, index, method,
budget) keeps its first row), and ``summary.json``, ``results.md`` and the plots exactly as
``kvlocks eval`` writes them for its own rows. ``config`` in the summary lists each run's
``summary.json`` config (or the run folder's name where a run was stopped before writing one).
The runs must share a model: their rows are compared against each other's ``full``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvlocks_lab.eval.report import write_report
from kvlocks_lab.eval.runner import row_key


def merge_rows(runs: list[Path]) -> tuple[list[dict], list[dict]]:
    """(rows, configs) of ``runs``: rows in order without repeated keys, each run's config."""
    rows, seen, configs = [], set(), []
    for run in runs:
        path = run / "rows.jsonl"
        if not path.exists():
            raise SystemExit(f"{run}: no rows.jsonl")
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut off when a job was stopped
                continue
            if row_key(row) not in seen:
                seen.add(row_key(row))
                rows.append(row)
        summary = run / "summary.json"
        configs.append({"run": run.name, **(json.loads(summary.read_text())["config"] if summary.exists() else {})})
    return rows, configs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("runs", type=Path, nargs="+")
    p.add_argument("--device", default="", help="the device the rows were measured on (recorded in summary.json)")
    args = p.parse_args(argv)
    rows, configs = merge_rows(args.runs)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "rows.jsonl", "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    write_report(rows, args.out, config={"runs": configs}, device=args.device)
    print(f"{len(rows)} rows from {len(args.runs)} runs -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
