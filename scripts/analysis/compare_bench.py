"""Compare two ``kvlocks bench kernels|e2e`` runs of the same cases (before and after a change).

    python scripts/analysis/compare_bench.py BEFORE/rows.jsonl AFTER/rows.jsonl [--out compare.json]
        [--tolerance 0.03]

Rows are matched by (model or shape, context, batch, method); the time compared is ``time_us``
(kernels) or ``tpot_ms`` (e2e). Prints one line per case with ``after / before`` and writes a JSON
file with every ratio, the cases slower by more than the tolerance (``regressions``) and the cases
found in one run only. Exit status 1 when a case regressed, 2 when no case is common to both runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TIME_FIELDS = ("time_us", "tpot_ms")


def _key(row: dict) -> tuple:
    return (row.get("model", row.get("shape")), row.get("context"), row.get("batch"), row.get("method"))


def _time(row: dict) -> tuple[str, float] | None:
    for field in TIME_FIELDS:
        if isinstance(row.get(field), (int, float)):
            return field, float(row[field])
    return None


def load(path: str) -> dict[tuple, tuple[str, float]]:
    """The timed rows of a ``rows.jsonl`` by key (a repeated key keeps its first row)."""
    out: dict[tuple, tuple[str, float]] = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        timed = _time(row)
        if timed is not None and timed[1] > 0:
            out.setdefault(_key(row), timed)
    return out


def compare(before: dict, after: dict, tolerance: float) -> dict:
    cases, regressions = [], []
    for key in before.keys() & after.keys():
        (field, b), (_, a) = before[key], after[key]
        case = {"key": list(key), "field": field, "before": b, "after": a, "ratio": a / b}
        cases.append(case)
        if a / b > 1.0 + tolerance:
            regressions.append(case)
    order = sorted(cases, key=lambda c: tuple(str(x) for x in c["key"]))
    return {"tolerance": tolerance, "cases": order, "regressions": regressions,
            "only_before": sorted(map(list, before.keys() - after.keys()), key=str),
            "only_after": sorted(map(list, after.keys() - before.keys()), key=str)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--out", help="write the comparison as JSON here")
    ap.add_argument("--tolerance", type=float, default=0.03, help="a slower ratio than 1 + this is a regression")
    args = ap.parse_args(argv)
    result = compare(load(args.before), load(args.after), args.tolerance)
    for case in result["cases"]:
        mark = "  REGRESSION" if case in result["regressions"] else ""
        print(f"{' '.join(map(str, case['key']))}: {case['before']:.3f} -> {case['after']:.3f} {case['field']} "
              f"({case['ratio']:.3f}x){mark}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if not result["cases"]:
        print("no case is common to both runs", file=sys.stderr)
        return 2
    return 1 if result["regressions"] else 0


if __name__ == "__main__":
    sys.exit(main())
