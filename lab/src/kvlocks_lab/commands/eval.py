"""``kvlocks eval``: the long-context task suite on identical records for every method."""

from __future__ import annotations

from pathlib import Path

from kvlocks_lab import require_extras
from kvlocks_lab.commands import csv_of

METHODS_HELP = (
    "comma-separated methods. 'full' (dense attention, always run as the reference); selectors "
    "({selectors}), each run once per budget; compactions spelled NAME@RATIO with NAME in "
    "{compactions} and RATIO the kept fraction of the context, 0 < RATIO <= 1 (e.g. fold@0.1 keeps "
    "round(0.1 * T) entries per layer and KV head of the T-token context, the prompt before the "
    "question); run once per record, --budgets do not apply; the fit runs on --device (about a "
    "minute per record at 4K tokens on a 2-core CPU) and is saved in OUT/compacted/ until the "
    "record is done, so runs resume."
)


def _joined(values) -> str:
    return ",".join(map(str, values))


def add_parser(sub) -> None:
    from kvlocks.commands.common import HelpFormatter
    from kvlocks.compaction.config import METHODS as COMPACTIONS
    from kvlocks_lab.eval.grid import QUESTION_READS
    from kvlocks_lab.eval.suite import EvalConfig, task_names
    from kvlocks.integrations.hf import method_names

    d = EvalConfig.__dataclass_fields__
    p = sub.add_parser("eval", help="run the task suite (resumable) and write summary.json, results.md, plots",
                       formatter_class=HelpFormatter)
    p.add_argument("--model", default=d["model"].default)
    p.add_argument("--records", type=Path, default=None,
                   help="your own records, one JSON object per line (messages or text, question, answer_prefix, "
                        "answers, scorer: see docs/evaluation.md); replaces --tasks, --lengths, --samples, "
                        "--seed and --ppl-tokens")
    p.add_argument("--tasks", type=csv_of(str), default=None,
                   help=f"comma-separated tasks from {', '.join(task_names())}; ppl_continuation scores "
                        "the perplexity of natural-text continuations (see --ppl-tokens) "
                        f"(default: {_joined(d['tasks'].default)})")
    p.add_argument("--lengths", type=csv_of(int), default=None,
                   help=f"target lengths L in tokens (default: {_joined(d['lengths'].default)})")
    p.add_argument("--budgets", type=csv_of(int), default=_joined(d["budgets"].default),
                   help="selector budgets: tokens attended per layer and KV head at a decode step")
    p.add_argument("--methods", type=csv_of(str), default=_joined(d["methods"].default),
                   help=METHODS_HELP.format(selectors=", ".join(m for m in method_names() if m != "full"),
                                            compactions=", ".join(COMPACTIONS)))
    p.add_argument("--samples", type=int, default=None,
                   help=f"records per task and length (default: {d['samples'].default})")
    p.add_argument("--first-sample", type=int, default=None,
                   help="skip the records below this index (they keep their indexes: split one cell's records "
                        "across processes, e.g. --samples 10 and --first-sample 10 --samples 20; default: 0)")
    p.add_argument("--seed", type=int, default=None, help="seed of the task records (default: 0)")
    p.add_argument("--ppl-tokens", type=int, default=None,
                   help="ppl_continuation: continuation tokens N scored after a context of L - N tokens "
                        f"(at most half the shortest length; default: {d['ppl_tokens'].default})")
    p.add_argument("--compaction-max-queries", type=int, default=d["compaction_max_queries"].default,
                   help="compaction methods: reference queries per KV head")
    p.add_argument("--compaction-self-study-tokens", type=int, default=d["compaction_self_study_tokens"].default,
                   help="compaction methods: greedy tokens after each self-study prompt of the capture")
    p.add_argument("--question", default=d["question"].default, choices=QUESTION_READS,
                   help="how a record's question (the tokens after the context) is read: 'method' decodes it "
                        "through the method, selection included; 'dense' with full attention, as a serving engine "
                        "prefills the whole prompt (the method then selects from the first answer token)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", type=Path, required=True, help="run directory (rows.jsonl is appended to: resumable)")
    p.set_defaults(func=run)


TASK_OPTIONS = ("tasks", "lengths", "samples", "first_sample", "seed", "ppl_tokens")


def run(args) -> int:
    require_extras()
    if args.records is not None:
        return _run_records(args)
    from kvlocks_lab.eval.suite import EvalConfig, run_eval

    task_opts = {k: getattr(args, k) for k in TASK_OPTIONS if getattr(args, k) is not None}
    cfg = EvalConfig(model=args.model, budgets=args.budgets, methods=args.methods, dtype=args.dtype,
                     device=args.device, compaction_max_queries=args.compaction_max_queries,
                     compaction_self_study_tokens=args.compaction_self_study_tokens, question=args.question,
                     **task_opts)
    summary = run_eval(cfg, args.out)
    print((args.out / "results.md").read_text().split("\n\nPer task")[0])
    print(f"\n{summary['n_rows']} rows in {args.out / 'rows.jsonl'}; summary: {args.out / 'summary.json'}")
    return 0


def _run_records(args) -> int:
    from kvlocks_lab.eval.records_run import RecordsConfig, run_records

    given = ["--" + k.replace("_", "-") for k in TASK_OPTIONS if getattr(args, k) is not None]
    if given:
        raise ValueError(f"--records brings its own prompts: drop {', '.join(given)}")
    cfg = RecordsConfig(records=args.records, model=args.model, budgets=args.budgets, methods=args.methods,
                        dtype=args.dtype, device=args.device, compaction_max_queries=args.compaction_max_queries,
                        compaction_self_study_tokens=args.compaction_self_study_tokens, question=args.question)
    summary = run_records(cfg, args.out)
    print((args.out / "results.md").read_text().split("\n\nPer task")[0])
    print(f"\n{summary['n_rows']} rows in {args.out / 'rows.jsonl'}; summary: {args.out / 'summary.json'}")
    return 0
