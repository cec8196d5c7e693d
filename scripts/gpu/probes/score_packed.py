"""The packed Triton score kernel (:mod:`kvlocks.scoring.triton_packed`): correctness and launch shapes.

``--check``: the packed kernel (inline-PTX unpacking on CUDA) against the torch reference for D 64/128,
G 1-16, bf16/fp32/fp16 queries and a partial last page (on the CPU with ``TRITON_INTERPRET=1``).
Otherwise, on one random summary store (``--shape``: a kernel-bench shape or ``HKV:G:D``, at
``--tokens``, batch 1), times ``cur`` (the three-dot Triton score kernel, autotuned) and ``packed`` at
several launch shapes, CUDA-graph replayed, each against the copy
bandwidth measured in the same run and checked against ``cur``'s scores. ``--ncu NAME`` (``cur``,
``load:BLOCK:WARPS`` or ``packed:BLOCK:WARPS:STAGES``) runs three launches for Nsight Compute. JSON
lines to ``--out``.

    python3 scripts/gpu/probes/score_packed.py --check
    python3 scripts/gpu/probes/score_packed.py --shape 32:1:128 --out OUT/packed.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import emit, graph_time, load_only, parse_shape, random_case, store_bytes

from kvlocks.config import KernelOptions, LocksConfig
from kvlocks.plan import paged_score
from kvlocks.scoring import triton_packed
from kvlocks_lab.bench.kernels import _random_store, copy_bandwidth


def check() -> int:
    """The packed kernel against the torch backend at small sizes; the number of failures."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bad = []
    for d in (64, 128):
        for g in (1, 2, 3, 4, 8, 16):
            for dt in (torch.bfloat16, torch.float32) + ((torch.float16,) if d == 128 else ()):
                for block, coef in [(b, c) for b in ((16, 32) if device.type == "cuda" else (8,))
                                    for c in ((2,) if g == 1 else (None,))]:
                    gen = torch.Generator(device=device).manual_seed(g * 100 + d)
                    hkv, pc = 2, 40
                    store = _random_store(pc * 2, hkv, d, LocksConfig(page_size=16, budget=256), device, gen)
                    table = torch.randperm(pc * 2, generator=gen, device=device).to(torch.int32).view(2, pc)
                    seq = torch.tensor([pc * 16, 16 * 23 + 5], dtype=torch.int32, device=device)
                    q = torch.empty(2, hkv * g, d, device=device).normal_(generator=gen).to(dt)
                    exp = paged_score(q, store, table, seq, backend="torch")
                    got = triton_packed.score_pages_packed(q, store, table, seq, coef=coef,
                                                           launch={"BLOCK": block, "num_warps": 4})
                    for b in range(2):
                        np_ = int(seq[b]) // 16
                        for name, x, y in zip(("scores", "lse", "ranking"), got, exp):
                            x, y = (x[b], y[b]) if name == "lse" else (x[b, ..., :np_], y[b, ..., :np_])
                            err = (x - y).abs().max().item()
                            if not err <= (2e-3 if name != "ranking" else 2e-5):
                                bad.append((d, g, str(dt), block, coef, name, err))
                                print("FAIL", bad[-1], flush=True)
                    print(f"done d={d} g={g} {dt} block={block} coef={coef}", flush=True)
    print("FAILURES:", bad if bad else "none")
    return len(bad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="against the torch reference (exit 1 on failure)")
    ap.add_argument("--shape", default="llama3-8b", help="a kernel-bench shape or HKV:G:D")
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--ncu", default=None, help="cur | load:BLOCK:WARPS | packed:BLOCK:WARPS:STAGES")
    ap.add_argument("--out", default="score_packed.jsonl")
    args = ap.parse_args()
    if args.check:
        sys.exit(1 if check() else 0)
    from kvlocks.scoring import triton as st

    device = torch.device("cuda")
    store, table, q, seq = random_case(args.shape, args.tokens, device)
    hkv, g, d = parse_shape(args.shape)
    pc = args.tokens // 16
    nbytes = store_bytes(store)
    ws = st.score_workspace(1, hkv, g, pc, device)
    three_dot = KernelOptions(score_kernel="mma")  # "cur": the three-dot Triton kernel

    def cur():
        return st.score_pages_paged(q, store, table, seq, workspace=ws, options=three_dot)

    def packed_fn(block, warps, stages, coef=3):
        launch = {"BLOCK": block, "num_warps": warps, "num_stages": stages}
        wsv = st.score_workspace(1, hkv, g, pc, device)
        return lambda: triton_packed.score_pages_packed(q, store, table, seq, launch=launch, workspace=wsv,
                                                        coef=coef)

    if args.ncu:
        name, *rest = args.ncu.split(":")
        if name == "cur":
            fn = cur
        elif name == "load":
            fn = lambda: load_only(store, table[0], hkv, pc, int(rest[0]), int(rest[1]), 512)  # noqa: E731
        else:
            fn = packed_fn(*map(int, rest))
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return
    copy = copy_bandwidth(device)
    rows = []

    def row(**r):
        r.update(shape=args.shape, tokens=args.tokens, bytes=nbytes)
        r["gbps"] = nbytes / (r["us"] * 1e-6) / 1e9
        r["pct_copy"] = 100 * r["gbps"] / copy
        rows.append(r)
        emit(args.out, r)

    row(name="cur", us=graph_time(cur), config=str(st.tuned_launch()))
    ref = [x.clone() for x in cur()]  # the packed kernel's correctness at full size
    configs = [dict(coef=3, block=b, warps=w, stages=n) for b, w, n in
               ((16, 4, 1), (32, 4, 2), (16, 2, 2), (32, 4, 1), (16, 4, 2), (32, 8, 2), (8, 4, 1))]
    if g <= 4:
        configs += [dict(coef=2, block=b, warps=w, stages=2) for b, w in ((32, 4), (16, 4), (16, 2))]
    for c in configs:
        try:
            fn = packed_fn(**c)
            t0 = time.time()
            got = fn()
            errs = [(x[..., :pc] - y[..., :pc]).abs().max().item() for x, y in zip(got, ref)]
            row(name="packed", **c, us=graph_time(fn), max_err=errs, compile_s=time.time() - t0)
        except Exception as e:  # noqa: BLE001 (a launch shape that does not compile must not stop the probe)
            print("packed failed", c, repr(e)[:300], file=sys.stderr)
    best = min((r for r in rows if r["name"] == "packed"), key=lambda r: r["us"], default=None)
    print("best packed:", best)


if __name__ == "__main__":
    main()
