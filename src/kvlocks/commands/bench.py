"""``kvlocks bench kernels --out DIR``: the GPU kernel benchmark (CUDA only)."""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that write result files")
    p.add_argument("what", choices=("kernels",), help="which benchmark")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    if not torch.cuda.is_available():
        raise ValueError("kvlocks bench kernels needs a CUDA GPU; none is visible")
    from kvlocks.bench.kernels import run_kernels_bench

    run_kernels_bench(args.out)
    print(f"wrote {args.out / 'summary.json'}")
    return 0
