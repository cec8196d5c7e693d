"""``kvlocks demo``: the main job — a planted fact in a ~4K-token document, full vs locks vs oracle."""

from __future__ import annotations

import json
from pathlib import Path

from kvlocks.commands.common import (
    Progress, add_model_args, bytes_line, check_model_args, check_output_path, load_model, status,
)

METHODS = ("full", "locks", "oracle")


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="answer a planted-fact question with full, locks and oracle decode")
    add_model_args(p)
    p.add_argument("--budget", type=int, default=256,
                   help="tokens attended per layer and KV head by locks and oracle (a multiple of 16)")
    p.add_argument("--out", type=Path, help="also write the report as JSON here")
    p.add_argument("--write-document", type=Path, metavar="FILE",
                   help="only write the demo's document (one planted fact) to FILE and print its question "
                        "and answer prefix, e.g. to try kvlocks compact and generate --cache on it")
    p.set_defaults(func=run)


def _write_document(args) -> int:
    from kvlocks.demo import ANSWER, ANSWER_PREFIX, QUESTION, build_document

    check_output_path("--write-document", args.write_document)
    _, tok = load_model(args)
    text = build_document(tok)
    args.write_document.parent.mkdir(parents=True, exist_ok=True)
    args.write_document.write_text(text)
    print(f"wrote {args.write_document} ({len(tok(text).input_ids)} tokens)")
    print(f"question: {QUESTION}")
    print(f"answer prefix: {ANSWER_PREFIX}  (expected answer {ANSWER})")
    return 0


def run(args) -> int:
    from kvlocks.config import LocksConfig

    LocksConfig(budget=args.budget)  # checked before the model loads
    check_model_args(args)
    if args.write_document is not None:
        return _write_document(args)
    if args.out is not None:
        check_output_path("--out", args.out)
    model, tok = load_model(args)
    from kvlocks.demo import run_demo
    status(f"prefilling the ~4K-token document and decoding the answer with {', '.join(METHODS)}")
    bar = Progress(len(METHODS), "methods", "method", every=0.0)  # a line per method: each takes 10+ s
    report = run_demo(model, tok, budget=args.budget, methods=METHODS,
                      progress=lambda done, name: bar.update(done, name or ""))
    bar.close()
    print(f"\ndocument: {report['context_tokens']} tokens prefilled densely; "
          f"{report['decoded_prompt_tokens']} question tokens + the answer decoded step by step")
    print(f"question: {report['question']}  (expected {report['expected']})\n")
    for name, r in report["methods"].items():
        print(f"{name:>7}: {r['answer']!r}  correct={r['correct']}  agrees-with-full={r['token_agreement']:.2f}")
        print(f"         {bytes_line(r)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0
