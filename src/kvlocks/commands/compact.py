"""``kvlocks compact``: compact a text file's prefix cache to one safetensors file."""

from __future__ import annotations

import json
from pathlib import Path

from kvlocks.commands.common import (
    Progress, add_model_args, check_model_args, check_output_path, human_bytes, load_model, read_text_file,
    status,
)


def add_parser(sub) -> None:
    from kvlocks.compaction.config import BIAS_SOLVERS, METHODS, SELECTIONS, CompactionConfig

    p = sub.add_parser("compact", help="compact the KV cache of a text prefix (AM, fold, ...) to a file")
    add_model_args(p)
    p.add_argument("--input", type=Path, required=True, help="text file: the prefix to compact")
    p.add_argument("--out", type=Path, required=True, help="output .safetensors file")
    p.add_argument("--method", default="fold", choices=METHODS,
                   help="fold: AM with the bias folded into the keys (a plain cache); am: keeps the bias; "
                        "drop, drop_refit, rank1, merge_fold: baselines")
    from kvlocks.compaction.estimate import DEFAULT_RATIO, RATIO_HELP

    p.add_argument("--ratio", type=float, default=DEFAULT_RATIO,
                   help=f"fraction of keys kept per KV head, in (0, 1]. {RATIO_HELP} (default: {DEFAULT_RATIO})")
    p.add_argument("--question", action="append", metavar="TEXT",
                   help="a question the compacted prefix will be asked (repeatable): its queries, and those "
                        "of the model's answer to it, join the reference queries, so the keys it needs are kept")
    p.add_argument("--answer-prefix", default="", metavar="TEXT",
                   help="text after each --question, as `kvlocks generate --answer-prefix` will append it: the "
                        "recorded queries are then those of the answer (a base model given a bare question may "
                        "continue it otherwise)")
    defaults = CompactionConfig()
    p.add_argument("--coverage-share", type=float, default=defaults.coverage_share,
                   help="share of each head's kept keys chosen by how unique their direction is (ridge "
                        "leverage), which keeps facts no reference query reads; in [0, "
                        f"{1 - defaults.question_share:g}] (--question's guard keeps {defaults.question_share:g}) "
                        f"(default: {defaults.coverage_share:g})")
    p.add_argument("--value-anchor", type=float, default=defaults.value_anchor,
                   help="pull of each refit value towards the kept key's own value, >= 0; 0 refits freely "
                        f"(default: {defaults.value_anchor:g})")
    p.add_argument("--max-tokens", type=int, help="keep only the first N tokens of the input (default: all)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the text as a user turn of the chat template (and the reference prompts too)")
    p.add_argument("--selection", default="attention", choices=SELECTIONS,
                   help="how the kept keys are chosen: by attention mass, or greedily (OMP)")
    p.add_argument("--max-queries", type=int, default=4096, help="reference queries per KV head")
    p.add_argument("--seed", type=int, default=0, help="seed of the reference-query subsample")
    p.add_argument("--bias-solver", default=BIAS_SOLVERS[0], choices=BIAS_SOLVERS,
                   help="bounded least-squares solver of the bias fit")
    p.add_argument("--no-repeat", action="store_true", help="skip the 'repeat the context' pass")
    p.add_argument("--self-study-tokens", type=int, default=32,
                   help="greedy answer tokens per self-study prompt (0: prompts only)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


LONG_INPUT = 1024  # tokens from which the trade-off and an estimated time are printed first


def _before_start(num: int, config, reference, *, model: str, layer_heads: int, pass_scale: float) -> list[str]:
    """The lines printed before a long compaction: kept entries, estimated time, quality.
    ``layer_heads``: (layer, KV head) pairs that are fitted; ``pass_scale``: as in ``estimate_seconds``."""
    from kvlocks.compaction.estimate import estimate_seconds, tradeoff_lines

    t = config.budget(num)
    prompts = len(reference.self_study) + len(reference.questions)
    est = estimate_seconds(num, t, max_queries=config.max_queries, repeat_tokens=reference.repeat_tokens,
                           repeat_span=reference.repeat_span, layer_heads=layer_heads, pass_scale=pass_scale,
                           decode_steps=prompts * (reference.self_study_tokens + 15))  # ~15-token prompts
    return [f"keeping {t} of {num} entries per layer and KV head; estimated time about {est:.0f} s "
            "(measured scale: one thread of a 2-core x86-64 CPU; a busy machine is slower)",
            *tradeoff_lines(config.ratio, bool(reference.questions), model)]


def _prefix_ids(text: str, args, tok):
    if args.chat and tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
    chat = bool(args.chat and tok.chat_template)  # else plain text, after the tokenizer's BOS if it has one
    ids = tok(text, return_tensors="pt", add_special_tokens=not chat).input_ids  # [1, T]
    if args.max_tokens is not None:
        ids = ids[:, : args.max_tokens]
    return ids


def run(args) -> int:
    from kvlocks.compaction.cachefile import save
    from kvlocks.integrations.hf.compaction.passes import ReferenceConfig
    from kvlocks.compaction.config import CompactionConfig
    from kvlocks.integrations.hf.compaction.model import compact_prefix
    from kvlocks.hybrid import layer_windows

    config = CompactionConfig(method=args.method, ratio=args.ratio, selection=args.selection,
                              max_queries=args.max_queries, seed=args.seed,
                              bias_solver=args.bias_solver, coverage_share=args.coverage_share,
                              value_anchor=args.value_anchor)
    reference = ReferenceConfig(repeat=not args.no_repeat, self_study_tokens=args.self_study_tokens,
                                chat=args.chat, questions=tuple(args.question or ()), answer_prefix=args.answer_prefix)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens={args.max_tokens}: must be >= 1")
    text = read_text_file("--input", args.input)
    check_output_path("--out", args.out)
    check_model_args(args)
    model, tok = load_model(args)
    ids = _prefix_ids(text, args, tok)
    fitted = sum(w is None for w in layer_windows(model.config))  # a hybrid model's global layers
    steps = 1 + int(reference.repeat) + len(reference.self_study) + fitted
    steps += len(reference.questions)
    if not args.json:
        status(f"compacting {ids.shape[1]} tokens with {args.method} (ratio {args.ratio})")
        if ids.shape[1] >= LONG_INPUT:
            text_cfg = model.config.get_text_config(decoder=True)
            for line in _before_start(ids.shape[1], config, reference, model=args.model,
                                      layer_heads=fitted * text_cfg.num_key_value_heads,
                                      pass_scale=text_cfg.num_hidden_layers * text_cfg.hidden_size / (30 * 576)):
                print(line)
    bar = Progress(steps, "compact", "step", disable=args.json)
    calls = 0

    def progress(name):
        nonlocal calls
        bar.update(min(calls, steps), name)
        calls += 1

    local = Path(args.model).expanduser()
    model_id = str(local.resolve()) if local.is_dir() else args.model  # generate --cache finds it from any folder
    prefix = compact_prefix(model, tok, ids, config, reference=reference, model_id=model_id,
                            progress=progress)
    bar.update(steps)
    bar.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, prefix)
    size = args.out.stat().st_size
    report = {"out": str(args.out), "method": prefix.method, "T": prefix.prefix_len,
              "t": prefix.kept, "compact_s": round(prefix.compact_seconds, 2), "file_bytes": size,
              "config": json.loads(config.to_json())}
    if args.json:
        print(json.dumps(report))
    else:
        where = "global layer" if prefix.windows is not None else "layer"
        print(f"{prefix.method}: {prefix.prefix_len} tokens -> {prefix.kept} entries per {where} and "
              f"KV head in {prefix.compact_seconds:.1f} s; wrote {args.out} ({human_bytes(size)})")
        if prefix.windows is not None:
            kept = min(prefix.prefix_len, max(w for w in prefix.windows if w) - 1)
            print(f"note: {fitted} global layers compacted; the {len(prefix.windows) - fitted} "
                  f"sliding-window layers keep their last {kept} tokens exactly")
        if prefix.has_bias:
            print(f"note: a {prefix.method!r} cache keeps a logit bias; it is served with an additive "
                  "attention mask (dense SDPA), not by plain-cache kernels")
    return 0
