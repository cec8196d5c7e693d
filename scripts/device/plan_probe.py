"""Decode-plan probe (issues 5/6): the LOCKS step's kernels timed alone and in sequence.

``kvlocks bench kernels`` times score, select and attend each on its own and the whole plan; when
the parts do not add up to the whole, this says which sequence adds the time. For each shape and
context (batch 1, the kernel bench's random inputs), CUDA-graph timings (``score_probe._time``) of

- ``S`` score kernel (no combine), ``F`` fused combine + selection, ``A`` attention;
- ``S+F``, ``S+F+A``, ``plan`` (``DecodePlan.run``);
- the session-6 path: ``S+C`` (combine pass), ``S+C+U`` (two-launch selection), ``S+C+U+A``;
- fused variants after ``S``: heads unrolled (``unroll``), 4 or 16 warps, radix passes stopped
  early (``early``).

JSON lines to ``--out``.

    python scripts/device/plan_probe.py --out OUT/plan_probe.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvlocks.attention.triton import paged_decode
from kvlocks_lab.bench.kernels import KernelBenchConfig, _Case
from kvlocks.dispatch import DecodePlan
from kvlocks.scoring.triton import _combine_launch, score_pages_paged
from kvlocks.selection.fused import rank_and_select
from kvlocks.selection.triton import select_pages_paged, select_workspace

sys.path.insert(0, str(Path(__file__).parent))
from score_probe import _time  # noqa: E402  (CUDA-graph timing of one launch, shared)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="glm4-9b-1m,llama3-8b")
    ap.add_argument("--contexts", default="1048576,262144,32768,16384")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = KernelBenchConfig()
    for shape in args.shapes.split(","):
        for n in map(int, args.contexts.split(",")):
            case = _Case(shape, n, 1, 1, cfg, dev, torch.Generator(device=dev).manual_seed(0))
            c, k = case.lcfg, case.lcfg.pages_per_step
            plan = DecodePlan(batch=1, num_kv_heads=case.hkv, group=case.g, head_dim=case.d, max_pages=case.p,
                              config=c, dtype=torch.bfloat16, device=dev, backend="triton")
            sw, fw, aw = plan.ws["score"], plan.ws["select"], plan.ws["attend"]
            uw = select_workspace(1, case.hkv, case.p, k, dev)
            sel = dict(page_size=c.page_size, k=k, sink_pages=c.sink_pages, recent_pages=c.recent_pages)
            q, tbl, seq = case.q[0], case.tables[0], case.seq

            def S():
                score_pages_paged(q, case.store, tbl, seq, workspace=sw, rank=False)

            def F(ws=fw):
                return rank_and_select(sw, seq, workspace=ws, **sel)

            def A(pages):
                paged_decode(q, case.kc, case.vc, tbl, seq, pages, workspace=aw)

            def C():
                _combine_launch(sw, seq, case.hkv, case.g, case.p, c.page_size, c.combine)

            def U():
                return select_pages_paged(sw["ranking"], seq, workspace=uw, **sel)

            S()
            F()
            C()
            U()
            seqs = {
                "S": S, "F": F, "A": lambda: A(fw["out"]), "S+F": lambda: (S(), F()),
                "S+F+A": lambda: (S(), F(), A(fw["out"])), "plan": lambda: plan.run(q, case.kc, case.vc, case.store,
                                                                                    tbl, seq),
                "S+C": lambda: (S(), C()), "S+C+U": lambda: (S(), C(), U()),
                "S+C+U+A": lambda: (S(), C(), U(), A(uw["out"])),
            }
            for name, opts in (("unroll", {"unroll_heads": True}), ("warps4", {"num_warps": 4}),
                               ("warps16", {"num_warps": 16}), ("early", {"early_exit": True}),
                               ("late", {"early_exit": False}), ("regs", {"merge_in_registers": True}),
                               ("bits5", {"digit_bits": 5}), ("regs+bits5", {"merge_in_registers": True,
                                                                              "digit_bits": 5})):
                w = dict(fw, **opts)
                seqs[f"S+F[{name}]"] = lambda w=w: (S(), F(w))
            for name, fn in seqs.items():
                row = {"shape": shape, "tokens": n, "seq": name, "chunk": fw["chunk"], "n_chunks": fw["n_chunks"]}
                try:
                    row["us"] = _time(fn, n_graph=args.reps)
                except Exception as e:  # noqa: BLE001 (a failing variant must not stop the probe)
                    row["error"] = repr(e)[:300]
                print(json.dumps(row), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            same = torch.equal(F().clone(), U().clone())
            with open(args.out, "a") as f:
                f.write(json.dumps({"shape": shape, "tokens": n, "fused_equals_unfused": bool(same)}) + "\n")
            del case, plan


if __name__ == "__main__":
    main()
