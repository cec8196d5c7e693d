"""The task suite served through vLLM: the records ``kvlocks eval`` builds, prompted to a vLLM engine
(stock ``FLASH_ATTN`` / CPU attention, then the LOCKS backend at each budget), answered greedily and
scored the same way.

    python -m kvlocks_lab.eval.vllm_tasks --out DIR --model gemma3-270m --tasks passkey,niah_multikey \
        --lengths 8192,16384,32768 --samples 20 --budgets 512,2048 [--exact] [--device cuda|cpu]

Rows go to ``DIR/rows.jsonl`` in the eval's format, methods ``vllm_full`` (stock attention, no
budget) and ``vllm_locks`` (one engine per budget), so that ``scripts/analysis/paired_methods.py``
pairs them with the Hugging Face path's rows of the same records (``kvlocks eval`` with the same
model, tasks, lengths, samples and seed) once both files are concatenated. Each engine runs in its
own process; the LOCKS engines select on every decode row past the budget (``dense_below`` 0), so
what is measured is LOCKS and not the dense crossover. ``--exact`` adds a LOCKS engine whose budget
holds every prompt (rows attended over all their pages by kvlocks' kernels), compared token by
token with stock (``DIR/exact.json``: the records whose greedy tokens differ, where, and whether each is a
flip between near-tied tokens, from the top-2 log-probabilities both engines record).

The prompt differs from the Hugging Face path in one way: vLLM prefills the whole prompt (context
and question) densely, where ``kvlocks eval`` prefills the context and decodes the question's tokens
through the method. Scores are exact-match as in the suite; no KL (vLLM returns top-k
log-probabilities only). ``DIR/engines.json`` keeps each engine's settings, time and the plugin's
layer table lines from its log.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

LAYER_LINES = ("kvlocks: attention layers", "  LOCKS ", "  by design ", "  fallback ")


def build_records(model_dir: str, tasks, lengths, samples: int, seed: int):
    """``(records, stop tokens, tokenizer)``: the suite's records as ``kvlocks eval`` makes them and
    the stop tokens its runner uses."""
    from transformers import AutoTokenizer

    from kvlocks_lab.eval.tasks import generate

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    eos = {tok.eos_token_id}
    if "<|im_end|>" in tok.get_vocab():
        eos.add(tok.convert_tokens_to_ids("<|im_end|>"))
    records = [r for n in lengths for t in tasks for r in generate(t, tok, n, samples, seed=seed)]
    return records, eos, tok


def _worker(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    if spec["budget"] is not None:
        from kvlocks.config import LocksConfig
        from kvlocks.integrations.vllm import enable

        enable(LocksConfig(budget=spec["budget"]), dense_below=0)
    kw = {"gpu_memory_utilization": spec["gpu_memory_utilization"]} if spec["device"] == "cuda" else {"enforce_eager": True}
    t0 = time.time()
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              max_num_seqs=spec["max_num_seqs"], **kw)
    init_s = time.time() - t0
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, stop_token_ids=spec["eos"],
                             detokenize=False, logprobs=2) for n in spec["max_new"]]
    t1 = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    top = [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs or []] for o in outs]
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "top": top, "init_s": init_s,
            "gen_s": time.time() - t1}


def run_engine(spec: dict, out: Path, name: str, timeout: int, reuse: bool = False) -> dict:
    """One engine in its own process: its result with the plugin's layer table lines from its log,
    or an error with the log's tail. ``reuse``: an engine that already finished in ``out`` with the
    same spec is not run again."""
    from kvlocks_lab.bench import engine_process

    res, text = engine_process.run("kvlocks_lab.eval.vllm_tasks", spec, out, name, timeout, reuse=reuse)
    layers = [line.split("] ", 1)[-1] for line in text.splitlines() if any(k in line for k in LAYER_LINES)]
    if isinstance(res, engine_process.Failure):
        return {"error": res.error, "log_tail": res.log_tail, "layer_table": layers}
    return {**res, "layer_table": layers}


def exact_report(records, res: dict, ref: dict | None, budget: int, tol: float | None = None) -> dict:
    """The LOCKS engine whose budget holds every prompt against stock, record by record: each
    differing record with its first differing token and verdict (a ``tie`` flip when the two tokens
    are each other's runner-up within ``tol`` nats, default two units in the last place of bf16
    logits, else ``wrong``;
    :func:`kvlocks_lab.bench.serve_load.compare_tokens`)."""
    from kvlocks_lab.bench.serve_load import BF16_TIE_NATS, compare_tokens

    tol = BF16_TIE_NATS if tol is None else tol
    if ref is None:
        return {"budget": budget, "records": len(records), "error": "no stock engine to compare with"}
    differing = []
    for i, rec in enumerate(records):
        got_top, want_top = res.get("top", [None] * len(records))[i], ref.get("top", [None] * len(records))[i]
        c = compare_tokens(res["tokens"][i], ref["tokens"][i], got_top, want_top, tol)
        if c["verdict"] != "equal":
            differing.append({"task": rec.task, "length": rec.length, "index": rec.index, **c})
    return {"budget": budget, "records": len(records), "tie_tol": tol, "differing": len(differing),
            "tie_flips": sum(d["verdict"] == "tie" for d in differing),
            "wrong": sum(d["verdict"] == "wrong" for d in differing), "differences": differing}


def rows_of(records, tokens: list[list[int]], method: str, budget, tok, eos: set[int], ref: list[list[int]] | None,
            commit: str | None) -> list[dict]:
    from kvlocks_lab.eval.metrics import exact_agreement, prefix_agreement
    from kvlocks_lab.eval.tasks import score

    rows = []
    for i, (rec, toks) in enumerate(zip(records, tokens)):
        text = tok.decode([t for t in toks if t not in eos], skip_special_tokens=True)
        r = ref[i] if ref is not None else toks
        rows.append({"task": rec.task, "length": rec.length, "index": rec.index, "seed": rec.seed, "depth": rec.depth,
                     "method": method, "budget": budget, "prompt_tokens": len(rec.context_ids) + len(rec.suffix_ids),
                     **score(rec, text), "prediction": text, "references": list(rec.references), "tokens": toks,
                     "exact_agree": exact_agreement(r, toks), "agree16": prefix_agreement(r, toks, 16), "kl": None,
                     "commit": commit})
    return rows


def main(argv=None) -> int:
    from kvlocks_lab.commands import csv_of

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", default="gemma3-270m", help="a bundled name or a local Hugging Face directory")
    ap.add_argument("--tasks", type=csv_of(str), default=("passkey", "niah_single_noise", "niah_single_text",
                                                           "niah_multikey"), help="comma-separated, as kvlocks eval")
    ap.add_argument("--lengths", type=csv_of(int), default=(8192, 16384, 32768), help="comma-separated tokens")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", type=csv_of(int), default=(512, 2048), help="comma-separated tokens")
    ap.add_argument("--exact", action="store_true", help="also a LOCKS engine whose budget holds every prompt")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                    help="each engine's share of the GPU's memory (lower to share the GPU with another job)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per engine process")
    ap.add_argument("--resume", action="store_true",
                    help="keep the engines that already finished in --out with the same settings (a run cut off "
                         "by a time limit continues where it stopped)")
    from kvlocks_lab.bench import engine_process

    args = engine_process.parse_args(ap, argv, _worker)
    from kvlocks.models import resolve
    from kvlocks_lab.eval.report import git_commit
    from kvlocks_lab.eval.suite import task_names

    unknown = [t for t in args.tasks if t not in task_names() or t == "ppl_continuation"]
    if unknown:
        ap.error(f"--tasks {unknown}: allowed {[t for t in task_names() if t != 'ppl_continuation']}")
    if args.samples < 1:
        ap.error(f"--samples {args.samples}: must be >= 1")
    if any(b < 32 for b in args.budgets):
        ap.error(f"--budgets {args.budgets}: each must be >= 32 tokens (two 16-token pages)")
    if not 0 < args.gpu_memory_utilization <= 1:
        ap.error(f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1]")
    model_dir = str(resolve(args.model))
    records, eos, tok = build_records(model_dir, args.tasks, args.lengths, args.samples, args.seed)
    max_len = -(-max(len(r.context_ids) + len(r.suffix_ids) + r.max_new_tokens for r in records) // 16) * 16
    args.out.mkdir(parents=True, exist_ok=True)
    base = {"model_dir": model_dir, "device": args.device, "dtype": args.dtype, "max_model_len": max_len,
            "max_num_seqs": args.max_num_seqs, "eos": sorted(eos),
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "prompts": [list(r.context_ids) + list(r.suffix_ids) for r in records],
            "max_new": [r.max_new_tokens for r in records]}
    engines = [("vllm_full", None)] + [("vllm_locks", b) for b in args.budgets]
    if args.exact:
        engines.append(("vllm_locks_exact", max_len))
    commit, results, rows, ref = git_commit(), {}, [], None
    for method, budget in engines:
        name = method if budget is None else f"{method}_{budget}"
        res = run_engine({**base, "budget": budget}, args.out, name, args.timeout, reuse=args.resume)
        results[name] = {k: v for k, v in res.items() if k != "tokens"}
        print(json.dumps({"engine": name, **{k: results[name].get(k) for k in ("init_s", "gen_s", "error")}}),
              flush=True)
        if "tokens" not in res:
            continue
        if method == "vllm_full":
            ref = res
        if method == "vllm_locks_exact":
            (args.out / "exact.json").write_text(json.dumps(exact_report(records, res, ref, budget), indent=1))
            continue
        rows += rows_of(records, res["tokens"], method, budget, tok, eos, ref and ref["tokens"], commit)
    with open(args.out / "rows.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (args.out / "engines.json").write_text(json.dumps({"command": "python -m kvlocks_lab.eval.vllm_tasks " +
                                                       " ".join(argv if argv is not None else sys.argv[1:]),
                                                       "commit": commit, "max_model_len": max_len,
                                                       "engines": results}, indent=1))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
