"""Launch sizes of the LOCKS score and selection kernels at short contexts, where they are latency-bound.

At 16K-128K tokens the summaries take about a microsecond to stream at copy bandwidth, so each
kernel's time is its launch and its dependent instruction chain. This times, CUDA-graph replayed
(``common.graph_time``), batch 1, on the kernel bench's random inputs:

- the CUDA score kernel at 16 pages per program (one tile per program, its four page groups over
  the four warps), 64 and 128 (one or two 16-page tiles per warp), each checked against the
  default launch's scores (``max_err``), the default launch marked;
- the load-only kernel (``common.load_only``: the summaries' bytes, no math) at 64, 128 and 512
  pages per program;
- the fused combine + selection (:func:`kvlocks.selection.fused.rank_and_select`) at
  ``--select-chunks`` pages per program and the default, each checked to select the same pages;
- one empty launch (the graph's per-kernel floor).

JSON lines to ``--out``.

    python3 scripts/gpu/probes/launch_sizes.py --out OUT/launch_sizes.jsonl --contexts 16384,32768,65536
"""

from __future__ import annotations

import argparse

import torch
import triton
from common import emit, graph_time, load_only

from kvlocks.scoring import cuda_mma
from kvlocks.scoring.triton import score_pages_paged, score_workspace
from kvlocks.selection.fused import default_fused_chunk, fused_workspace, rank_and_select
from kvlocks_lab.bench.kernels import SHAPES, KernelBenchConfig, _Case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="glm4-9b-1m,llama3-8b")
    ap.add_argument("--contexts", default="16384,32768,65536,131072")
    ap.add_argument("--reps", type=int, default=20, help="launches per CUDA graph")
    ap.add_argument("--select-chunks", default="512,1024,2048", help="fused selection pages per program")
    ap.add_argument("--skip-score", action="store_true", help="time the selection only")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = KernelBenchConfig()
    empty = torch.empty(1, device=dev)
    emit(args.out, {"kind": "empty", "us": graph_time(lambda: empty.add_(1.0), n_graph=args.reps)})
    for shape in args.shapes.split(","):
        hkv, g, d = SHAPES[shape][:3]
        for n in map(int, args.contexts.split(",")):
            case = _Case(shape, n, 1, 1, cfg, dev, torch.Generator(device=dev).manual_seed(0))
            c, k = case.lcfg, case.lcfg.pages_per_step
            q, tbl, seq, p = case.q[0], case.tables[0], case.seq, case.p
            base = dict(shape=shape, tokens=n, pages=p)
            sw = score_workspace(1, hkv, g, p, dev)
            score_pages_paged(q, case.store, tbl, seq, workspace=sw, rank=False)
            for ppp in () if args.skip_score else (16, 64, 128):
                ws = score_workspace(1, hkv, g, p, dev, pages_per_program=ppp)
                fn = lambda ws=ws: cuda_mma.score_pages_mma(q, case.store, tbl, seq, workspace=ws, rank=False)  # noqa: E731
                err = float((fn()[0][..., :p] - sw.scores[..., :p]).abs().max())
                emit(args.out, {"kind": "score", **base, "ppp": ppp, "default": ppp == sw.ppp,
                                "programs": ws.n_chunks * hkv, "us": graph_time(fn, n_graph=args.reps),
                                "max_err": err})
            for ppp in () if args.skip_score else (64, 128, 512):
                emit(args.out, {"kind": "load_only", **base, "ppp": ppp, "us": graph_time(
                    lambda ppp=ppp: load_only(case.store, tbl[0], hkv, p, 16, 4, ppp), n_graph=args.reps)})
            sel = dict(page_size=c.page_size, k=k, sink_pages=c.sink_pages, recent_pages=c.recent_pages)
            ref = None
            for chunk in sorted({int(x) for x in args.select_chunks.split(",")} | {default_fused_chunk(p, k)}):
                if chunk > 2 * triton.next_power_of_2(p):
                    continue
                fw = fused_workspace(1, hkv, p, k, dev, chunk=chunk)
                out = rank_and_select(sw, seq, workspace=fw, **sel).clone()
                ref = out if ref is None else ref
                emit(args.out, {"kind": "select", **base, "chunk": chunk, "n_chunks": fw.n_chunks,
                                "default": chunk == default_fused_chunk(p, k),
                                "same_pages": bool(torch.equal(out, ref)),
                                "us": graph_time(lambda fw=fw: rank_and_select(sw, seq, workspace=fw, **sel),
                                                 n_graph=args.reps)})
            del case


if __name__ == "__main__":
    main()
