"""Static sm_90 instruction counts of the summary-build kernel's two solvers (CPU only: no GPU needed).

Compiles ``kvlocks.summary.triton._build_kernel`` ahead of time for the H200 (``GPUTarget("cuda",
90, 32)``, one page x one warp per program, D = 128, the bulk-build path), disassembles it with
the ``cuobjdump`` that ships with Triton and counts, for the lean Gram solver and the one-sided
solver (``ONESIDED``), both without a register cap:

- the instructions of the Jacobi loop body (its backward branches mark it) and of the rest;
- the operations that go through the SM's shared-memory / shuffle pipe (``LDS``/``STS``, ``LDSM``/
  ``STSM``, ``SHFL``, barriers), with a rough cost in pipe cycles per warp (4 for 128-bit and matrix
  transfers, 2 for other shared loads/stores and shuffles, 1 per barrier);
- registers per thread and shared memory per program.

Per page: ``loop body x (loop trips)`` + ``rest``; the loop trips are 5 x 15 Jacobi steps for the
Gram solvers (one step per trip) and 5 for the one-sided solver (its 15 steps unrolled in one
trip). JSON to ``--out``. Run it once per Triton version (the GPU image's 3.6 lowers the one-sided
solver's row swaps through shared memory, 3.9 keeps them in registers; ``scripts/setup_device_triton.sh``
puts Triton 3.6 in ``.venv/triton-device``):

    python scripts/analysis/build_sass.py --out DIR/triton39.json
    PYTHONPATH=.venv/triton-device:src python scripts/analysis/build_sass.py --out DIR/triton36.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvlocks.summary import triton as bt

SIGNATURE = {"k_ptr": "*bf16", "stride_kp": "i32", "stride_ks": "i32", "stride_kh": "i32", "ids_ptr": "*i32",
             "n_items": "i32", "Hkv": "i32", "bt_ptr": "*i32", "stride_bt": "i32", "basis_ptr": "*u8",
             "bscale_ptr": "*fp16", "coef_ptr": "*i8", "cscale_ptr": "*fp16", "cen_ptr": "*i8",
             "censcale_ptr": "*fp16", "eig_ptr": "*fp32", "n_sweeps": "i32", "floor2": "fp32"}
# (ONESIDED, loop trips per page at SWEEPS = 5: one Jacobi step per trip, or 15 unrolled in one)
VARIANTS = {"lean": (False, 75), "onesided": (True, 5)}
PIPE = ("LDS", "STS", "LDSM", "STSM", "SHFL", "BAR")
WIDE = ("LDS.128", "STS.128", "LDSM.16.M88.4", "STSM.16.M88.4")


def cuobjdump() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_variant(onesided: bool, head_dim: int = 128):
    consts = dict(S=16, D=head_dim, R=8, BP=1, INCREMENTAL=False, WRITE_EIG=False, PRECISION="tf32x3",
                  ONESIDED=onesided)
    src = ASTSource(fn=bt._build_kernel, signature=dict(SIGNATURE, **{k: "constexpr" for k in consts}),
                    constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})


def _tool(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump()), flag, f.name], capture_output=True, text=True, check=True).stdout


def sass(cubin: bytes) -> tuple[list[str], tuple[int, int] | None]:
    """Opcodes (with modifiers, predicates dropped) of every instruction, and the first and last
    index of the region that the backward branches enclose (the solver loop), if any."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,5})\*/\s+(.*?);",
                                                                    _tool(cubin, "-sass"))]
    index = {a: i for i, (a, _) in enumerate(lines)}
    loops = []
    for i, (a, t) in enumerate(lines):
        m = re.search(r"BRA .*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            loops.append((index[int(m.group(1), 16)], i))
    ops = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for _, t in lines]
    return ops, ((min(s for s, _ in loops), max(e for _, e in loops)) if loops else None)


def pipe_cost(ops: list[str]) -> tuple[int, int, dict]:
    counts = collections.Counter(op for op in ops if op.startswith(PIPE))
    cycles = sum(v * (4 if k in WIDE else 1 if k.startswith("BAR") else 2) for k, v in counts.items())
    return sum(counts.values()), cycles, dict(sorted(counts.items()))


def registers(cubin: bytes) -> int | None:
    m = re.search(r"REG:(\d+)", _tool(cubin, "-res-usage"))
    return int(m.group(1)) if m else None


def analyse(name: str) -> dict:
    onesided, trips = VARIANTS[name]
    k = compile_variant(onesided)
    cubin = k.asm["cubin"]
    ops, span = sass(cubin)
    body, rest = (ops[span[0]: span[1] + 1], ops[: span[0]] + ops[span[1] + 1:]) if span else ([], ops)
    b_n, b_cyc, b_ops = pipe_cost(body)
    r_n, r_cyc, r_ops = pipe_cost(rest)
    return {"variant": name, "onesided": onesided, "loop_trips_per_page": trips,
            "instructions": len(ops), "loop_body_instructions": len(body), "rest_instructions": len(rest),
            "loop_body_pipe_ops": b_n, "loop_body_pipe_cycles": b_cyc, "loop_body_pipe_by_op": b_ops,
            "rest_pipe_ops": r_n, "rest_pipe_cycles": r_cyc, "rest_pipe_by_op": r_ops,
            "per_page_instructions": len(body) * trips + len(rest),
            "per_page_pipe_cycles": b_cyc * trips + r_cyc,
            "registers": registers(cubin), "shared_bytes": k.metadata.shared}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="any of: " + ", ".join(VARIANTS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = [analyse(v) for v in args.variants.split(",")]
    for r in rows:
        print(f"{r['variant']}: loop body {r['loop_body_instructions']} instr / {r['loop_body_pipe_ops']} pipe ops "
              f"x {r['loop_trips_per_page']}; per page {r['per_page_instructions']} instr, "
              f"~{r['per_page_pipe_cycles']} pipe cycles; {r['registers']} registers, {r['shared_bytes']} B shared")
    Path(args.out).write_text(json.dumps({"target": "sm_90 (GPUTarget('cuda', 90, 32)), 1 page x 1 warp, D=128",
                                          "triton": triton.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
