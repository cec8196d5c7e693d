"""``kvlocks generate``: generate text with full, LOCKS or oracle decode and report bytes read."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvlocks.commands._common import add_model_args, bytes_line, load_model

ENGINE_METHODS = ("locks", "dense", "auto")


def add_parser(sub) -> None:
    from kvlocks.integrations.hf import method_names

    p = sub.add_parser("generate", help="generate with a LOCKS cache and report bytes read")
    add_model_args(p)
    p.add_argument("--method", default=None, choices=method_names(), help="selector of the Hugging Face path "
                   "(default locks)")
    p.add_argument("--engine", choices=ENGINE_METHODS, default=None,
                   help="greedy decode with the static-cache engine instead (one CUDA graph per step on CUDA; "
                        "locks, dense, or auto: LOCKS from --auto-min-context prompt tokens, dense below)")
    p.add_argument("--auto-min-context", type=int, default=None, help="with --engine auto (default: from the model's shape, the "
                   "length at which one sequence's K/V per layer reaches 80 MB, the H200 crossover)")
    p.add_argument("--compile", action="store_true", help="with --engine: compile the decode step's per-layer "
                   "pieces with torch.compile (slower first step; on a GPU at batch 1 in max-autotune mode)")
    p.add_argument("--budget", type=int, default=256, help="tokens attended per layer and KV head")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--basis-bits", type=int, default=4)
    p.add_argument("--combine", default="mean_share")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file holding the prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--cache", type=Path,
                   help="compacted prefix (kvlocks compact --out FILE): the prompt continues after it")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvlocks.config import LocksConfig
    from kvlocks.integrations.hf import LocksCache, cache_kwargs

    config = LocksConfig(budget=args.budget, rank=args.rank, basis_bits=args.basis_bits, combine=args.combine)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens}: must be >= 1")
    if args.engine is not None:
        conflicts = [name for name, given in (("--method", args.method is not None), ("--cache", args.cache is not None),
                                              ("--sample", args.sample)) if given]
        if conflicts:
            raise ValueError(f"--engine decodes greedily with its own method: drop {', '.join(conflicts)}")
    elif args.auto_min_context is not None:
        raise ValueError("--auto-min-context applies to --engine auto only")
    elif args.compile:
        raise ValueError("--compile applies to --engine only (the Hugging Face path is not compiled)")
    args.method = args.method or "locks"
    prompt = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    if not prompt.strip():
        raise ValueError("the prompt is empty")
    model, tok = load_model(args)
    if not args.raw and tok.chat_template:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False).to(model.device)
    if args.engine is not None:
        return _run_engine(args, model, tok, enc.input_ids, config)
    inputs, prefix = dict(enc), None
    if args.cache is not None:  # continue after a compacted prefix: positions start at its T
        from kvlocks.compaction.serve import continuation_inputs, open_cache

        cache = open_cache(model, args.cache, method=args.method, config=config)
        inputs = continuation_inputs(cache, enc.input_ids)
        prefix = {"file": str(args.cache), "T": cache.prefix_len, "t": cache.kept,
                  "compaction": cache.compaction}
    else:
        cache = LocksCache(model.config, method=_method(args.method, model, tok, prompt), config=config)
    torch.manual_seed(args.seed)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, pad_token_id=tok.pad_token_id)
    if args.sample:
        gen["temperature"] = args.temperature
    out = model.generate(**inputs, **gen, **cache_kwargs(model, cache))
    text = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    stats = cache.stats.summary() if hasattr(cache, "stats") else {}
    if args.json:
        print(json.dumps({"method": args.method, "config": json.loads(config.to_json()),
                          "prompt_tokens": enc.input_ids.shape[1], "text": text, "stats": stats,
                          "prefix": prefix}))
    else:
        print(text)
        line = bytes_line(stats) if stats else "dense SDPA with the prefix's logit bias as attn_mask"
        head = "" if prefix is None else (
            f"after the {prefix['compaction']} prefix of {prefix['T']} tokens ({prefix['t']} entries); ")
        print(f"\n[{args.method}] {head}prompt {enc.input_ids.shape[1]} tokens; {line}")
    return 0


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
    """A selector name, or for ``loki`` a selector calibrated offline on other text.

    Loki's PCA must be fitted on text other than what it is evaluated on: 2,048 tokens of the
    stdlib prose corpus sharing no sentence with the prompt.
    """
    if name != "loki":
        return name
    import torch

    from kvlocks.corpus import calibration_text
    from kvlocks.selection.loki import LokiSelector, calibrate

    ids, _ = calibration_text(tok, tokens=2049, avoid=[prompt], seed=0)  # as the fidelity lab's 2,048
    return LokiSelector(calibrate(model, torch.tensor([ids], device=model.device)))
