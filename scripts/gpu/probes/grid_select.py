"""The re-rank's candidate selection: the fused kernel against the grid-wide radix select.

For each shape, context and k this fills per-head scores with random values (and their one-program
log-sum-exp statistics), then times :func:`kvlocks.selection.fused.rank_and_select` (its default
chunk for that k) and :func:`kvlocks.selection.triton_gridselect.grid_rank_and_select` at each
``--grid-chunks`` size (a CUDA graph of ``--reps`` launches, median of 7 replays), and checks that
both choose the same pages. JSON lines to ``--out``.

    python3 scripts/gpu/probes/grid_select.py --out OUT/grid_select.jsonl
"""

from __future__ import annotations

import argparse

import torch
from common import emit, graph_time

from kvlocks.scoring.triton import score_workspace
from kvlocks.scoring.triton_combine import LOG2E
from kvlocks.selection.fused import fused_workspace, rank_and_select
from kvlocks.selection.triton_gridselect import grid_rank_and_select, grid_select_workspace
from kvlocks_lab.bench.kernels import SHAPES


def random_scores(bsz, hkv, g, pages, dev, seed):
    """A score workspace as a score pass leaves it: per-head scores, one program's (max, sum) stats."""
    sw = score_workspace(bsz, hkv, g, pages, dev, pages_per_program=pages)
    gen = torch.Generator(device=dev).manual_seed(seed)
    sw.scores.copy_(torch.randn(bsz, hkv, g, pages, generator=gen, device=dev) * 2.0)
    s2 = sw.scores * LOG2E
    m = s2.amax(-1)
    sw.stats.zero_()
    sw.stats[:, 0, 0, :g] = m.reshape(bsz * hkv, g)
    sw.stats[:, 0, 1, :g] = torch.exp2(s2 - m[..., None]).sum(-1).reshape(bsz * hkv, g)
    return sw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama3-8b,glm4-9b-1m")
    ap.add_argument("--contexts", default="1048576,262144,131072")
    ap.add_argument("--ks", default="1010,506,128")
    ap.add_argument("--grid-chunks", default="1024,2048,4096")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    for shape in args.shapes.split(","):
        hkv, g = SHAPES[shape][0], SHAPES[shape][1]
        for tokens in map(int, args.contexts.split(",")):
            pages = tokens // 16 + 8
            sw = random_scores(args.batch, hkv, g, pages, dev, seed=tokens)
            seq = torch.full((args.batch,), tokens, dtype=torch.int32, device=dev)
            for k in map(int, args.ks.split(",")):
                sel = dict(page_size=16, k=k)
                fw = fused_workspace(args.batch, hkv, pages, k, dev)
                ref = rank_and_select(sw, seq, workspace=fw, **sel).clone()
                base = {"shape": shape, "batch": args.batch, "tokens": tokens, "k": k}
                emit(args.out, {**base, "kind": "fused", "chunk": fw.chunk, "us": graph_time(
                    lambda fw=fw: rank_and_select(sw, seq, workspace=fw, **sel), n_graph=args.reps)})
                for chunk in map(int, args.grid_chunks.split(",")):
                    gw = grid_select_workspace(args.batch, hkv, pages, k, dev, chunk=chunk)
                    got = grid_rank_and_select(sw, seq, workspace=gw, **sel).clone()
                    same = bool(torch.equal(got, ref))
                    us = graph_time(lambda gw=gw: grid_rank_and_select(sw, seq, workspace=gw, **sel), n_graph=args.reps)
                    emit(args.out, {**base, "kind": "grid", "chunk": gw.chunk, "same_pages": same, "us": us})


if __name__ == "__main__":
    main()
