"""Paired comparisons of selection methods on an eval run's records: accuracy and next-token KL of
each method against a reference method at the same budget, per task x length and pooled.

    python scripts/analysis/paired_methods.py RUN/rows.jsonl --against oracle \
        --methods locks,locks_rerank --out RUN/paired.json

For every (task, length, budget) cell and for every budget pooled over the cells: the records both
methods have, each method's mean score, the paired difference (method - reference) with its
percentile bootstrap 95 % CI (kvlocks_lab.eval.metrics.paired_bootstrap_ci), the mean KL(full ||
method) of both, and ``full``'s accuracy on those records. ``--against full`` pairs every budget
of the methods with ``full`` (which has none). ``--by-length`` adds, per budget and length, the
cells pooled over the tasks (how a gap moves with the budget's share of the context). Prints a
Markdown table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from kvlocks_lab.eval.metrics import paired_bootstrap_ci


def load(path: Path) -> dict:
    """``{(task, length, method, budget): {record index: row}}`` (the last row of a repeated key wins)."""
    cells: dict = defaultdict(dict)
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            cells[(r["task"], r["length"], r["method"], r["budget"])][r["index"]] = r
    return cells


def _mean(xs: list) -> float | None:
    """The mean, or None where a row has no value (rows served through vLLM carry no KL)."""
    return None if any(x is None for x in xs) else sum(xs) / len(xs)


def compare(pairs: list[tuple[dict, dict, dict | None]]) -> dict:
    """Paired statistics of ``[(method row, reference row, full row or None)]``."""
    a = [m["score"] for m, _, _ in pairs]
    b = [r["score"] for _, r, _ in pairs]
    ci = paired_bootstrap_ci(a, b, n_boot=4000, seed=0)
    full = [f["score"] for _, _, f in pairs if f is not None]
    return {"n": len(pairs), "method": sum(a) / len(a), "reference": sum(b) / len(b),
            "diff": ci.mean, "low": ci.low, "high": ci.high,
            "kl_method": _mean([m.get("kl") for m, _, _ in pairs]),
            "kl_reference": _mean([r.get("kl") for _, r, _ in pairs]),
            "full": sum(full) / len(full) if full else None}


def analyse(cells: dict, methods: list[str], against: str, by_length: bool = False) -> list[dict]:
    out, pooled, per_length = [], defaultdict(list), defaultdict(list)
    # a reference without a budget (``full``) is paired with the methods at each of their budgets
    unbudgeted = any(m == against and b is None for (_, _, m, b) in cells)
    if unbudgeted:
        keys = sorted({(t, n, b) for (t, n, m, b) in cells if m in methods and b is not None})
    else:
        keys = sorted({(t, n, b) for (t, n, m, b) in cells if m == against})
    for task, length, budget in keys:
        ref = cells.get((task, length, against, None if unbudgeted else budget), {})
        full = cells.get((task, length, "full", None), {})
        for method in methods:
            mine = cells.get((task, length, method, budget), {})
            pairs = [(mine[i], ref[i], full.get(i)) for i in sorted(set(mine) & set(ref))]
            if not pairs:
                continue
            out.append({"task": task, "length": length, "budget": budget, "name": method, **compare(pairs)})
            pooled[(method, budget)] += pairs
            per_length[(method, budget, length)] += pairs
    if by_length:
        for (method, budget, length), pairs in sorted(per_length.items(), key=str):
            out.append({"task": "all", "length": length, "budget": budget, "name": method, **compare(pairs)})
    for (method, budget), pairs in sorted(pooled.items(), key=str):
        out.append({"task": "all", "length": "all", "budget": budget, "name": method, **compare(pairs)})
    return out


def _kl(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(rows: list[dict], against: str) -> str:
    head = (f"| task | length | budget | method | n | full % | method % | {against} % | "
            f"method − {against} (95 % CI) | KL method | KL {against} |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        full = "-" if r["full"] is None else f"{100 * r['full']:.0f}"
        lines.append(f"| {r['task']} | {r['length']} | {r['budget']} | {r['name']} | {r['n']} | {full} | "
                     f"{100 * r['method']:.1f} | {100 * r['reference']:.1f} | {100 * r['diff']:+.1f} "
                     f"[{100 * r['low']:+.1f}, {100 * r['high']:+.1f}] | {_kl(r['kl_method'])} | "
                     f"{_kl(r['kl_reference'])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", type=Path)
    ap.add_argument("--against", default="oracle")
    ap.add_argument("--methods", default="locks,locks_rerank")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--by-length", action="store_true", help="also pool over the tasks per budget and length")
    args = ap.parse_args()
    rows = analyse(load(args.rows), args.methods.split(","), args.against, args.by_length)
    print(table(rows, args.against))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
