"""Where a whole-model decode step's time goes: GPU time per kernel class, dense vs LOCKS.

On a random-weight model at a real shape (``kvlocks.engine.models.SHAPES``), a static paged cache
with random K/V at ``--context`` tokens, summaries built: the step replayed as one CUDA graph
(TPOT, as ``kvlocks bench e2e`` times it), then the same step run eagerly under
``torch.profiler`` for ``--steps`` steps. Kernels are classed by name (weights GEMV/GEMM,
LOCKS score / select / attend / build, dense attention, everything else = elementwise, norms,
RoPE, copies), their GPU time summed per step, and each class's bytes where known (weights;
attention: the bytes of ``bench e2e``'s accounting), so each class's share of the step and its
bandwidth can be read off. The difference between the graph's TPOT and the summed kernel time
is time with no kernel running (launch gaps inside the graph, dependencies).

    python3 scripts/gpu/probes/step_profile.py --model glm4-9b-1m --context 262144 --compile --out OUT/profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

from kvlocks_lab.bench.e2e import _time_steps, copy_bandwidth, step_bytes
from kvlocks_lab.bench.kernel_classes import classify
from kvlocks.config import LocksConfig
from kvlocks.engine.cache import StaticPagedCache
from kvlocks.engine.graph import StepRunner
from kvlocks.engine.models import model_config, random_model
from kvlocks.engine.parts import model_parts
from kvlocks.engine.step import DecodeStep


def profile_method(parts, cache, method, steps, context, bw_gbps, compile=False):
    cache.set_length(context)
    step = DecodeStep(parts, cache, method=method, backend="triton", compile=compile)
    runner = StepRunner(step, use_graph=True)
    tpot = statistics.median(_time_steps(runner, cache.k.device, 32, 4))
    cache.set_length(context)
    eager = StepRunner(step, use_graph=False)
    for _ in range(2):
        eager()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eager()
        torch.cuda.synchronize()
    per_cls, per_kernel = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        per_cls[classify(ev.name)] += us / steps
        k = per_kernel[ev.name[:120]]
        k[0] += us / steps
        k[1] += 1
    nbytes = step_bytes(parts, cache, method, context)
    total = sum(per_cls.values())
    top = sorted(((n, t, c // steps) for n, (t, c) in per_kernel.items()), key=lambda x: -x[1])[:25]
    row = {
        "method": method, "compiled": compile, "context": context, "tpot_ms": tpot, "kernel_sum_ms": total / 1e3,
        "idle_ms": tpot - total / 1e3, "classes_ms": {k: v / 1e3 for k, v in sorted(per_cls.items())},
        "bytes": nbytes, "copy_gbps": bw_gbps,
        "weights_pct_copy": (100 * nbytes["weight_bytes"] / (per_cls["weights_gemm"] * 1e-6) / 1e9 / bw_gbps
                             if per_cls["weights_gemm"] else None),
        "top_kernels": [{"name": n, "us_per_step": t, "launches_per_step": c} for n, t, c in top],
    }
    print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="glm4-9b-1m")
    ap.add_argument("--context", type=int, default=262144)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--methods", default="dense,locks")
    ap.add_argument("--compile", action="store_true", help="the step's per-layer pieces through torch.compile")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    model = random_model(model_config(args.model, max_positions=args.context + 4096), device=dev)
    parts = model_parts(model)
    cfg = LocksConfig(budget=2048)
    cache = StaticPagedCache(layers=parts.num_layers, batch=1, num_kv_heads=parts.num_kv_heads,
                             head_dim=parts.head_dim, max_context=args.context + 256, config=cfg, dtype=parts.dtype,
                             device=dev)
    cache.random_fill(args.context, generator=torch.Generator(device=dev).manual_seed(0))
    cache.build(backend="triton")
    rows = [profile_method(parts, cache, m, args.steps, args.context, bw, args.compile) for m in args.methods.split(",")]
    out = {"model": args.model, "context": args.context, "device": torch.cuda.get_device_name(dev),
           "torch": torch.__version__, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
