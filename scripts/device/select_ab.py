"""Same-machine A/B of the decode plan's two selection paths, end to end (issue 6).

Runs ``kvlocks bench e2e`` (LOCKS only) once per mode (``MODES``): the combine pass + two-launch
selection, or the fused combine + selection (:mod:`kvlocks.selection.fused`), with or without the
early-stopping radix passes, the merge on registers and 5-bit digits, by setting
``kvlocks.dispatch.FUSED_MIN_PAGES``, ``selection.triton.EARLY_EXIT``, ``MERGE_IN_REGISTERS`` and
``DIGIT_BITS``, and with the CUDA score kernel's static or balanced page split
(``scoring.cuda_mma.BALANCED``) and its 5- or 6-blocks-per-SM variant (``MIN_BLOCKS``).
Writes ``OUT/<mode>`` (the bench's summary files) and prints the TPOTs.

    python scripts/device/select_ab.py --out OUT/select_ab --contexts 1048576,131072
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlocks import dispatch
from kvlocks.bench.e2e import E2EBenchConfig, run_e2e_bench


# mode: (FUSED_MIN_PAGES, EARLY_EXIT, MERGE_IN_REGISTERS, DIGIT_BITS, cuda_mma.BALANCED, cuda_mma.MIN_BLOCKS);
# the early stop is the default since session 8, register merge and 5-bit digits since session 9
# ("fused_regs_bits5")
MODES = {"unfused": (1 << 40, True, True, 5, False, 1), "fused": (0, True, False, 4, False, 1),
         "fused_early": (0, True, False, 4, False, 1), "fused_noearly": (0, False, False, 4, False, 1),
         "fused_regs": (0, True, True, 4, False, 1), "fused_bits5": (0, True, False, 5, False, 1),
         "fused_regs_bits5": (0, True, True, 5, False, 1), "balanced": (0, True, True, 5, True, 1),
         "six": (0, True, True, 5, False, 6), "six_balanced": (0, True, True, 5, True, 6)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm4-9b-1m")
    ap.add_argument("--contexts", default="1048576,131072")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--fused-chunk", type=int, default=0, help="pages per fused program above one program per row "
                    "(0: default_fused_chunk)")
    ap.add_argument("--modes", default="unfused,fused", help="comma-separated, any of: " + ", ".join(MODES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ctx = tuple(int(c) for c in args.contexts.split(","))
    cfg = E2EBenchConfig(models=(args.model,), contexts=ctx, batches=(1,), batch_context=ctx[0], methods=("locks",),
                         steps=args.steps, max_prefill=0)
    if args.fused_chunk:
        from kvlocks.selection import fused

        base = fused.default_fused_chunk
        fused.default_fused_chunk = lambda p: base(p) if p <= fused.SINGLE_MAX else args.fused_chunk
    from kvlocks.scoring import cuda_mma
    from kvlocks.selection import triton as sel_triton

    for mode in args.modes.split(","):
        # read when each decode plan is made / at each launch
        (dispatch.FUSED_MIN_PAGES, sel_triton.EARLY_EXIT, sel_triton.MERGE_IN_REGISTERS,
         sel_triton.DIGIT_BITS, cuda_mma.BALANCED, cuda_mma.MIN_BLOCKS) = MODES[mode]
        summary = run_e2e_bench(Path(args.out) / mode, cfg)
        for r in summary["rows"]:
            print(mode, r["context"], r["batch"], round(r["tpot_ms"], 3), flush=True)


if __name__ == "__main__":
    main()
