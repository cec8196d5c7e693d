"""Merge several ``kvlocks bench`` summaries (one device call each) into one result file.

    python scripts/analysis/merge_bench_runs.py OUT.json --note "..." RUN.json[=COMMAND] ...

Rows keep their order and gain ``run`` (the source file's stem); ``config.runs`` lists each source's
config, command, file and recorded commit; ``copy_gbps`` becomes the list of the runs' copy
bandwidths. The other top-level fields come from the first run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def merge(paths: list[str], note: str, base: Path) -> dict:
    out, rows, runs, errors, bws = None, [], [], [], []
    for spec in paths:
        path, _, command = spec.partition("=")
        src = json.loads(Path(path).read_text())
        stem = Path(path).stem
        out = out or {k: v for k, v in src.items() if k not in ("rows", "errors", "config", "copy_gbps")}
        rows += [{**r, "run": stem} for r in src["rows"]]
        errors += [{**e, "run": stem} for e in src.get("errors", [])]
        bws.append(src.get("copy_gbps"))
        runs.append({**src.get("config", {}), "command": command or None,
                     "file": str(Path(path).resolve().relative_to(base.resolve())), "commit": src.get("commit")})
    out.update(commit=note, config={"runs": runs}, copy_gbps=bws, rows=rows, errors=errors)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+", help="summary.json paths, each optionally =COMMAND")
    ap.add_argument("--note", required=True, help="where and at which commits the runs were made")
    args = ap.parse_args()
    out = Path(args.out)
    out.write_text(json.dumps(merge(args.runs, args.note, out.parent), indent=1))


if __name__ == "__main__":
    main()
