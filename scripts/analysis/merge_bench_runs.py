"""Merge several ``kvlocks bench`` summaries (one GPU run each) into one result file.

    python scripts/analysis/merge_bench_runs.py OUT.json --note "..." RUN.json[=COMMAND] ...

Rows keep their order and gain ``run`` (the source file's stem, or its two parent folders for a
``summary.json``); ``config.runs`` lists each source's
config, command, file and recorded commit; ``copy_gbps`` becomes the list of the runs' copy
bandwidths. The other top-level fields come from the first run. ``--dedupe`` keeps only the first
row of each (model or shape, context, batch, method): list the newer runs first. ``--sort`` orders
the rows by model (first appearance), batch, context (largest first). ``--exclude
MODEL:CONTEXT:BATCH[@RUN]=REASON`` moves that case's rows (of run RUN only, a row's ``run`` value,
where given) to ``errors`` with the reason (a measurement known to be invalid, or made under settings
other than the defaults, stays on record, out of the table).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _key(row: dict) -> tuple:
    return (row.get("model", row.get("shape")), row.get("context"), row.get("batch"), row.get("method"))


def merge(paths: list[str], note: str, base: Path, dedupe: bool = False, sort: bool = False,
          exclude: dict | None = None) -> dict:
    out, rows, runs, errors, bws = None, [], [], [], []
    exclude = exclude or {}
    used = set()
    for spec in paths:
        path, _, command = spec.partition("=")
        src = json.loads(Path(path).read_text())
        stem = Path(path).stem if Path(path).stem != "summary" else "/".join(Path(path).parts[-3:-1])
        out = out or {k: v for k, v in src.items() if k not in ("rows", "errors", "config", "copy_gbps")}
        seen = {_key(r) for r in rows} if dedupe else set()
        for r in src["rows"]:
            r = {**r, "run": stem}
            rule = next(((case, run) for case, run in exclude if _key(r)[:3] == case and run in (None, stem)), None)
            if rule is not None:  # excluded before deduplication: another run's row of the case may stand
                used.add(rule)
                errors.append({"model": r.get("model", r.get("shape")), "context": r.get("context"),
                               "batch": r.get("batch"), "method": r.get("method"), "run": stem,
                               "tpot_ms": r.get("tpot_ms"), "error": f"excluded: {exclude[rule]}"})
            elif _key(r) not in seen:
                rows.append(r)
        errors += [{**e, "run": stem} for e in src.get("errors", [])]
        bws.append(src.get("copy_gbps"))
        runs.append({**src.get("config", {}), "command": command or None,
                     "file": str(Path(path).resolve().relative_to(base.resolve())), "commit": src.get("commit")})
    for case, run in exclude.keys() - used:
        raise SystemExit(f"--exclude {case}{'@' + run if run else ''}: no such rows")
    if sort:
        models = list(dict.fromkeys(_key(r)[0] for r in rows))
        rows.sort(key=lambda r: (models.index(_key(r)[0]), r.get("batch") or 0, -(r.get("context") or 0)))
    out.update(commit=note, config={"runs": runs}, copy_gbps=bws, rows=rows, errors=errors)
    return out


def _exclusion(spec: str) -> tuple[tuple, str]:
    case, sep, reason = spec.partition("=")
    case, _, run = case.partition("@")
    parts = case.split(":")
    if not sep or not reason or len(parts) != 3:
        raise SystemExit(f"--exclude wants MODEL:CONTEXT:BATCH[@RUN]=REASON, got {spec!r}")
    return ((parts[0], int(parts[1]), int(parts[2])), run or None), reason


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+", help="summary.json paths, each optionally =COMMAND")
    ap.add_argument("--note", required=True, help="where and at which commits the runs were made")
    ap.add_argument("--dedupe", action="store_true", help="keep the first row per (model, context, batch, method)")
    ap.add_argument("--sort", action="store_true", help="rows by model, batch, context (largest first)")
    ap.add_argument("--exclude", action="append", default=[], help="MODEL:CONTEXT:BATCH[@RUN]=REASON (repeatable)")
    args = ap.parse_args()
    out = Path(args.out)
    exclude = dict(_exclusion(e) for e in args.exclude)
    out.write_text(json.dumps(merge(args.runs, args.note, out.parent, args.dedupe, args.sort, exclude), indent=1))


if __name__ == "__main__":
    main()
