"""The decode engine on the bundled model, on the GPU, against the CPU reference and the HF path.

Run on the GPU machine from the repository root with the ``model`` bundle staged
(``scripts/gpu/README.md``)::

    python3 scripts/gpu/engine_check.py --out $OUT/engine_check --compile

Checks, on the bundled model in fp32, at each prompt length (default about 2K and 8K tokens):

1. budget >= context: the CUDA-graph engine (Triton kernels) with ``locks`` and with ``dense``
   gives the greedy tokens of the CPU reference path (Hugging Face ``generate`` with a
   ``DynamicCache``, full attention, on the CPU);
2. budget 256: the CUDA-graph engine gives the greedy tokens of the Hugging Face ``LocksCache``
   path on the GPU (which runs the same kernels); and, on the CPU, the engine on its torch backend
   gives those of the ``LocksCache`` reference path (the same algorithm end to end: float64
   summaries, reference scoring, selection and attention; on the CPU because torch 2.11 + CUDA 13
   has a slow batched ``eigh``, pytorch#183806). The GPU engine against the CPU reference path at
   budget 256 is printed for information: the kernel build (float32 Jacobi) and the reference
   (float64 eigh) may round a summary differently, which can flip a near-tied page.

With ``--compile`` checks 1 and 2 on the GPU also run with the step's pieces compiled (as ``kvlocks
bench e2e`` runs them). Prints one PASS/FAIL line per check and an overall verdict; exit status 1
on FAIL.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kvlocks import LocksConfig  # noqa: E402
from kvlocks.engine import DecodeEngine, EngineConfig  # noqa: E402
from kvlocks.integrations.hf import LocksCache, cache_kwargs  # noqa: E402


def facts_prompt(tok, target_tokens: int) -> torch.Tensor:
    """A chat prompt of at most ``target_tokens`` tokens (within ~150): numbered facts, then a
    question about one of them. ``[1, T]`` int64."""
    lines, best = [], None
    while True:
        for _ in range(5):
            i = len(lines)
            lines.append(f"Fact {i}: the box labelled {i * 7919 % 10007} holds {i * 37 % 101} marbles.")
        q = len(lines) // 3
        ids = _chat(tok, "\n".join(lines) + f"\nHow many marbles does the box labelled {q * 7919 % 10007} hold?")
        if ids.shape[1] > target_tokens:
            if best is None:
                raise ValueError(f"--lengths: {target_tokens} tokens is too short for a prompt")
            return best
        best = ids


def _chat(tok, text):
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(chat, return_tensors="pt", add_special_tokens=False).input_ids


def hf_tokens(model, ids, n, cache=None):
    """Greedy tokens after the prompt from ``model.generate`` (stops at EOS)."""
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=model.config)
    ids = ids.to(model.device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         **cache_kwargs(model, cache))
    return out[0, ids.shape[1]:].cpu()


def engine_tokens(model, ids, n, *, method, budget, backend=None, graph=None, compile=False):
    cfg = EngineConfig(method=method, locks=LocksConfig(budget=budget), max_context=ids.shape[1] + n + 16,
                       backend=backend, cuda_graph=graph, compile=compile)
    eng = DecodeEngine(model, cfg)
    return eng.generate(ids.to(model.device), max_new_tokens=n)[0], eng.use_graph


def compare(name, got, ref, results, informational=False):
    n = ref.shape[0]  # HF stops at EOS; the engine does not
    ok = torch.equal(got[:n], ref)
    first = next((i for i in range(n) if got[i] != ref[i]), None)
    tag = "INFO" if informational else ("PASS" if ok else "FAIL")
    detail = "" if ok else f" (first difference at token {first}: {got[:n].tolist()} vs {ref.tolist()})"
    print(f"{tag} {name}: {n} tokens{detail}", flush=True)
    results.append({"check": name, "tag": tag, "tokens": n, "first_difference": first})


def run_checks(args) -> bool:
    from kvlocks.models import load

    model_cpu, tok = load("smollm2-135m", dtype=torch.float32, device="cpu")
    model, _ = load("smollm2-135m", dtype=torch.float32, device=args.device)
    results, n = [], args.new_tokens
    for target in args.lengths:
        ids = facts_prompt(tok, target)
        t = ids.shape[1]
        big = -(-(t + n + 16) // 16) * 16
        print(f"--- prompt of {t} tokens, {n} new tokens ---", flush=True)
        t0 = time.perf_counter()
        ref = hf_tokens(model_cpu, ids, n)
        print(f"    CPU reference (HF generate, DynamicCache) in {time.perf_counter() - t0:.1f} s: "
              f"{tok.decode(ref)!r}", flush=True)
        compiles = (False, True) if args.compile else (False,)
        for method in ("locks", "dense"):
            for comp in compiles:
                got, graphed = engine_tokens(model, ids, n, method=method, budget=big, compile=comp)
                compare(f"engine {method} (cuda graph={graphed}, compiled={comp}) budget {big} >= context "
                        f"== CPU reference [{t}]", got, ref, results)
        lc = LocksConfig(budget=256)
        hf_tri = hf_tokens(model, ids, n, LocksCache(model.config, method="locks", config=lc))
        for comp in compiles[::-1]:  # the eager-pieces engine last: its tokens are compared below
            got, graphed = engine_tokens(model, ids, n, method="locks", budget=256, compile=comp)
            compare(f"engine locks (cuda graph={graphed}, compiled={comp}) budget 256 == HF LocksCache on GPU "
                    f"(kernels) [{t}]", got, hf_tri, results)
        t0 = time.perf_counter()
        hf_ref = hf_tokens(model_cpu, ids, n, LocksCache(model_cpu.config, method="locks", config=lc))
        got_ref, _ = engine_tokens(model_cpu, ids, n, method="locks", budget=256)
        compare(f"engine locks (CPU, torch backend) budget 256 == HF LocksCache (CPU reference) [{t}] "
                f"({time.perf_counter() - t0:.0f} s)", got_ref, hf_ref, results)
        compare(f"engine locks (GPU kernels) vs HF LocksCache (CPU reference) [{t}]", got, hf_ref, results,
                informational=True)
    checked = [r for r in results if r["tag"] != "INFO"]
    ok = all(r["tag"] == "PASS" for r in checked)
    passed = sum(r["tag"] == "PASS" for r in checked)
    print(f"{'PASS' if ok else 'FAIL'}: {passed}/{len(checked)} engine checks passed", flush=True)
    summary = {"passed": passed, "checks": len(checked), "lengths": args.lengths, "new_tokens": args.new_tokens,
               "compile": args.compile, "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "results": results}
    (args.out / "engine_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("engine_check"), help="folder for engine_check.json")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8000], help="prompt tokens (<= 8K)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--compile", action="store_true", help="also check the engine with compiled pieces (as the "
                   "bench runs it: on a GPU at batch 1 in Inductor's max-autotune mode)")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": dry run of the script's logic
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL: no CUDA device visible", flush=True)
        return 1
    if max(args.lengths) + args.new_tokens > 8192:
        raise SystemExit("--lengths: the bundled model has 8192 positions (prompt + new tokens)")
    args.out.mkdir(parents=True, exist_ok=True)
    ok = run_checks(args)
    print(f"OVERALL {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
