"""Merge several ``kvlocks bench`` summaries (one device call each) into one result file.

    python scripts/analysis/merge_bench_runs.py OUT.json --note "..." RUN.json[=COMMAND] ...

Rows keep their order and gain ``run`` (the source file's stem, or its two parent folders for a
``summary.json``); ``config.runs`` lists each source's
config, command, file and recorded commit; ``copy_gbps`` becomes the list of the runs' copy
bandwidths. The other top-level fields come from the first run. ``--dedupe`` keeps only the first
row of each (model or shape, context, batch, method): list the newer runs first.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _key(row: dict) -> tuple:
    return (row.get("model", row.get("shape")), row.get("context"), row.get("batch"), row.get("method"))


def merge(paths: list[str], note: str, base: Path, dedupe: bool = False) -> dict:
    out, rows, runs, errors, bws = None, [], [], [], []
    for spec in paths:
        path, _, command = spec.partition("=")
        src = json.loads(Path(path).read_text())
        stem = Path(path).stem if Path(path).stem != "summary" else "/".join(Path(path).parts[-3:-1])
        out = out or {k: v for k, v in src.items() if k not in ("rows", "errors", "config", "copy_gbps")}
        seen = {_key(r) for r in rows} if dedupe else set()
        rows += [{**r, "run": stem} for r in src["rows"] if _key(r) not in seen]
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
    ap.add_argument("--dedupe", action="store_true", help="keep the first row per (model, context, batch, method)")
    args = ap.parse_args()
    out = Path(args.out)
    out.write_text(json.dumps(merge(args.runs, args.note, out.parent, args.dedupe), indent=1))


if __name__ == "__main__":
    main()
