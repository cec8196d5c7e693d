"""``kvlocks eval``: the long-context task suite on identical records for every method."""

from __future__ import annotations

from pathlib import Path


def _csv(kind):
    return lambda s: tuple(kind(x) for x in s.split(",") if x)


def add_parser(sub) -> None:
    from kvlocks.eval.suite import EvalConfig

    d = EvalConfig.__dataclass_fields__
    p = sub.add_parser("eval", help="run the task suite (resumable) and write summary.json, results.md, plots")
    p.add_argument("--model", default=d["model"].default)
    p.add_argument("--tasks", type=_csv(str), default=d["tasks"].default)
    p.add_argument("--lengths", type=_csv(int), default=d["lengths"].default)
    p.add_argument("--budgets", type=_csv(int), default=d["budgets"].default)
    p.add_argument("--methods", type=_csv(str), default=d["methods"].default)
    p.add_argument("--samples", type=int, default=d["samples"].default)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=run)


def run(args) -> int:
    from kvlocks.eval.suite import EvalConfig, run_eval

    cfg = EvalConfig(model=args.model, tasks=args.tasks, lengths=args.lengths, budgets=args.budgets,
                     methods=args.methods, samples=args.samples, seed=args.seed, dtype=args.dtype, device=args.device)
    summary = run_eval(cfg, args.out)
    print((args.out / "results.md").read_text().split("\n\nPer task")[0])
    print(f"\n{summary['n_rows']} rows in {args.out / 'rows.jsonl'}; summary: {args.out / 'summary.json'}")
    return 0
