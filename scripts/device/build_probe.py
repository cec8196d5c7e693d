"""Summary-build probe (issue 5): Jacobi variants of the build kernel, timed on one layer at 1M.

For each shape (``kvlocks_lab.bench.kernels.SHAPES``) a layer's random bf16 keys at ``--tokens``
(every page full), then per rotation variant of :mod:`kvlocks.summary.triton` (``ROTATIONS``:
``gathers`` = tile gathers and four masked reductions per Jacobi step, ``lean`` = the diagonal
tracked in closed form, one reduction, ``dots`` = rotations as tf32x3 batched dots) and launch
(items per program, warps; optionally a fourth field, the Jacobi sweeps, default
``SWEEPS``, a fifth, how basis and coefficients are formed, a key of ``FINISHES``, default
``FINISH``, and a sixth, a register cap per thread (``maxnreg``); items ``auto`` = the autotuned
launch, ``autocaps`` = the same with the capped launches (``REGISTER_CAPS``), whose pick is recorded): the build of every page, median of ``--reps`` runs with CUDA events,
scaled to the whole model (layers of the shape), and the largest difference of the quantized
reconstruction against the first variant relative to the keys' norm, and the reconstruction's own error
against the keys (what the tolerance may cost). JSON lines to ``--out``.

    python scripts/device/build_probe.py --out OUT/build_probe.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvlocks_lab.bench.kernels import SHAPES
from kvlocks.cache.layout import PagedSummaries
from kvlocks.config import LocksConfig
from kvlocks.summary import triton as build_tri

LAYERS = {"llama3-8b": 32, "glm4-9b-1m": 40}


def _recon(store: PagedSummaries, ids: torch.Tensor) -> torch.Tensor:
    s = store.gather(ids)
    return s.centroid_float()[..., None, :] + s.coef_float() @ s.basis_float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama3-8b,glm4-9b-1m")
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--variants", default="gathers:4:4,lean:4:4,lean:8:8,lean:2:2,dots:4:4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = LocksConfig()
    for shape in args.shapes.split(","):
        hkv, _, d, _ = SHAPES[shape]
        pages = args.tokens // cfg.page_size
        gen = torch.Generator(device=dev).manual_seed(0)
        k = torch.randn(pages, cfg.page_size, hkv, d, generator=gen, device=dev).to(torch.bfloat16)
        ids = torch.arange(pages, dtype=torch.int32, device=dev)
        check = torch.arange(0, pages, max(1, pages // 2048), device=dev)
        ref = None
        for var in args.variants.split(","):
            rot, bp, nw, *rest = var.split(":")
            launch = None if bp.startswith("auto") else {"BP": int(bp), "num_warps": int(nw)}
            if launch is None:
                build_tri.REGISTER_CAPS = bp == "autocaps"
            if launch is not None and len(rest) > 2 and rest[2]:
                launch["maxnreg"] = int(rest[2])
            sweeps = int(rest[0]) if rest and rest[0] else build_tri.SWEEPS
            finish = rest[1] if len(rest) > 1 and rest[1] else build_tri.FINISH
            store = PagedSummaries.empty(pages, hkv, d, cfg, device=dev)
            t0 = time.time()
            build_tri.build_pages(k, store, ids, rotation=rot, launch=launch, sweeps=sweeps, finish=finish)
            torch.cuda.synchronize()
            compile_s = time.time() - t0
            times = []
            for _ in range(args.reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                build_tri.build_pages(k, store, ids, rotation=rot, launch=launch, sweeps=sweeps, finish=finish)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            rec = _recon(store, check)
            if ref is None:
                ref = rec
            kc = k[check].float().permute(2, 0, 1, 3)  # [Hkv, P, S, D] like the gathered summaries
            diff = float((rec - ref).norm() / kc.norm())
            own = float((rec - kc).norm() / kc.norm())
            ms = statistics.median(times)
            tuner = build_tri._build_tuned_caps if build_tri.REGISTER_CAPS else build_tri._build_tuned
            picked = launch or {"auto": str(getattr(tuner, "best_config", None))}
            row = {"shape": shape, "tokens": args.tokens, "rotation": rot, **picked, "sweeps": sweeps, "finish": finish,
                   "layer_ms": ms,
                   "model_s": ms * LAYERS[shape] / 1e3, "items_per_s": pages * hkv / (ms * 1e-3),
                   "recon_diff_vs_first": diff, "recon_err_vs_keys": own,
                   "compile_s": compile_s}
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        del k


if __name__ == "__main__":
    main()
