"""``kvlocks compaction-study``: fold vs AM vs baselines per layer and KV head, KL, accuracy."""

from __future__ import annotations

from pathlib import Path

from kvlocks_lab import require_extras


def _csv(kind, name):
    def parse(text: str):
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--{name}={text!r}: expected a comma-separated list of "
                             f"{kind.__name__} values") from None
    return parse


def add_parser(sub) -> None:
    from kvlocks.compaction.config import BIAS_SOLVERS
    from kvlocks_lab.compaction_study.config import StudyConfig

    d = StudyConfig.__dataclass_fields__
    p = sub.add_parser("compaction-study",
                       help="per-head fold/AM errors near and far, q.u, the bound, KL and accuracy")
    p.add_argument("--model", default=d["model"].default, help="bundled model name or local HF directory")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--tasks", default=",".join(d["tasks"].default),
                   help="comma-separated task-suite tasks (default: %(default)s)")
    p.add_argument("--lengths", default=",".join(map(str, d["lengths"].default)),
                   help="comma-separated record lengths in tokens (default: %(default)s)")
    p.add_argument("--ratios", default=",".join(map(str, d["ratios"].default)),
                   help="comma-separated compaction ratios t/T (default: %(default)s)")
    p.add_argument("--methods", default=",".join(d["methods"].default),
                   help="comma-separated methods, must include am and fold (default: %(default)s)")
    p.add_argument("--samples", type=int, default=d["samples"].default, help="records per task and length")
    p.add_argument("--seed", type=int, default=d["seed"].default)
    p.add_argument("--max-queries", type=int, default=d["max_queries"].default,
                   help="reference queries per KV head for the fits")
    p.add_argument("--heldout", type=float, default=d["heldout"].default,
                   help="fraction of the prefill's queries held out as near queries")
    p.add_argument("--far-tokens", type=int, default=d["far_tokens"].default,
                   help="natural-text tokens after the answer (far queries)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap on answer tokens (default: each task's own budget)")
    p.add_argument("--self-study-tokens", type=int, default=d["self_study_tokens"].default)
    p.add_argument("--bias-solver", default=d["bias_solver"].default, choices=BIAS_SOLVERS)
    p.add_argument("--no-compare-solvers", action="store_true",
                   help="skip the trf/bvls bias-solver comparison on the first record of each task")
    p.add_argument("--rebuild", action="store_true",
                   help="only recompute summary.json, report.md and the plots from the files in --out")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run)


def run(args) -> int:
    require_extras()
    from kvlocks_lab.compaction_study.config import StudyConfig
    from kvlocks_lab.compaction_study.run import rebuild, run_study

    cfg = StudyConfig(model=args.model, tasks=_csv(str, "tasks")(args.tasks),
                      lengths=_csv(int, "lengths")(args.lengths),
                      ratios=_csv(float, "ratios")(args.ratios),
                      methods=_csv(str, "methods")(args.methods), samples=args.samples,
                      seed=args.seed, max_queries=args.max_queries, heldout=args.heldout,
                      far_tokens=args.far_tokens, max_new_tokens=args.max_new_tokens,
                      self_study_tokens=args.self_study_tokens,
                      bias_solver=args.bias_solver, compare_solvers=not args.no_compare_solvers,
                      dtype=args.dtype, device=args.device)
    if args.rebuild:
        summary = rebuild(args.out)
    else:
        summary = run_study(cfg, args.out)
    for line in (args.out / "report.md").read_text().split("\n## Output error")[0].splitlines():
        print(line)
    print(f"\nwrote {args.out / 'summary.json'}, {args.out / 'report.md'}, heads.jsonl, records.jsonl "
          f"and plots ({summary['n_records']} records, {summary['wall_s'] / 60:.1f} min)")
    return 0
