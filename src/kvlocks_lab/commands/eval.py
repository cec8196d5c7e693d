"""``kvlocks eval``: the long-context task suite on identical records for every method."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlocks_lab import require_extras

METHODS_HELP = (
    "comma-separated methods. 'full' (dense attention, always run as the reference); selectors "
    "({selectors}), each run once per budget; compactions spelled NAME@RATIO with NAME in "
    "{compactions} and RATIO the kept fraction of the context, 0 < RATIO <= 1 (e.g. fold@0.1 keeps "
    "round(0.1 * T) entries per layer and KV head of the T-token context, the prompt before the "
    "question); run once per record, --budgets do not apply; the fit runs on the CPU even with "
    "--device cuda and takes minutes per record at 4K+ tokens (saved in OUT/compacted/ until the "
    "record is done, so runs resume)."
)


def _joined(values) -> str:
    return ",".join(map(str, values))


def _csv(kind):
    return lambda s: tuple(kind(x) for x in s.split(",") if x)


def add_parser(sub) -> None:
    from kvlocks.compaction.config import METHODS as COMPACTIONS
    from kvlocks_lab.eval.suite import EvalConfig, task_names
    from kvlocks.integrations.hf import method_names

    d = EvalConfig.__dataclass_fields__
    p = sub.add_parser("eval", help="run the task suite (resumable) and write summary.json, results.md, plots",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=d["model"].default)
    p.add_argument("--tasks", type=_csv(str), default=_joined(d["tasks"].default),
                   help=f"comma-separated tasks from {', '.join(task_names())}; ppl_continuation scores "
                        "the perplexity of natural-text continuations (see --ppl-tokens)")
    p.add_argument("--lengths", type=_csv(int), default=_joined(d["lengths"].default), help="target lengths L in tokens")
    p.add_argument("--budgets", type=_csv(int), default=_joined(d["budgets"].default),
                   help="selector budgets: tokens attended per layer and KV head at a decode step")
    p.add_argument("--methods", type=_csv(str), default=_joined(d["methods"].default),
                   help=METHODS_HELP.format(selectors=", ".join(m for m in method_names() if m != "full"),
                                            compactions=", ".join(COMPACTIONS)))
    p.add_argument("--samples", type=int, default=d["samples"].default, help="records per task and length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ppl-tokens", type=int, default=d["ppl_tokens"].default,
                   help="ppl_continuation: continuation tokens N scored after a context of L - N tokens "
                        "(at most half the shortest length)")
    p.add_argument("--compaction-max-queries", type=int, default=d["compaction_max_queries"].default,
                   help="compaction methods: reference queries per KV head")
    p.add_argument("--compaction-self-study-tokens", type=int, default=d["compaction_self_study_tokens"].default,
                   help="compaction methods: greedy tokens after each self-study prompt of the capture")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", type=Path, required=True, help="run directory (rows.jsonl is appended to: resumable)")
    p.set_defaults(func=run)


def run(args) -> int:
    require_extras()
    from kvlocks_lab.eval.suite import EvalConfig, run_eval

    cfg = EvalConfig(model=args.model, tasks=args.tasks, lengths=args.lengths, budgets=args.budgets,
                     methods=args.methods, samples=args.samples, seed=args.seed, dtype=args.dtype,
                     device=args.device, ppl_tokens=args.ppl_tokens,
                     compaction_max_queries=args.compaction_max_queries,
                     compaction_self_study_tokens=args.compaction_self_study_tokens)
    summary = run_eval(cfg, args.out)
    print((args.out / "results.md").read_text().split("\n\nPer task")[0])
    print(f"\n{summary['n_rows']} rows in {args.out / 'rows.jsonl'}; summary: {args.out / 'summary.json'}")
    return 0
