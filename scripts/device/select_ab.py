"""Same-machine A/B of the decode plan's two selection paths, end to end (issue 6).

Runs ``kvlocks bench e2e`` (LOCKS only) once per mode (``MODES``): the combine pass + two-launch
selection, or the fused combine + selection (:mod:`kvlocks.selection.fused`), with or without the
early-stopping radix passes, the merge on registers and 5-bit digits, by setting
``kvlocks.dispatch.FUSED_MIN_PAGES``, ``selection.triton.EARLY_EXIT``, ``MERGE_IN_REGISTERS`` and
``DIGIT_BITS``, with the CUDA score kernel's static or balanced page split
(``scoring.cuda_mma.BALANCED``) and its 5- or 6-blocks-per-SM variant (``MIN_BLOCKS``), and with or
without the incremental-build launches on steps that fill no page (``engine.graph.SKIP_IDLE_BUILDS``),
with each layer's q/k/v projections as one product (``engine.step.FUSE_QKV``), and with the
radix passes over rebased keys (``selection.triton.REBASE_KEYS``), with the K/V writes inside the
compiled projection piece (``engine.step.KV_WRITE_IN_PIECE``), with the attention's split merge
done by each row's last split (``attention.triton.MERGE_IN_KERNEL``), all four (``prepared10``), and
with Inductor's max-autotune for the compiled pieces (``engine.step.COMPILE_MODE``).
Writes ``OUT/<mode>`` (the bench's summary files) and prints the TPOTs (median, mean).

    python scripts/device/select_ab.py --out OUT/select_ab --contexts 1048576,131072
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlocks_lab.bench.e2e import E2EBenchConfig, run_e2e_bench


# Each mode sets these module attributes (read when a decode plan is made or at each launch): the
# defaults, then the mode's overrides. Early stop: default since session 8; register merge and
# 5-bit digits since session 9; steps that fill no page without the incremental-build launches
# since session 10; fused q/k/v, rebased radix keys and the K/V writes in the projection piece
# since session 11 ("defaults11" = the defaults; "skip_idle_builds" = session 10's defaults;
# "fused_regs_bits5" = session 9's). Session 18: PDL for the attention kernels ("session18" = its
# defaults); session 19: PDL for the score kernel and the compiled pieces, then max-autotune at batch 1
# ("defaults19" = PDL everywhere in the default compile mode, as first timed; "defaults19b",
# "defaults11" and "max_autotune" = the defaults now; "max_autotune_all" at every batch;
# "coord_descent": Inductor's coordinate-descent tuning of the pieces' pointwise and reduction kernels).
SETTINGS = {"FUSED_MIN_PAGES": ("kvlocks.dispatch", 0), "EARLY_EXIT": ("kvlocks.selection.triton", True),
            "MERGE_IN_REGISTERS": ("kvlocks.selection.triton", True), "DIGIT_BITS": ("kvlocks.selection.triton", 5),
            "BALANCED": ("kvlocks.scoring.cuda_mma", False), "MIN_BLOCKS": ("kvlocks.scoring.cuda_mma", 1),
            "SKIP_IDLE_BUILDS": ("kvlocks.engine.graph", True), "FUSE_QKV": ("kvlocks.engine.step", True),
            "REBASE_KEYS": ("kvlocks.selection.triton", True),
            "KV_WRITE_IN_PIECE": ("kvlocks.engine.step", True),
            "COMPILE_MODE": ("kvlocks.engine.step", "max-autotune-no-cudagraphs"),
            "COMPILE_MODE_MAX_BATCH": ("kvlocks.engine.step", 1),
            "DYNAMIC_CACHE_ROWS": ("kvlocks.engine.step", True),
            "MERGE_IN_KERNEL": ("kvlocks.attention.triton", False), "ENABLED": ("kvlocks.pdl", True),
            "SCORE_PDL": ("kvlocks.scoring.cuda_mma", True), "INDUCTOR_PDL": ("kvlocks.engine.step", True),
            "coordinate_descent_tuning": ("torch._inductor.config", False)}
SESSION10 = {"FUSE_QKV": False, "REBASE_KEYS": False, "KV_WRITE_IN_PIECE": False}
OLD_SELECT = {**SESSION10, "MERGE_IN_REGISTERS": False, "DIGIT_BITS": 4}
MODES = {"unfused": {"FUSED_MIN_PAGES": 1 << 40}, "fused": OLD_SELECT, "fused_early": OLD_SELECT,
         "fused_noearly": {**OLD_SELECT, "EARLY_EXIT": False}, "fused_regs": {**SESSION10, "DIGIT_BITS": 4},
         "fused_bits5": {**SESSION10, "MERGE_IN_REGISTERS": False},
         "fused_regs_bits5": {**SESSION10, "SKIP_IDLE_BUILDS": False}, "balanced": {"BALANCED": True},
         "six": {"MIN_BLOCKS": 6}, "six_balanced": {"MIN_BLOCKS": 6, "BALANCED": True},
         "defaults11": {}, "skip_idle_builds": SESSION10, "fused_qkv": {**SESSION10, "FUSE_QKV": True},
         "rebase_keys": {**SESSION10, "REBASE_KEYS": True}, "kv_write": {**SESSION10, "KV_WRITE_IN_PIECE": True},
         "merge_in_kernel": {"MERGE_IN_KERNEL": True},
         "prepared10": {"MERGE_IN_KERNEL": True},
         "max_autotune": {}, "max_autotune_all": {"COMPILE_MODE_MAX_BATCH": 1 << 20},
         "default_compile": {"COMPILE_MODE": None},
         "static_cache_rows": {"DYNAMIC_CACHE_ROWS": False}, "pdl": {"ENABLED": True}, "no_pdl": {"ENABLED": False},
         "score_pdl": {"INDUCTOR_PDL": False}, "inductor_pdl": {},
         "session18": {"SCORE_PDL": False, "INDUCTOR_PDL": False, "COMPILE_MODE": None},
         "defaults19": {"COMPILE_MODE": None}, "defaults19b": {},
         "coord_descent": {"coordinate_descent_tuning": True}}


def apply(mode: str) -> None:
    """Set every attribute of SETTINGS to its default, then to ``mode``'s overrides; forget Dynamo's
    compiled graphs (a graph made under one mode, e.g. with dynamic cache rows, would serve the next)."""
    import importlib

    import torch._dynamo

    torch._dynamo.reset()

    for name, (module, default) in SETTINGS.items():
        setattr(importlib.import_module(module), name, MODES[mode].get(name, default))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm4-9b-1m")
    ap.add_argument("--contexts", default="1048576,131072")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batches", default="1", help="batch sizes, run at the first context")
    ap.add_argument("--methods", default="locks", help="comma-separated: locks, dense")
    ap.add_argument("--fused-chunk", type=int, default=0, help="pages per fused program above one program per row "
                    "(0: default_fused_chunk)")
    ap.add_argument("--fused-warps", type=int, default=0, help="warps per fused program where --fused-chunk applies "
                    "(0: default_warps)")
    ap.add_argument("--modes", default="unfused,fused", help="comma-separated, any of: " + ", ".join(MODES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ctx = tuple(int(c) for c in args.contexts.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    cfg = E2EBenchConfig(models=(args.model,), contexts=ctx, batches=batches, batch_context=ctx[0],
                         methods=tuple(args.methods.split(",")),
                         steps=args.steps, max_prefill=0)
    if args.fused_chunk:
        from kvlocks.selection import fused

        base = fused.default_fused_chunk
        fused.default_fused_chunk = lambda p: base(p) if p <= fused.SINGLE_MAX else args.fused_chunk
        if args.fused_warps:
            base_warps = fused.default_warps
            fused.default_warps = lambda c, n=2: args.fused_warps if c == args.fused_chunk else base_warps(c, n)
    for mode in args.modes.split(","):
        apply(mode)
        summary = run_e2e_bench(Path(args.out) / mode, cfg)
        for r in summary["rows"]:
            print(mode, r["method"], r["context"], r["batch"], round(r["tpot_ms"], 3), round(r["tpot_mean_ms"], 3), flush=True)


if __name__ == "__main__":
    main()
