"""``kvlocks generate``: generate text with full, LOCKS or oracle decode and report bytes read."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvlocks.commands.common import (
    add_model_args, add_original_fractions, bytes_line, check_model_args, load_model, read_cache_header,
    read_text_file, status,
)
from kvlocks.positions import TRUNCATE

ENGINE_METHODS = ("locks", "dense", "auto")
ROLES = ("system", "user", "assistant")


class MethodList(tuple):
    """The method names, as argparse ``choices`` that also accept a comma-separated list of them."""

    def __contains__(self, value) -> bool:
        parts = value.split(",") if isinstance(value, str) else [value]
        return len(set(parts)) == len(parts) and all(tuple.__contains__(self, p) for p in parts)
# LocksConfig options of this command and their defaults (None in argparse: "given" is visible)
LOCKS_DEFAULTS = {"budget": 256, "rank": 8, "basis_bits": 4, "combine": "mean_share", "rerank": "auto", "rerank_min": 0,
                  "rerank_scores": "summary"}
TEMPERATURE = 0.7


def add_parser(sub) -> None:
    from kvlocks.config import BASIS_BITS, COMBINE_RULES, METHOD_MODES, RERANK_SCORES
    from kvlocks.selection.selectors import selector_names

    # kvlocks.integrations.hf.method_names(), without importing transformers before the checks
    methods = tuple(dict.fromkeys(("full", *METHOD_MODES, *selector_names())))
    p = sub.add_parser("generate", help="generate with a LOCKS cache and report bytes read")
    add_model_args(p, model_help="; with --cache: the model the file was made for")
    p.add_argument("--method", default=None, choices=MethodList(methods), metavar="METHOD[,METHOD...]",
                   help=f"selector of the Hugging Face path, from {', '.join(methods)}; full: dense attention "
                        "over every token (default: locks; with an am/rank1 --cache: full). Several, "
                        "comma-separated (full,locks,oracle): every one decodes from one shared prefill of the "
                        "prompt, and a table shows their answers side by side")
    p.add_argument("--engine", choices=ENGINE_METHODS, default=None,
                   help="greedy decode with the static-cache engine instead (one CUDA graph per step on CUDA; "
                        "locks, dense, or auto: LOCKS from --auto-min-context prompt tokens, dense below)")
    p.add_argument("--auto-min-context", type=int, default=None, help="with --engine auto (default: from the model's shape, the "
                   "length at which one sequence's K/V per layer reaches 80 MB, the H200 crossover)")
    p.add_argument("--compile", action="store_true", help="with --engine: compile the decode step's per-layer "
                   "pieces with torch.compile (slower first step; on a GPU at batch 1 in max-autotune mode)")
    p.add_argument("--budget", type=int, default=None, help="tokens attended per layer and KV head, a multiple of "
                   f"the 16-token page (default: {LOCKS_DEFAULTS['budget']}; not used by --method full)")
    p.add_argument("--rank", type=int, default=None, help="rank of each page's key summary, 1..16 "
                   f"(default: {LOCKS_DEFAULTS['rank']})")
    p.add_argument("--basis-bits", type=int, default=None, choices=BASIS_BITS,
                   help=f"bits per element of the summary basis (default: {LOCKS_DEFAULTS['basis_bits']})")
    p.add_argument("--combine", default=None, choices=COMBINE_RULES,
                   help="how the query heads of a GQA group combine their page scores "
                        f"(default: {LOCKS_DEFAULTS['combine']})")
    p.add_argument("--rerank", type=int, default=None, help="two-stage selection: the scores choose this many "
                   "times (k - 2) candidate pages, their exact masses from their keys pick the k (0 for flat "
                   "scoring, or 2..64; default: 4 below 30 free pages a step, else 0, the measured rule of "
                   "kvlocks.config.auto_rerank; --method locks_rerank / locks_centroid set it where it is not given); on the Hugging Face "
                   "path and the engine alike")
    p.add_argument("--rerank-min", type=int, default=None, help="with --rerank: at least this many candidates")
    p.add_argument("--rerank-scores", default=None, choices=RERANK_SCORES,
                   help="with --rerank: what chooses the candidates: the whole summaries (Eq. 4) or their centroids "
                        "alone (reads D + 2 bytes a page; e.g. --engine locks --rerank 8 --rerank-min 256 "
                        "--rerank-scores centroid; default: summary)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file holding the prompt")
    src.add_argument("--chat", type=Path, help='JSON file of chat messages, [{"role": "system" | "user" | '
                     '"assistant", "content": "..."}, ...] or {"messages": [...]}, ending with a user message; '
                     "rendered with the model's chat template")
    p.add_argument("--answer-prefix", default=None, help="text the answer starts with, placed after the assistant "
                   "header (after the prompt with --raw); the model continues it")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--truncate", choices=TRUNCATE, default=None,
                   help="when the prompt plus --max-new-tokens exceeds the model's positions, cut the prompt's "
                        "text instead of refusing: left drops its start (keeps the question at the end), right "
                        "its end; the chat template and --answer-prefix are kept")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"sampling temperature, with --sample (default: {TEMPERATURE})")
    p.add_argument("--seed", type=int, default=0, help="torch seed (sampling, and the random selector)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--cache", type=Path,
                   help="compacted prefix (kvlocks compact --out FILE): the prompt continues after it")
    p.set_defaults(func=run)


def _read_messages(args) -> list[dict]:
    """The chat messages of --prompt, --prompt-file (one user message each) or --chat."""
    if args.chat is None:
        prompt = args.prompt if args.prompt is not None else read_text_file("--prompt-file", args.prompt_file)
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        return [{"role": "user", "content": prompt}]
    if args.raw:
        raise ValueError("--chat is rendered with the chat template; --raw takes --prompt or --prompt-file")
    try:
        data = json.loads(read_text_file("--chat", args.chat))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--chat {args.chat}: not valid JSON ({exc})") from None
    msgs = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f'--chat {args.chat}: expected a list of messages or {{"messages": [...]}}')
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or set(m) != {"role", "content"} or m["role"] not in ROLES \
                or not isinstance(m["content"], str):
            raise ValueError(f"--chat {args.chat}: message {i} must be {{\"role\": one of {list(ROLES)}, "
                             f"\"content\": a string}}, got {m!r:.80}")
    if msgs[-1]["role"] != "user" or not msgs[-1]["content"].strip():
        raise ValueError(f"--chat {args.chat}: the last message must be a non-empty user message (the model answers it)")
    return msgs


def _check_options(args) -> None:
    """Option combinations, before anything is read or loaded."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens}: must be >= 1")
    if args.engine is not None:
        conflicts = [name for name, given in (("--method", args.method is not None), ("--cache", args.cache is not None),
                                              ("--sample", args.sample)) if given]
        if conflicts:
            raise ValueError(f"--engine decodes greedily with its own method: drop {', '.join(conflicts)}")
        if args.auto_min_context is not None and args.engine != "auto":
            raise ValueError("--auto-min-context applies to --engine auto only")
    elif args.auto_min_context is not None:
        raise ValueError("--auto-min-context applies to --engine auto only")
    elif args.compile:
        raise ValueError("--compile applies to --engine only (the Hugging Face path is not compiled)")
    if args.auto_min_context is not None and args.auto_min_context < 1:
        raise ValueError(f"--auto-min-context={args.auto_min_context}: must be >= 1")
    if args.method is not None and "," in args.method:
        conflicts = [name for name, given in (("--engine", args.engine is not None), ("--cache", args.cache is not None))
                     if given]
        if conflicts:
            raise ValueError(f"several --method values decode on the Hugging Face path from a fresh prefill: "
                             f"drop {', '.join(conflicts)}")
    if args.temperature is not None:
        if not args.sample:
            raise ValueError("--temperature applies to --sample only (greedy decoding has no temperature)")
        if not args.temperature > 0:
            raise ValueError(f"--temperature={args.temperature}: must be > 0")


def _locks_config(args, dense: str | None):
    """The LocksConfig from the options given; ``dense`` names the dense mode, whose run has no
    use for them: giving one there is an error, not a silently ignored option."""
    from kvlocks.config import LocksConfig

    given = [k for k in LOCKS_DEFAULTS if getattr(args, k) is not None]
    if dense and given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"{dense} attends every token, so {flags} would be unused; drop "
                         f"{'it' if len(given) == 1 else 'them'}, or choose a selector (e.g. --method locks)")
    return LocksConfig(**{k: LOCKS_DEFAULTS[k] if getattr(args, k) is None else getattr(args, k)
                          for k in LOCKS_DEFAULTS})


def _cache_method(args, header: dict) -> str:
    """The method for a --cache file: a biased (am/rank1) prefix needs dense attention."""
    if header["method"] in ("am", "rank1"):
        if args.method not in (None, "full"):
            raise ValueError(
                f"--method {args.method}: {args.cache} holds a {header['method']!r} cache, whose logit bias "
                "needs dense attention; use --method full, or compact with --method fold")
        return "full"
    return args.method or "locks"


def _cache_model(args, header: dict) -> None:
    """Without --model, a --cache file's own model (if it is a bundled name or a directory here)."""
    from kvlocks.models import check

    if args.model is not None:
        return
    try:
        check(header["model_id"])
    except (ValueError, FileNotFoundError):
        raise ValueError(f"--cache {args.cache} was made for model {header['model_id']!r}, which is "
                         "neither a bundled model nor a directory here; pass --model") from None
    args.model = header["model_id"]


def run(args) -> int:
    _check_options(args)
    header = None
    if args.cache is not None:
        header = read_cache_header(args.cache)
        args.method = _cache_method(args, header)
        _cache_model(args, header)
    if args.engine is None:
        args.method = args.method or "locks"
    dense = ("--method full" if args.method == "full" else "--engine dense" if args.engine == "dense" else None)
    config = _locks_config(args, dense)
    if args.method and "," not in args.method:  # a mode name (locks_rerank, ...) sets the fields not given
        from kvlocks.config import method_config

        config = method_config(args.method, config)
    messages = _read_messages(args)
    check_model_args(args)
    model, tok = load_model(args)
    from kvlocks.integrations.hf import LocksCache, cache_kwargs

    if args.chat is not None and not tok.chat_template:
        raise ValueError(f"--chat {args.chat}: the model {args.model} has no chat template; give --prompt with --raw")
    def render(text: str) -> str:
        if args.raw or not tok.chat_template:
            return text + (args.answer_prefix or "")
        if header is not None and header["chat"] and len(messages) == 1:  # the turn after the cached one
            from kvlocks.chat import next_user_turn

            return next_user_turn(tok, text) + (args.answer_prefix or "")
        msgs = messages[:-1] + [{"role": "user", "content": text}]
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + (args.answer_prefix or "")

    from kvlocks.commands.fit import fit_prompt
    from kvlocks.positions import position_limit

    # no template: the tokenizer's own BOS (base models need it), except after a compacted prefix
    plain = (args.raw or not tok.chat_template) and header is None
    prompt, dropped = fit_prompt(tok, messages[-1]["content"], render, args.max_new_tokens,
                                 position_limit(model.config), args.truncate,
                                 offset=int(header["T"]) if header is not None else 0, special=plain)
    if dropped:
        status(f"--truncate {args.truncate}: dropped {dropped} tokens from the "
               f"{'start' if args.truncate == 'left' else 'end'} of the prompt to fit the model's positions")
    enc = tok(prompt, return_tensors="pt", add_special_tokens=plain).to(model.device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, pad_token_id=tok.pad_token_id)
    if args.sample:
        gen["temperature"] = TEMPERATURE if args.temperature is None else args.temperature
    if args.method and "," in args.method:
        from kvlocks.commands.generate_side import run_side_by_side

        return run_side_by_side(args, model, tok, enc, config, lambda name: _method(name, model, tok, prompt), gen)
    if args.engine is not None:
        return _run_engine(args, model, tok, enc.input_ids, config)
    inputs, prefix = dict(enc), None
    if args.cache is not None:  # continue after a compacted prefix: positions start at its T
        from kvlocks.integrations.hf.compaction.serve import continuation_inputs, open_cache

        cache = open_cache(model, args.cache, method=args.method, config=config)
        inputs = continuation_inputs(cache, enc.input_ids)
        prefix = {"file": str(args.cache), "T": cache.prefix_len, "t": cache.kept,
                  "compaction": cache.compaction, "hybrid": any(x.is_sliding for x in cache.layers)}
    else:
        cache = LocksCache(model.config, method=_method(args.method, model, tok, prompt), config=config)
    torch.manual_seed(args.seed)
    out = model.generate(**inputs, **gen, **cache_kwargs(model, cache))
    text = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    stats = cache.stats.summary() if hasattr(cache, "stats") else {}
    if prefix is not None:
        stats = add_original_fractions(stats, prefix["T"], prefix["t"])
    if args.json:
        print(json.dumps({"method": args.method, "config": json.loads(getattr(cache, "config", config).to_json()),
                          "prompt_tokens": enc.input_ids.shape[1], "text": text, "stats": stats,
                          "prefix": prefix}))
    else:
        print(text)
        print(f"\n[{args.method}] {_summary_line(stats, prefix, enc.input_ids.shape[1])}")
    return 0


def _summary_line(stats: dict, prefix: dict | None, prompt_tokens: int) -> str:
    if prefix is None:
        return f"prompt {prompt_tokens} tokens; {bytes_line(stats)}"
    where = "global layer" if prefix.get("hybrid") else "layer"
    head = (f"after the {prefix['compaction']} prefix of {prefix['T']} tokens ({prefix['t']} entries per "
            f"{where} and KV head, {100 * prefix['t'] / prefix['T']:.1f}%); prompt {prompt_tokens} tokens; ")
    if stats:
        return head + bytes_line(stats, original=prefix)
    return head + "dense SDPA over the compacted entries with the prefix's logit bias as attn_mask"


def _run_engine(args, model, tok, ids, config) -> int:
    """Greedy decode with :class:`kvlocks.engine.DecodeEngine` (batch 1) and report its speed."""
    import time

    from kvlocks.engine import DecodeEngine, EngineConfig

    extra = {} if args.auto_min_context is None else {"auto_min_context": args.auto_min_context}
    eng = DecodeEngine(model, EngineConfig(method=args.engine, locks=config, max_context=ids.shape[1] + args.max_new_tokens,
                                           compile=args.compile, **extra))
    t0 = time.perf_counter()
    out = eng.generate(ids, max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - t0
    text = tok.decode(out[0], skip_special_tokens=True)
    info = {"engine": args.engine, "method": eng.method, "backend": eng.backend, "cuda_graph": eng.use_graph,
            "compiled": args.compile,
            "prompt_tokens": ids.shape[1], "new_tokens": args.max_new_tokens, "seconds": seconds}
    if args.json:
        print(json.dumps({**info, "config": json.loads(config.to_json()), "text": text}))
    else:
        print(text)
        print(f"\n[engine {args.engine}: {eng.method}, {eng.backend}{', CUDA graph' if eng.use_graph else ''}] prompt "
              f"{ids.shape[1]} tokens; {args.max_new_tokens} new tokens in {seconds:.2f} s (prefill included)")
    return 0


def _method(name: str, model, tok, prompt: str):
    """A selector name, or the selector's own ``prepare(model, tok, prompt)`` result for selectors
    that must be fitted before a run (Loki's calibration on other text than the prompt)."""
    from kvlocks.config import METHOD_MODES
    from kvlocks.selection.selectors import get_selector

    if name == "full" or name in METHOD_MODES:  # the cache's own method names, not registered selectors
        return name

    selector = get_selector(name)
    prepare = getattr(selector, "prepare", None)
    return name if prepare is None else prepare(model, tok, prompt)
