"""Output tokens per second with many long requests at once, in real CUDA vLLM: the LOCKS backend
against vLLM's FLASH_ATTN, same script, same engine settings, same prompts.

Each (model, backend) runs in its own engine process (random weights from ``configs/``, token-id
prompts, as :mod:`kvlocks_lab.bench.vllm_tpot`), with ``max_num_seqs`` the largest concurrency and
``max_model_len`` the longest context plus the new tokens; one short request runs first, so that
the kernels are compiled before anything is timed. For every context and concurrency ``N``,
``N`` fresh random prompts of ``context`` tokens are submitted at once, ``--new-tokens`` outputs
each (greedy, EOS ignored), twice:

1. ``cold``: the prompts' prefixes are made as ``--prefix`` says (``prefill``: the model prefills
   them; ``connector``: random K/V written into vLLM's cache by
   :mod:`kvlocks_lab.bench.random_prefix`, which is not a prefill), then every request decodes;
2. ``warm``: the same prompts again: whatever of their prefixes the pool still holds is a
   prefix-cache hit, so with a pool that holds every request this pass is decode-bound.

Per pass: wall seconds, output tokens, ``tok_s`` (output tokens / wall seconds), each request's
decode rate (``(new_tokens - 1) / (last_token_ts - first_token_ts)``), the slowest first token, and
the engine's preemptions (``vllm:num_preemptions``; vLLM preempts when the pool runs out, which a
smaller pool makes more likely: LOCKS's summaries come out of vLLM's KV pool). The KV pool's size
in tokens is recorded per engine (``kv_pool_tokens``), so a ratio can be read against how many
requests fit at once. This is a scheduler-level number (batching, pool, preemption) beside
``vllm_tpot``'s per-step one.

Usage (on the GPU machine, vLLM staged)::

    python -m kvlocks_lab.bench.vllm_throughput --out DIR [--models llama3.1-8b glm4-9b-1m]
        [--contexts 65536 131072] [--concurrency 8 16] [--new-tokens 128] [--prefix connector]

Writes ``DIR/rows.jsonl`` (one record per model, backend, context, concurrency and pass) and
``DIR/summary.json`` (settings, commit, device, versions, and the LOCKS / FLASH_ATTN ``tok_s``
ratio per cell and pass).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvlocks_lab.bench import engine_process
from kvlocks_lab.bench.shape_bytes import window_layers
from kvlocks_lab.bench.vllm_tpot import CONFIGS, DEFAULT_MODELS, DENSE_BELOW, GPU_UTIL, PREFIXES, shape_config

BACKENDS = ("FLASH_ATTN", "LOCKS")
PASSES = ("cold", "warm")


def _metric(llm, name: str):
    """The sum of a counter of the engine's metrics (None where this vLLM has no metrics reader or
    no such counter)."""
    try:
        vals = [m.value for m in llm.get_metrics() if m.name == name]
    except Exception:  # noqa: BLE001 - a vLLM without get_metrics: the row says None
        return None
    return sum(vals) if vals else None


def _pool_tokens(llm):
    """Tokens the KV pool holds (blocks x block size), from the engine's cache config."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        return cache.num_gpu_blocks * cache.block_size
    except Exception:  # noqa: BLE001 - a vLLM that keeps it elsewhere: None
        return None


def pass_row(outs, wall: float, new: int) -> dict:
    """A pass's numbers from vLLM's request outputs (``o.metrics``: first/last token times, first
    token latency) and its wall time."""
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    rates = [(new - 1) / (o.metrics.last_token_ts - o.metrics.first_token_ts) for o in outs
             if o.metrics and o.metrics.last_token_ts > o.metrics.first_token_ts]
    firsts = [o.metrics.first_token_latency for o in outs if o.metrics]
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall if wall > 0 else None,
            "decode_tok_s_per_request": rates, "first_token_s_max": max(firsts) if firsts else None,
            "cached_tokens": [o.num_cached_tokens for o in outs]}


def _worker(spec: dict) -> list[dict]:
    import random

    from vllm import LLM, SamplingParams

    if spec["backend"] in DENSE_BELOW:
        from kvlocks.config import LocksConfig
        from kvlocks.integrations.vllm import enable

        enable(LocksConfig(budget=spec["budget"]), dense_below=DENSE_BELOW[spec["backend"]])
    new, cells = spec["new_tokens"], spec["cells"]  # [[context, [concurrency, ...]], ...]
    extra = {}
    if spec["prefix"] == "connector":
        from kvlocks_lab.bench import random_prefix

        extra["kv_transfer_config"] = random_prefix.kv_transfer_config(seed=spec.get("prefix_seed", 0))
    max_n = max(n for _, ns in cells for n in ns)
    t0 = time.time()
    llm = LLM(model=spec["model_dir"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=max(c for c, _ in cells) + new + 16, max_num_seqs=max_n,
              gpu_memory_utilization=spec.get("gpu_memory_utilization", GPU_UTIL), enable_prefix_caching=True,
              disable_log_stats=False, max_num_batched_tokens=16384, **extra)
    init_s, pool = time.time() - t0, _pool_tokens(llm)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False)
    warmup = [{"prompt_token_ids": [rng.randrange(spec["vocab"]) for _ in range(256)]}]
    llm.generate(warmup, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False),
                 use_tqdm=False)  # kernels compiled before the first timed pass
    rows = []
    for ctx, ns in sorted(cells):
        for n in sorted(ns):
            prompts = [{"prompt_token_ids": [rng.randrange(spec["vocab"]) for _ in range(ctx)]} for _ in range(n)]
            for name in PASSES:
                pre = _metric(llm, "vllm:num_preemptions")
                t = time.time()
                outs = llm.generate(prompts, params, use_tqdm=False)
                row = pass_row(outs, time.time() - t, new)
                post = _metric(llm, "vllm:num_preemptions")
                rows.append({"model": spec["model"], "backend": spec["backend"], "context": ctx, "concurrency": n,
                             "pass": name, "new_tokens": new, "prefix": spec["prefix"], "kv_pool_tokens": pool,
                             "budget": spec["budget"] if spec["backend"] in DENSE_BELOW else None, "init_s": init_s,
                             "preemptions": None if pre is None or post is None else post - pre, **row})
                print(json.dumps({k: rows[-1][k] for k in ("context", "concurrency", "pass", "tok_s")}), flush=True)
    return rows


def ratios(rows: list[dict]) -> dict:
    """``{"model|context|concurrency|pass": LOCKS tok/s / FLASH_ATTN tok/s}`` where both ran."""
    key = ("model", "context", "concurrency", "pass")
    base = {tuple(r[k] for k in key): r["tok_s"] for r in rows if r.get("backend") == "FLASH_ATTN" and r.get("tok_s")}
    return {"|".join(str(r[k]) for k in key): r["tok_s"] / base[tuple(r[k] for k in key)]
            for r in rows if r.get("backend") == "LOCKS" and r.get("tok_s") and tuple(r[k] for k in key) in base}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=DEFAULT_MODELS)
    ap.add_argument("--contexts", nargs="+", type=int, default=[65536, 131072])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[8, 16])
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--prefix", choices=PREFIXES, default="connector",
                    help="connector (default): random K/V written for each prompt's first context-1 tokens; "
                         "prefill: the model prefills every prompt (minutes per pass at 128K x 16)")
    ap.add_argument("--prefix-seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=540, help="seconds per engine process")
    args = engine_process.parse_args(ap, argv, _worker)
    if args.new_tokens < 2 or min(args.concurrency) < 1 or min(args.contexts) < 16:
        ap.error("--new-tokens must be >= 2, every --concurrency >= 1 and every --contexts >= 16")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        cfg = shape_config(model)
        assert not window_layers(cfg), model  # DEFAULT_MODELS are dense: the random-prefix connector writes them
        cells = [[c, sorted(args.concurrency)] for c in sorted(args.contexts)]
        for backend in args.backends:
            spec = {"model": model, "model_dir": str(CONFIGS / model), "backend": backend, "cells": cells,
                    "new_tokens": args.new_tokens, "budget": args.budget, "vocab": cfg["vocab_size"],
                    "prefix": args.prefix, "prefix_seed": args.prefix_seed}
            rows += engine_process.run_rows("kvlocks_lab.bench.vllm_throughput", spec, args.out, args.timeout,
                                            {"model": model, "backend": backend, "cells": cells})
    summary = engine_process.write_summary(args.out, args, rows, gpu_memory_utilization=GPU_UTIL,
                                           tok_s_locks_over_flash=ratios(rows))
    print(json.dumps(summary["tok_s_locks_over_flash"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
