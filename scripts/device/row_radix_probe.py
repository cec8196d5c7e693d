"""The row-histogram selection against the chunk-merge one (issue 5: selection <= 10% of locks_total).

For each shape, context and batch, on random per-head scores with one score program's statistics
per row (``fused_select_probe._scored``), times :func:`kvlocks.selection.fused.rank_and_select`
with its chunk-merge workspace (``chunks@default``, :func:`default_fused_chunk`) and
:func:`kvlocks.selection.row_radix.rank_and_select_rows` at several pages per program and warps
(``rows@CH/W``), each as a CUDA graph of ``--reps`` launches (median of 7 replays), and checks that
every variant selects the same pages as the chunk-merge one (``same``). JSON lines to ``--out``.

    python scripts/device/row_radix_probe.py --out OUT/row_radix.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvlocks.bench.kernels import SHAPES
from kvlocks.selection.fused import default_fused_chunk, rank_and_select
from kvlocks.selection.row_radix import rank_and_select_rows, row_radix_workspace
from kvlocks.selection.triton import select_workspace

sys.path.insert(0, str(Path(__file__).parent))
from fused_select_probe import _scored  # noqa: E402  (random per-head scores with their statistics)
from score_probe import _time  # noqa: E402  (CUDA-graph timing of one launch, shared)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama3-8b,glm4-9b-1m")
    ap.add_argument("--contexts", default="65536,262144,1048576")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--variants", default="512/4,1024/4,1024/8,2048/8,4096/8",
                    help="row-histogram pages per program / warps, comma-separated")
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sel = dict(page_size=16, k=args.k, sink_pages=1, recent_pages=1)
    for shape in args.shapes.split(","):
        hkv, g = SHAPES[shape][:2]
        for bsz in map(int, args.batches.split(",")):
            for tokens in map(int, args.contexts.split(",")):
                pages = tokens // 16
                seq = torch.full((bsz,), tokens, dtype=torch.int32, device=dev)
                sw = _scored(bsz, hkv, g, pages, tokens, dev, seed=tokens + bsz)
                cw = select_workspace(bsz, hkv, pages, args.k, dev, chunk=default_fused_chunk(pages))
                ref = rank_and_select(sw, seq, workspace=cw, **sel).clone()
                base = {"shape": shape, "batch": bsz, "tokens": tokens}
                rows = [{**base, "variant": "chunks@default", "chunk": cw["chunk"],
                         "us": _time(lambda: rank_and_select(sw, seq, workspace=cw, **sel), n_graph=args.reps)}]
                for v in args.variants.split(","):
                    ch, warps = map(int, v.split("/"))
                    rw = row_radix_workspace(bsz, hkv, pages, args.k, dev, chunk=ch)
                    rw["num_warps"] = warps

                    def rows_sel(rw=rw):
                        return rank_and_select_rows(sw, seq, workspace=rw, **sel)

                    got = rows_sel().clone()
                    rows.append({**base, "variant": f"rows@{ch}/{warps}", "chunk": rw["chunk"],
                                 "us": _time(rows_sel, n_graph=args.reps), "same": bool(torch.equal(got, ref)),
                                 "counters_zero": int(rw["done"].abs().sum() + rw["hist"].abs().sum()) == 0})
                for row in rows:
                    print(json.dumps(row), flush=True)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
