"""Decode time per output token (TPOT) and time to first token (TTFT) in real CUDA vLLM: the LOCKS
backend against vLLM's own FLASH_ATTN backend, same script, same engine settings.

Models are random-weight (``load_format="dummy"``) from the config files in ``configs/``
(Llama-3.1-8B, GLM-4-9B-Chat-1M by default; the hybrid shapes Gemma-3-12B and gpt-oss-20b with
``--models``, their prefixes by prefill; no weights or tokenizer needed: prompts are token ids,
``skip_tokenizer_init``). Each (model, backend) runs in its own engine process, its
``max_model_len`` set by the longest context (or ``--max-model-len``) and its batch limit by the
largest batch (as a server is configured once for all requests; the LOCKS plans' grids are sized by
``max_model_len``); ``--kernels`` sets the LOCKS engines' ``KernelOptions``; for
every context, shortest first, and every batch size:

1. TTFT: ``batch`` fresh random prompts of ``context`` tokens, one output token each (prefill from
   scratch; the engine's own ``first_token_latency``, the slowest request of the batch);
2. TPOT: the same prompts again with ``new_tokens`` outputs: their prompts are prefix-cache hits,
   so the steps timed are pure decode steps of the whole batch (full CUDA graphs); TPOT is
   ``(last_token_ts - first_token_ts) / (new_tokens - 1)`` of each request, the mean over the batch.

How the prompt's prefix is made (``--prefix``, recorded in each row and in ``summary.json``):

- ``prefill`` (default): the model prefills the whole prompt (a 1M-token prefill of GLM-4-9B takes
  about 10 minutes per backend);
- ``connector``: a benchmark-only KV connector (:mod:`kvlocks_lab.bench.random_prefix`) reports
  each prompt's first ``context - 1`` tokens as externally computed and writes random K/V (fixed
  seed, page-structured keys) for them into vLLM's paged cache, for every layer, through the
  attention backend's own cache write (with LOCKS, the summaries of the written pages are built as
  for any connector load); only the last prompt token is computed. Both backends then decode from
  the same kind of prefix, in minutes at 512K and 1M tokens. TTFT then measures the fill plus one
  token, not a prefill; ``prefix_loaded_tokens`` / ``prefix_fill_s`` (per pass) say what was
  written and how long it took, ``external_prefix_cache_hits`` what the engine counted as loaded.

Usage (on the GPU machine, vLLM staged)::

    python -m kvlocks_lab.bench.vllm_tpot --out DIR [--models llama3.1-8b glm4-9b-1m]
        [--contexts 32768 131072 262144:1 max] [--batches 1 4] [--new-tokens 64] [--budget 2048]
        [--prefix {prefill,connector}] [--max-model-len N] [--kernels JSON]
    # decode at 512K and 1M tokens of GLM-4-9B-1M without a prefill (1M needs an H200's KV pool):
    python -m kvlocks_lab.bench.vllm_tpot --out DIR --models glm4-9b-1m --contexts 524288:1 1048576:1 \
        --prefix connector

``max`` is the longest context whose batch fits the KV pool (rounded down to 16K) and the model's
positions, capped by ``--max-context``; a context past the positions (Llama's 128K with the new
tokens; GLM's 1048576 becomes 1047552) is cut to fit them. With ``--prefix prefill`` a named
context above ``--max-context`` is refused (its prefill would outlast a GPU command); use
``--prefix connector`` for those. Writes ``DIR/rows.jsonl`` (one record per model, backend, context, batch; appended as
each engine finishes) and ``DIR/summary.json`` (settings, commit, device, versions, and the LOCKS /
FLASH_ATTN TPOT ratio per cell).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvlocks_lab.bench import engine_process
from kvlocks_lab.bench.shape_bytes import kv_bytes_per_request, kv_bytes_per_token, weight_bytes, window_layers

CONFIGS = Path(__file__).parent / "configs"
DEFAULT_MODELS = ("llama3.1-8b", "glm4-9b-1m")
# hybrid shapes: Gemma-3-12B (5 sliding-window layers of 1,024 tokens per global one, head_dim 256) and
# gpt-oss-20b (alternating 128-token windows, learned sinks, 32 experts in bf16: about 42 GB of weights)
MODELS = (*DEFAULT_MODELS, "gemma3-12b", "gpt-oss-20b")
BACKENDS = ("FLASH_ATTN", "LOCKS", "LOCKS_SPARSE")  # LOCKS_SPARSE: dense_below 0, every row over the budget selects
DENSE_BELOW = {"LOCKS": "auto", "LOCKS_SPARSE": 0}
PREFIXES = ("prefill", "connector")
GPU_UTIL = 0.85  # leaves room for the LOCKS summaries (10% of the KV pool at D = 128) and plans
ROUND = 16384


def shape_config(model: str) -> dict:
    return json.loads((CONFIGS / model / "config.json").read_text())


def longest_context(cfg: dict, batch: int, total_bytes: int, new_tokens: int) -> int:
    """The longest context whose ``batch`` requests fit the KV pool (a multiple of 16K) and the
    model's positions (a multiple of 1K)."""
    pool = GPU_UTIL * total_bytes - weight_bytes(cfg) - 6 * 2**30 - batch * kv_bytes_per_request(cfg)  # 6 GiB: activations
    by_pool = (int(pool / kv_bytes_per_token(cfg)) // batch - new_tokens - 16) // ROUND * ROUND
    by_positions = (cfg["max_position_embeddings"] - new_tokens - 16) // 1024 * 1024
    return min(by_pool, by_positions)


def parse_context(text: str, batches) -> tuple[str, list[int]]:
    """``"CTX"`` or ``"CTX:B,B"`` (``CTX`` a token count or ``max``) -> (CTX, its batch sizes; the
    ``--batches`` default when none are named)."""
    ctx, _, bs = text.partition(":")
    if ctx != "max" and not ctx.isdigit():
        raise ValueError(f"context {text!r}: a token count or 'max', optionally ':' and batch sizes (e.g. 262144:1)")
    try:
        sizes = [int(b) for b in bs.split(",")] if bs else list(batches)
    except ValueError:
        raise ValueError(f"context {text!r}: batch sizes after ':' must be integers, e.g. 262144:1,2") from None
    if any(b < 1 for b in sizes):
        raise ValueError(f"context {text!r}: every batch size must be >= 1")
    return ctx, sizes


def plan_cells(cfg: dict, contexts, batches, total_bytes: int, new_tokens: int, max_context: int) -> dict:
    """``{context: batch sizes}`` to run: ``"max"`` resolved per batch, contexts cut to the model's
    positions, cells whose batch does not fit the KV pool (by the estimate) left out. A context may
    name its own batch sizes (``"262144:1"``, :func:`parse_context`)."""
    positions = (cfg["max_position_embeddings"] - new_tokens - 16) // 1024 * 1024
    cells: dict = {}
    for text in contexts:
        c, sizes = parse_context(str(text), batches)
        for b in sizes:
            fit = longest_context(cfg, b, total_bytes, new_tokens)
            ctx = min(fit, max_context) if c == "max" else min(int(c), positions)
            if ctx <= fit + ROUND:
                cells.setdefault(ctx, set()).add(b)
    return cells


# ---------------------------------------------------------------- one engine (a subprocess)


def _worker(spec: dict) -> list[dict]:
    import random

    from vllm import LLM, SamplingParams

    if spec["backend"] in DENSE_BELOW:
        from kvlocks.config import LocksConfig
        from kvlocks.integrations.vllm import enable

        from kvlocks.config import KernelOptions

        kernels = KernelOptions.from_json(json.dumps(spec["kernels"])) if spec.get("kernels") else None
        config = LocksConfig(budget=spec["budget"], **(spec.get("locks") or {}))
        enable(config, dense_below=DENSE_BELOW[spec["backend"]], kernels=kernels)
    cells, new = spec["cells"], spec["new_tokens"]  # [[context, [batch, ...]], ...]
    max_len = max(max(c for c, _ in cells) + new + 16, spec.get("max_model_len") or 0)
    batches_all = sorted({b for _, bs in cells for b in bs})
    prefix = spec.get("prefix", "prefill")
    extra = {}
    if prefix == "connector":
        from kvlocks_lab.bench import random_prefix

        extra["kv_transfer_config"] = random_prefix.kv_transfer_config(seed=spec.get("prefix_seed", 0))
    t0 = time.time()
    llm = LLM(model=spec["model_dir"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=max_len, max_num_seqs=max(batches_all),
              gpu_memory_utilization=spec.get("gpu_memory_utilization", GPU_UTIL),
              enable_prefix_caching=True, disable_log_stats=False, max_num_batched_tokens=16384,
              compilation_config={"cudagraph_capture_sizes": sorted({1, 2, 4, *batches_all})}, **extra)
    init_s = time.time() - t0
    rng = random.Random(0)
    vocab = spec["vocab"]

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    llm.generate([{"prompt_token_ids": [rng.randrange(vocab) for _ in range(256)]}], params(8), use_tqdm=False)
    rows = []
    for ctx, batches in sorted(cells):
        for b in sorted(batches):
            prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(ctx)]} for _ in range(b)]
            before = _prefix_counters(llm, prefix, spec["backend"])
            t1 = time.time()
            first = llm.generate(prompts, params(1), use_tqdm=False)
            ttft_wall = time.time() - t1
            mid = _prefix_counters(llm, prefix, spec["backend"])
            t2 = time.time()
            outs = llm.generate(prompts, params(new), use_tqdm=False)
            decode_wall = time.time() - t2
            after = _prefix_counters(llm, prefix, spec["backend"])
            tpots = [(o.metrics.last_token_ts - o.metrics.first_token_ts) / (new - 1) for o in outs if o.metrics]
            ttfts = [o.metrics.first_token_latency for o in first if o.metrics]
            rows.append({"model": spec["model"], "backend": spec["backend"], "context": ctx, "batch": b,
                         "new_tokens": new, "budget": spec["budget"] if spec["backend"] in DENSE_BELOW else None,
                         "dense_below": DENSE_BELOW.get(spec["backend"]), "kernels": spec.get("kernels"),
                         "locks": spec.get("locks") if spec["backend"] in DENSE_BELOW else None,
                         "max_model_len": max_len, "tpot_ms": 1e3 * sum(tpots) / len(tpots) if tpots else None,
                         "tpot_ms_per_request": [1e3 * t for t in tpots],
                         "ttft_s": max(ttfts) if ttfts else None, "ttft_wall_s": ttft_wall,
                         "decode_wall_s": decode_wall, "cached_tokens": [o.num_cached_tokens for o in outs],
                         "first_cached_tokens": [o.num_cached_tokens for o in first], "init_s": init_s,
                         "prefix": prefix, **_prefix_deltas(before, mid, after)})
            if spec.get("profile_steps"):
                rows[-1]["profile"] = _profile_cell(llm, prompts, params, spec["profile_steps"], spec["backend"])
            print(json.dumps({k: rows[-1][k] for k in ("context", "batch", "tpot_ms", "ttft_s")}), flush=True)
    return rows


def _prefix_counters(llm, prefix: str, backend: str) -> dict:
    """What made the prompts' prefixes so far: the random-prefix connector's counters (loads, tokens
    written, seconds), the engine's ``vllm:external_prefix_cache_hits`` (None where this vLLM has no
    such metric) and, with LOCKS on CUDA, the summary pages built eagerly (a connector's load, or
    before a step; ``debug_counters()["eager_builds"]``)."""
    out = {}
    if prefix == "connector":
        from kvlocks_lab.bench.random_prefix import STATS

        out.update(STATS)
    try:
        hits = [m.value for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits"]
        out["external_prefix_cache_hits"] = sum(hits) if hits else None
    except Exception:  # noqa: BLE001 - a vLLM without the metrics reader: the row says None
        out["external_prefix_cache_hits"] = None
    import torch

    if backend in DENSE_BELOW and torch.cuda.is_available():
        try:
            from kvlocks.integrations.vllm.cuda.backend import debug_counters

            out["locks_pages_built"] = debug_counters()["eager_builds"]
        except Exception:  # noqa: BLE001 - not the LOCKS backend (or no CUDA build): no count
            pass
    return out


def _prefix_deltas(before: dict, mid: dict, after: dict) -> dict:
    """Per pass (``[ttft pass, tpot pass]``): the counters' increase."""
    names = {"loaded_tokens": "prefix_loaded_tokens", "fill_s": "prefix_fill_s",
             "external_prefix_cache_hits": "external_prefix_cache_hits", "locks_pages_built": "locks_pages_built"}
    out = {}
    for key, name in names.items():
        if all(d.get(key) is not None for d in (before, mid, after)):
            out[name] = [mid[key] - before[key], after[key] - mid[key]]
        elif key in before:
            out[name] = None
    return out


def _profile_cell(llm, prompts, params, steps: int, backend: str) -> dict:
    """GPU time per kernel of one decode step of the batch, under ``torch.profiler`` (the engine runs
    in this process): the same prompts (prefix-cache hits) decoded for 1 and for ``steps + 1``
    tokens, the difference divided by ``steps`` (:func:`~kvlocks_lab.bench.kernel_classes.per_step`),
    so the prompt's remaining tokens and the first token cancel out. ``wall_us_per_step`` is the
    same difference of wall times (profiler overhead included); with LOCKS, ``eager_steps_per_step``
    counts layer forwards of decode rows outside a CUDA graph (0: every step replayed vLLM's full
    graph)."""
    import torch

    from kvlocks_lab.bench.kernel_classes import kernel_times, per_step, summarize

    def eager_steps():
        if backend not in DENSE_BELOW:
            return 0
        from kvlocks.integrations.vllm.cuda.backend import debug_counters

        return debug_counters()["eager_steps"]

    runs = {}
    for n in (1, steps + 1):
        torch.cuda.synchronize()
        before = eager_steps()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            llm.generate(prompts, params(n), use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        runs[n] = (kernel_times(prof), wall, eager_steps() - before)
    out = summarize(per_step(runs[steps + 1][0], runs[1][0], steps))
    out["steps"] = steps
    out["wall_us_per_step"] = 1e6 * (runs[steps + 1][1] - runs[1][1]) / steps
    out["eager_steps_per_step"] = (runs[steps + 1][2] - runs[1][2]) / steps
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=MODELS)
    ap.add_argument("--contexts", nargs="+", default=["32768", "131072", "max"],
                    help="token counts or 'max', each optionally with its own batch sizes: 262144:1 (default: --batches)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--max-context", type=int, default=524288,
                    help="cap of 'max', and with --prefix prefill of any named context (a 1M-token prefill of a "
                         "9B model takes longer than one GPU run's time limit)")
    ap.add_argument("--prefix", choices=PREFIXES, default="prefill",
                    help="prefill: the model prefills each prompt; connector: a KV connector writes random K/V "
                         "for the first context-1 tokens (kvlocks_lab.bench.random_prefix), only the last is computed")
    ap.add_argument("--prefix-seed", type=int, default=0, help="seed of the connector's random K/V")
    ap.add_argument("--timeout", type=int, default=540, help="seconds per engine process (all of one model's contexts)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the engines' max_model_len, at least the longest context's (which is the default): the "
                         "LOCKS plans are as wide as its block table, e.g. 32K requests in a 1M engine")
    ap.add_argument("--kernels", type=json.loads, default=None,
                    help='KernelOptions fields for the LOCKS engines\' plans as JSON, e.g. \'{"short_row_pages": 5120}\'')
    ap.add_argument("--locks", type=json.loads, default=None,
                    help='LocksConfig fields besides the budget for the LOCKS engines as JSON, e.g. the exact re-rank '
                         '\'{"rerank": 4}\' or the two-tier mode \'{"rerank": 16, "rerank_min": 256, '
                         '"rerank_scores": "centroid"}\' (default: the default selection for the budget)')
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after each cell's TPOT, GPU time per kernel class of one decode step, from this many "
                         "steps under torch.profiler (0: no profile)")
    args = engine_process.parse_args(ap, argv, _worker)
    if args.kernels is not None:
        from kvlocks.config import KernelOptions

        try:
            KernelOptions.from_json(json.dumps(args.kernels))
        except (TypeError, ValueError) as exc:
            ap.error(f"--kernels: {exc}")
    if args.locks is not None:
        from kvlocks.config import LocksConfig

        if not isinstance(args.locks, dict) or "budget" in args.locks:
            ap.error("--locks: a JSON object of LocksConfig fields other than budget (--budget sets it)")
        try:
            LocksConfig(budget=args.budget, **args.locks)
        except (TypeError, ValueError) as exc:
            ap.error(f"--locks: {exc}")
    if args.new_tokens < 2 or any(b < 1 for b in args.batches):
        ap.error("--new-tokens must be >= 2 and every batch >= 1")
    for c in args.contexts:
        try:
            parse_context(c, args.batches)
        except ValueError as exc:
            ap.error(f"--contexts: {exc}")
    too_long = [c for c in args.contexts if c.partition(":")[0].isdigit() and
                int(c.partition(":")[0]) > args.max_context]
    hybrid = [m for m in args.models if window_layers(shape_config(m))]
    if hybrid and args.prefix == "connector":
        ap.error(f"--prefix connector: {hybrid} have sliding-window layers, whose blocks vLLM's hybrid KV cache "
                 f"manager keeps per layer group; the random-prefix connector writes dense models only "
                 f"({', '.join(DEFAULT_MODELS)}); use --prefix prefill")
    if too_long and args.prefix == "prefill":
        ap.error(f"--contexts {too_long}: above --max-context {args.max_context}, too long to prefill in one GPU "
                 "command; use --prefix connector (or raise --max-context)")
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        cfg = shape_config(model)
        cells = plan_cells(cfg, args.contexts, args.batches, total, args.new_tokens, args.max_context)
        positions = (cfg["max_position_embeddings"] - args.new_tokens - 16) // 1024 * 1024  # as plan_cells
        named = {min(int(c.partition(":")[0]), positions) for c in args.contexts if c.partition(":")[0].isdigit()}
        left_out = sorted(named - set(cells))
        if left_out:
            print(f"{model}: contexts {left_out} left out: their batches do not fit the KV pool "
                  f"(longest at batch 1: {longest_context(cfg, 1, total, args.new_tokens)})", flush=True)
        for backend in args.backends:
            spec = {"model": model, "model_dir": str(CONFIGS / model), "backend": backend,
                    "cells": [[ctx, sorted(b)] for ctx, b in sorted(cells.items())], "new_tokens": args.new_tokens,
                    "budget": args.budget, "vocab": cfg["vocab_size"], "profile_steps": args.profile_steps,
                    "prefix": args.prefix, "prefix_seed": args.prefix_seed, "max_model_len": args.max_model_len,
                    "kernels": args.kernels if backend in DENSE_BELOW else None,
                    "locks": args.locks if backend in DENSE_BELOW else None}
            got = engine_process.run_rows("kvlocks_lab.bench.vllm_tpot", spec, args.out, args.timeout,
                                          {k: spec[k] for k in ("model", "backend", "cells", "prefix")})
            rows += got
            print(json.dumps([{k: r.get(k) for k in ("model", "backend", "context", "batch", "tpot_ms", "ttft_s",
                                                      "error")} for r in got]), flush=True)
    ratios, sparse_ratios = {}, {}
    for r in rows:
        if r.get("backend") in DENSE_BELOW and r.get("tpot_ms"):
            base = [x for x in rows if x.get("backend") == "FLASH_ATTN" and x.get("tpot_ms") and
                    (x["model"], x["context"], x["batch"]) == (r["model"], r["context"], r["batch"])]
            if base:
                into = ratios if r["backend"] == "LOCKS" else sparse_ratios
                into[f"{r['model']}|{r['context']}|{r['batch']}"] = base[0]["tpot_ms"] / r["tpot_ms"]
    summary = engine_process.write_summary(args.out, args, rows, gpu_memory_utilization=GPU_UTIL, prefix=args.prefix,
                                           speedup_tpot_flash_over_locks=ratios,
                                           speedup_tpot_flash_over_locks_sparse=sparse_ratios)
    print(json.dumps(summary["speedup_tpot_flash_over_locks"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
