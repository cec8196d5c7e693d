"""Same-machine A/B of the decode plan's two selection paths, end to end (issue 6).

Runs ``kvlocks bench e2e`` (LOCKS only) once with the combine pass + two-launch selection at every
context and once with the fused combine + selection (:mod:`kvlocks.selection.fused`) at every
context, by setting ``kvlocks.dispatch.FUSED_MIN_PAGES`` (read when each decode plan is made).
Writes ``OUT/unfused`` and ``OUT/fused`` (the bench's summary files) and prints both TPOTs.

    python scripts/device/select_ab.py --out OUT/select_ab --contexts 1048576,131072
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlocks import dispatch
from kvlocks.bench.e2e import E2EBenchConfig, run_e2e_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm4-9b-1m")
    ap.add_argument("--contexts", default="1048576,131072")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--fused-chunk", type=int, default=0, help="pages per fused program above one program per row "
                    "(0: default_fused_chunk)")
    ap.add_argument("--modes", default="unfused,fused", help="any of unfused, fused, fused_early (comma-separated)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ctx = tuple(int(c) for c in args.contexts.split(","))
    cfg = E2EBenchConfig(models=(args.model,), contexts=ctx, batches=(1,), batch_context=ctx[0], methods=("locks",),
                         steps=args.steps, max_prefill=0)
    if args.fused_chunk:
        from kvlocks.selection import fused

        base = fused.default_fused_chunk
        fused.default_fused_chunk = lambda p: base(p) if p <= fused.SINGLE_MAX else args.fused_chunk
    from kvlocks.selection import triton as sel_triton

    for mode in args.modes.split(","):
        dispatch.FUSED_MIN_PAGES = {"unfused": 1 << 40, "fused": 0, "fused_early": 0}[mode]
        sel_triton.EARLY_EXIT = mode == "fused_early"  # radix passes stopped early (read at each launch)
        summary = run_e2e_bench(Path(args.out) / mode, cfg)
        for r in summary["rows"]:
            print(mode, r["context"], r["batch"], round(r["tpot_ms"], 3), flush=True)


if __name__ == "__main__":
    main()
