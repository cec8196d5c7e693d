"""``kvlocks bench kernels|e2e --out DIR``: GPU benchmarks that write result files."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlocks_lab import require_extras


def _sizes(text: str) -> tuple[int, ...]:
    """``"16K,64K,1M"`` or ``"16384,65536"`` -> token counts (K = 1024, M = 1024 * 1024)."""
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20}.get(part[-1:], 1)
        num = part[:-1] if mult > 1 else part
        if not num.isdigit():
            raise ValueError(f"size {part!r}: expected an integer with an optional K or M suffix")
        out.append(int(num) * mult)
    return tuple(out)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r}: expected comma-separated integers") from None


def _names(text: str) -> tuple[str, ...]:
    """``"a, b"`` -> ``("a", "b")``."""
    return tuple(x.strip() for x in text.split(","))


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that write result files")
    p.add_argument("what", choices=("kernels", "e2e"), help="which benchmark")
    p.add_argument("--out", type=Path, required=True)
    k = p.add_argument_group("kernels options (defaults: the full kernel grid)")
    k.add_argument("--shapes", help="comma-separated: llama3-8b, glm4-9b-1m")
    e = p.add_argument_group("e2e options (defaults: the full end-to-end grid); --contexts and --batches "
                                  "also select the kernels grid")
    e.add_argument("--models", help="comma-separated: glm4-9b-1m, llama3.1-8b")
    e.add_argument("--contexts", help="batch-1 contexts, e.g. 16K,64K,128K,256K,512K,1M")
    e.add_argument("--batches", help="batches at --batch-context, e.g. 1,2,3,4")
    e.add_argument("--batch-context", help="context of the batch sweep, e.g. 256K")
    e.add_argument("--methods", help="comma-separated: dense, locks, locks_centroid (the centroids choose "
                   "max(8 (k - 2), 256) candidates for the exact re-rank)")
    e.add_argument("--budget", type=int, help="LOCKS tokens per layer and KV head (default 2048)")
    e.add_argument("--steps", type=int, help="timed CUDA-graph replays per row (default 48)")
    e.add_argument("--warmup", type=int, help="untimed replays per row (default 4)")
    e.add_argument("--max-prefill", help="real prefill (TTFT) up to this many tokens per case, random K/V "
                                          "above (default 128K; 0 = never)")
    e.add_argument("--ttft-repeats", type=int, help="real prefills per method and case, dense and LOCKS "
                                                     "alternating; TTFT is their median (default 3)")
    e.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="decode step's per-layer pieces around the attention (dense and LOCKS alike) through "
                        "torch.compile (default on: measured ~2 ms faster per step for both at 1M)")
    p.set_defaults(func=run)


def _e2e_config(args):
    from kvlocks_lab.bench.e2e import E2EBenchConfig

    kw = {}
    conv = {"models": _names, "contexts": _sizes, "batches": _ints,
            "batch_context": lambda t: _sizes(t)[0], "methods": _names,
            "budget": int, "steps": int, "warmup": int, "max_prefill": lambda t: _sizes(t)[0], "compile": bool,
            "ttft_repeats": int}
    for name, fn in conv.items():
        value = getattr(args, name, None)
        if value is not None:
            kw[name] = fn(value) if isinstance(value, str) else value
    return E2EBenchConfig(**kw)


def _kernels_config(args):
    from kvlocks_lab.bench.kernels import KernelBenchConfig

    kw = {}
    if args.shapes:
        kw["shapes"] = _names(args.shapes)
    if args.contexts:
        kw["contexts"] = _sizes(args.contexts)
    if args.batches:
        kw["batches"] = _ints(args.batches)
    return KernelBenchConfig(**kw)


def run(args) -> int:
    require_extras()
    import torch

    cfg = _kernels_config(args) if args.what == "kernels" else _e2e_config(args)  # bad options named first
    if not torch.cuda.is_available():
        raise ValueError(f"kvlocks bench {args.what} needs a CUDA GPU; none is visible")
    if args.what == "kernels":
        from kvlocks_lab.bench.kernels import run_kernels_bench

        run_kernels_bench(args.out, cfg)
    else:
        from kvlocks_lab.bench.e2e import run_e2e_bench

        summary = run_e2e_bench(args.out, cfg, progress=lambda m: print(m, flush=True))
        print(f"{len(summary['rows'])} rows, {len(summary['errors'])} errors/skips")
    print(f"wrote {args.out / 'summary.json'}")
    return 0
