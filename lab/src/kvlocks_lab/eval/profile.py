"""Where a decode step of ``kvlocks eval`` spends its time, per method (CPU or CUDA).

``python -m kvlocks_lab.eval.profile --device cuda --dtype bfloat16 --length 4096 --out prof.json``

One record is prefilled once; every method decodes ``steps`` tokens from a fork of that cache
through the same :func:`kvlocks.integrations.hf.decode.step` the runner uses. Per method: wall time per
step (after warm-up, synchronised on CUDA), host synchronisations per step (CUDA only, counted
with ``torch.cuda.set_sync_debug_mode``), and the top operators by self CPU time (the cost of
the Python + launch path, which dominates a 135M model at batch 1) from ``torch.profiler``.
Writes one JSON file; prints a short table.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

from kvlocks.config import LocksConfig, method_config
from kvlocks.integrations.hf.decode import prefill, step
from kvlocks.integrations.hf import LocksCache


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _count_syncs(run, device) -> int | None:
    """Host synchronisations ``run()`` makes (CUDA only; None on the CPU)."""
    if torch.device(device).type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def _top_ops(run, n: int, steps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]
    return [{"op": e.key, "self_cpu_ms_per_step": e.self_cpu_time_total / 1000 / steps,
             "calls_per_step": e.count / steps} for e in rows]


@torch.inference_mode()
def profile_decode(model, tok, *, length: int = 4096, methods=("full", "locks", "oracle", "quest"),
                   budget: int = 256, steps: int = 32, warmup: int = 4, top: int = 12) -> list[dict]:
    """One row per method: ``ms_per_step``, ``syncs_per_step``, ``top_ops`` (see module doc)."""
    from kvlocks_lab.eval.tasks import generate

    record = generate("passkey", tok, length, 1)[0]
    device = model.device
    config = LocksConfig(budget=budget)
    shared = LocksCache(model.config, method="locks", config=config)
    prefill(model, shared, torch.tensor([record.context_ids], device=device))
    feed = (record.context_ids[-(warmup + 3 * steps):] * 4)[: warmup + 3 * steps]
    rows = []
    for method in methods:
        cache = shared.fork(method=method, config=method_config(method, config) if isinstance(method, str) else config)
        for t in feed[:warmup]:
            step(model, cache, t)
        chunks = [feed[warmup + i * steps: warmup + (i + 1) * steps] for i in range(3)]
        run = lambda ids: [step(model, cache, t) for t in ids]
        _sync(device)
        t0 = time.perf_counter()
        run(chunks[0])
        _sync(device)
        ms = (time.perf_counter() - t0) * 1000 / steps
        syncs = _count_syncs(lambda: run(chunks[1]), device)
        ops = _top_ops(lambda: run(chunks[2]), top, steps)
        rows.append({"method": method, "budget": None if method == "full" else budget, "length": length,
                     "context_tokens": cache.get_seq_length(), "ms_per_step": ms,
                     "syncs_per_step": None if syncs is None else syncs / steps, "top_ops": ops})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvlocks_lab.eval.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--methods", default="full,locks,oracle,quest")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out", type=Path, help="JSON file for the rows")
    args = p.parse_args(argv)
    from kvlocks.commands.common import DTYPES
    from kvlocks.models import load

    model, tok = load(args.model, dtype=DTYPES[args.dtype], device=args.device)
    rows = profile_decode(model, tok, length=args.length, methods=tuple(args.methods.split(",")),
                          budget=args.budget, steps=args.steps)
    for r in rows:
        syncs = "—" if r["syncs_per_step"] is None else f"{r['syncs_per_step']:.1f}"
        head = ", ".join(f"{o['op']} {o['self_cpu_ms_per_step']:.1f}" for o in r["top_ops"][:4])
        print(f"{r['method']:>8} @{r['budget']}: {r['ms_per_step']:7.1f} ms/step, {syncs} syncs/step; top ops (ms): {head}")
    if args.out:
        args.out.write_text(json.dumps({"device": str(model.device), "dtype": args.dtype, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
