"""Short-context probe (issue 6's crossover): where the LOCKS kernels' time goes at 16K-64K.

Session 13's step profile (GLM-4-9B, 32K, compiled, per layer): score kernel 10.7 us and fused
selection 10.7 us, though the summaries are 6.7 MB (1.6 us at copy bandwidth) and the pages 2K.
Both are latency-bound there. This times, CUDA-graph replayed (``score_probe._time``), batch 1:

- the CUDA score kernel at 16 pages per program (one tile per program, its four groups over the
  four warps: the GSPLIT variant), 64 and 128 (one or two 16-page tiles per warp). Session 13's call 3 also timed a variant that copied three of
  a tile's four page groups at once (since removed: no faster; each tile's cost is the warp's
  dependent instruction chain at about one warp per scheduler, not its memory round trips);
- the load-only kernel (the summaries' bytes, no math) at 64, 128 and 512 pages per program;
- the fused combine + selection at ``--select-chunks`` pages per program (default 512, 1024, 2048)
  and the default, at ``--select-warps`` warps per program (default: ``default_warps``);
- one empty launch (the graph's per-kernel floor).

JSON lines to ``--out``.

    python scripts/device/small_ctx_probe.py --out OUT/small.jsonl --contexts 16384,32768,65536
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

from kvlocks_lab.bench.kernels import SHAPES, KernelBenchConfig, _Case
from kvlocks.scoring import cuda_mma
from kvlocks.scoring.triton import score_pages_paged, score_workspace
from kvlocks.selection.fused import default_fused_chunk, default_warps, fused_workspace, rank_and_select

sys.path.insert(0, str(Path(__file__).parent))
from score_probe import _load_launch, _time  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="glm4-9b-1m,llama3-8b")
    ap.add_argument("--contexts", default="16384,32768,65536,131072")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--select-chunks", default="512,1024,2048", help="fused selection pages per program")
    ap.add_argument("--select-warps", default="", help="fused selection warps per program, comma-separated "
                    "(default: default_warps of each chunk)")
    ap.add_argument("--skip-score", action="store_true", help="time the selection only")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = KernelBenchConfig()
    empty = torch.empty(1, device=dev)

    def emit(**row):
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")

    emit(kind="empty", us=_time(lambda: empty.add_(1.0), n_graph=args.reps))
    for shape in args.shapes.split(","):
        hkv, g, d = SHAPES[shape][:3]
        for n in map(int, args.contexts.split(",")):
            case = _Case(shape, n, 1, 1, cfg, dev, torch.Generator(device=dev).manual_seed(0))
            c, k = case.lcfg, case.lcfg.pages_per_step
            q, tbl, seq, p = case.q[0], case.tables[0], case.seq, case.p
            base = dict(shape=shape, tokens=n, pages=p)
            default_ppp = cuda_mma.pages_per_program(p, hkv, dev, d, g)
            sw = score_workspace(1, hkv, g, p, dev)
            score_pages_paged(q, case.store, tbl, seq, workspace=sw, rank=False)
            for ppp in () if args.skip_score else (16, 64, 128):  # 16: one tile per program, groups over warps
                ws = score_workspace(1, hkv, g, p, dev, pages_per_program=ppp)
                fn = lambda ws=ws: cuda_mma.score_pages_mma(q, case.store, tbl, seq, workspace=ws)  # noqa: E731
                got = fn()[0]
                err = float((got[..., :p] - sw["scores"][..., :p]).abs().max())
                emit(kind="score", **base, warps=4, ppp=ppp, default=ppp == default_ppp,
                     programs=ws["n_chunks"] * hkv, us=_time(fn, n_graph=args.reps), max_err=err)
            for ppp in () if args.skip_score else (64, 128, 512):
                emit(kind="load_only", **base, ppp=ppp,
                     us=_time(lambda ppp=ppp: _load_launch(case.store, tbl[0], hkv, p, 16, 4, ppp), n_graph=args.reps))
            sel = dict(page_size=c.page_size, k=k, sink_pages=c.sink_pages, recent_pages=c.recent_pages)
            ref = None
            chunks = {int(x) for x in args.select_chunks.split(",")} | {default_fused_chunk(p)}
            for chunk in sorted(chunks):
                if chunk > 2 * triton.next_power_of_2(p):
                    continue
                fw = fused_workspace(1, hkv, p, k, dev, chunk=chunk)
                warps = [int(w) for w in args.select_warps.split(",") if w] or [default_warps(chunk, fw["n_chunks"])]
                for nw in warps:
                    fw["num_warps"] = nw
                    out = rank_and_select(sw, seq, workspace=fw, **sel).clone()
                    ref = out if ref is None else ref
                    emit(kind="select", **base, chunk=chunk, warps=nw, n_chunks=fw["n_chunks"],
                         default=chunk == default_fused_chunk(p) and nw == default_warps(chunk, fw["n_chunks"]),
                         same_pages=bool(torch.equal(out, ref)),
                         us=_time(lambda fw=fw: rank_and_select(sw, seq, workspace=fw, **sel), n_graph=args.reps))
            del case


if __name__ == "__main__":
    main()
