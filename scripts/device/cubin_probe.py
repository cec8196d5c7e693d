"""Build-kernel variants compiled by another Triton version, timed on the H200 (issue 5).

The device image has Triton 3.6; kvlocks installs with the Triton that torch 2.13 pins (3.9). The
two lower the one-sided solver's row swaps differently (``scripts/analysis/build_sass.py``: 3.9 keeps
them in registers, 3.6 goes through shared memory), so the device's own Triton cannot time what
users run. This compiles the summary-build kernel ahead of time here, with whichever Triton is on
``PYTHONPATH`` (pointers and strides marked 16-divisible, as the Triton runtime specializes them), and
launches the cubins on the device through CuPy (in the device image), with no Triton at run time.

    # here, once per Triton version (3.6: PYTHONPATH=<a Triton 3.6 tree>:src)
    PYTHONPATH=src python scripts/device/cubin_probe.py --compile .device/cubins --variants lean,onesided
    # on the device (carry .device/cubins)
    python scripts/device/cubin_probe.py --time .device/cubins --out OUT/cubin.jsonl

``--time``: one layer of random bf16 keys at ``--tokens`` (llama3-8b: 8 KV heads, D=128), every page
built by each cubin (one page per program, one warp), median of ``--reps`` CUDA-event timings,
scaled to 32 layers; the quantized reconstruction against the first cubin's and against the keys
(the summaries' own error). JSON lines to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

DIVISIBLE = {"stride_kp", "stride_ks", "stride_kh", "n_items"}  # multiples of 16 at the probe's sizes


def compile_cubins(out: Path, variants: list[str]) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvlocks.summary import triton as bt

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
    from build_sass import SIGNATURE  # the build kernel's signature (scripts/analysis/build_sass.py)

    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "manifest.json"
    entries = json.loads(manifest.read_text()) if manifest.exists() else []
    names = list(SIGNATURE)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if SIGNATURE[n].startswith("*") or n in DIVISIBLE}
    for var in variants:
        rot, _, cap = var.partition(":")  # ROTATION[:MAXNREG]
        consts = dict(S=16, D=128, R=8, BP=1, INCREMENTAL=False, WRITE_EIG=False, PRECISION="tf32x3",
                      ROT=bt.ROTATIONS[rot], FINISH=bt.FINISHES["loop"], RELOAD_VOLATILE=bool(cap))
        options = {"num_warps": 1, **({"maxnreg": int(cap)} if cap else {})}
        src = ASTSource(fn=bt._build_kernel, signature=dict(SIGNATURE, **{k: "constexpr" for k in consts}),
                        constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        if k.metadata.global_scratch_size or getattr(k.metadata, "profile_scratch_size", 0):
            raise SystemExit(f"{rot}: the kernel wants scratch memory; this launcher passes none")
        entry = re.search(r"\.entry\s+(\w+)\(([^)]*)\)", k.asm["ptx"])
        params = re.findall(r"\.param\s+\.(\w+)", entry.group(2))
        file = f"triton{triton.__version__}_{rot}{'_maxnreg' + cap if cap else ''}.cubin"
        (out / file).write_bytes(k.asm["cubin"])
        entries = [e for e in entries if e["file"] != file] + [{
            "file": file, "rotation": rot, "maxnreg": int(cap) if cap else None, "triton": triton.__version__,
            "name": entry.group(1),
            "shared": k.metadata.shared, "num_warps": 1, "params": params}]
        print(file, k.metadata.shared, "B shared,", len(params), "params")
    manifest.write_text(json.dumps(entries, indent=1))


def time_cubins(folder: Path, tokens: int, reps: int, out: str) -> None:
    import cupy
    import numpy as np
    import torch

    from kvlocks.cache.layout import PagedSummaries
    from kvlocks.config import LocksConfig
    from kvlocks.summary import triton as bt

    dev = torch.device("cuda")
    cfg = LocksConfig()
    hkv, d, layers = 8, 128, 32
    pages = tokens // cfg.page_size
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(pages, cfg.page_size, hkv, d, generator=gen, device=dev).to(torch.bfloat16)
    ids = torch.arange(pages, dtype=torch.int32, device=dev)
    check = torch.arange(0, pages, max(1, pages // 2048), device=dev)
    kc = k[check].float().permute(2, 0, 1, 3)
    n_items = pages * hkv
    for name, value in (("n_items", n_items), *((f"stride {i}", k.stride(i)) for i in range(3))):
        if value % 16:  # compiled as 16-divisible (DIVISIBLE): anything else would be silently wrong
            raise SystemExit(f"--tokens {tokens}: {name} = {value} is not a multiple of 16, as the cubins assume")
    ref = None
    for e in json.loads((folder / "manifest.json").read_text()):
        fn = cupy.RawModule(path=str(folder / e["file"])).get_function(e["name"])
        store = PagedSummaries.empty(pages, hkv, d, cfg, device=dev)
        ptr = lambda t: np.uint64(t.data_ptr())  # noqa: E731
        args = [ptr(k), np.int32(k.stride(0)), np.int32(k.stride(1)), np.int32(k.stride(2)), ptr(ids),
                np.int32(n_items), np.int32(hkv), ptr(ids), np.int32(0), ptr(store.basis), ptr(store.basis_scale),
                ptr(store.coef), ptr(store.coef_scale), ptr(store.centroid), ptr(store.centroid_scale),
                ptr(store.coef_scale), np.int32(bt.SWEEPS), np.float32(bt.REL_FLOOR ** 2)]
        extra = len(e["params"]) - len(args)  # Triton's trailing scratch pointers (unused: size 0)
        if extra < 0:
            raise SystemExit(f"{e['file']}: {len(e['params'])} params, fewer than the signature's {len(args)}")
        args += [np.uint64(0)] * extra

        def launch():
            fn((n_items, 1, 1), (32 * e["num_warps"], 1, 1), tuple(args), shared_mem=e["shared"])

        launch()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            launch()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        s = store.gather(check)
        rec = s.centroid_float()[..., None, :] + s.coef_float() @ s.basis_float()
        ref = rec if ref is None else ref
        ms = statistics.median(times)
        row = {"file": e["file"], "rotation": e["rotation"], "maxnreg": e.get("maxnreg"), "triton": e["triton"],
               "shared": e["shared"],
               "tokens": tokens, "layer_ms": ms, "model_s": ms * layers / 1e3, "times_ms": times,
               "recon_diff_vs_first": float((rec - ref).norm() / kc.norm()),
               "recon_err_vs_keys": float((rec - kc).norm() / kc.norm())}
        print(json.dumps(row), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", type=Path, help="folder for the cubins and manifest.json")
    ap.add_argument("--variants", default="lean,onesided",
                    help="ROTATION[:MAXNREG],... (kvlocks.summary.triton.ROTATIONS; a register cap per thread)")
    ap.add_argument("--time", type=Path, help="folder written by --compile")
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="cubin_probe.jsonl")
    args = ap.parse_args()
    if args.compile:
        compile_cubins(args.compile, args.variants.split(","))
    if args.time:
        time_cubins(args.time, args.tokens, args.reps, args.out)


if __name__ == "__main__":
    main()
