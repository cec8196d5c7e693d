"""``kvlocks demo``: the main job — a planted fact in a ~4K-token document, full vs locks vs oracle."""

from __future__ import annotations

import json
from pathlib import Path

from kvlocks.commands._common import add_model_args, bytes_line, load_model


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="answer a planted-fact question with full, locks and oracle decode")
    add_model_args(p)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--out", type=Path, help="also write the report as JSON here")
    p.set_defaults(func=run)


def run(args) -> int:
    from tqdm import tqdm

    from kvlocks.demo import run_demo

    print(f"loading {args.model} ...", flush=True)
    model, tok = load_model(args)
    methods = ("full", "locks", "oracle")
    bar = tqdm(total=len(methods), desc="methods", unit="method")

    def progress(name):
        bar.set_postfix_str(name)
        bar.update(0)

    report = run_demo(model, tok, budget=args.budget, methods=methods, progress=progress)
    bar.update(len(methods))
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
