"""Carrier survival of a fidelity run by task, selector and budget (from its ``rows.jsonl``).

``python -m kvlocks_lab.fidelity.by_task RUN_DIR [--out FILE]`` prints one line per (task,
selector, budget) and writes them as JSON: ``of_oracle`` (the carrier pages the exact oracle
keeps that the selector keeps too, over every step and head), ``hot`` (carrier pages kept on the
(query head, step) units that put at least the run's ``hot_share`` of their mass on them), with
their counts, and the mean coverage.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def carrier_by_task(rows_path: Path) -> list[dict]:
    """Aggregate the ``selection`` rows of a run (those of prompts with carrier pages)."""
    acc: dict = defaultdict(lambda: [0, 0, 0, 0, 0.0, 0])
    with open(rows_path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") != "selection" or "carrier_hot_n" not in r:
                continue
            a = acc[(r["task"], r["selector"], r["budget"])]
            a[0] += r["carrier_of_oracle_hits"]
            a[1] += r["carrier_of_oracle_n"]
            a[2] += r["carrier_hot_hits"]
            a[3] += r["carrier_hot_n"]
            a[4] += r["coverage"]
            a[5] += 1
    return [{"task": t, "selector": s, "budget": b, "of_oracle": a[0] / a[1] if a[1] else None,
             "of_oracle_n": a[1], "hot": a[2] / a[3] if a[3] else None, "hot_n": a[3], "coverage": a[4] / a[5]}
            for (t, s, b), a in sorted(acc.items())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a `kvlocks fidelity --out` folder")
    ap.add_argument("--out", type=Path, help="write the table as JSON here")
    args = ap.parse_args(argv)
    table = carrier_by_task(args.run / "rows.jsonl")
    for r in table:
        print(f"{r['task']:16s} {r['selector']:18s} {r['budget']:5d}  of_oracle {r['of_oracle']:.3f} "
              f"(n={r['of_oracle_n']})  hot {r['hot']:.3f} (n={r['hot_n']})  coverage {r['coverage']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
