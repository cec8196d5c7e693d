"""The two-launch page selection (:func:`kvlocks.selection.triton.select_pages_paged`) against its chunk size.

For each shape, batch and chunk size (pages per stage-1 program, ``select_workspace(chunk=...)``)
this times the selection on a random ranking at ``--tokens`` (a CUDA graph of ``--reps`` launches,
median of 7 replays) and checks that every chunk size selects exactly the pages of the default one
(the selection is exact, so the output must not depend on the chunking): the measurement behind
:func:`~kvlocks.selection.triton.default_chunk`. JSON lines to ``--out``.

    python3 scripts/gpu/probes/select_chunks.py --out OUT/select_chunks.jsonl
"""

from __future__ import annotations

import argparse

import torch
from common import emit, graph_time

from kvlocks.selection.triton import default_chunk, select_pages_paged, select_workspace
from kvlocks_lab.bench.kernels import SHAPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama3-8b,glm4-9b-1m")
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--chunks", default="1024,2048,4096,8192,16384")
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    for shape in args.shapes.split(","):
        hkv = SHAPES[shape][0]
        for bsz in map(int, args.batches.split(",")):
            pages = args.tokens // 16
            gen = torch.Generator(device=dev).manual_seed(bsz)
            ranking = torch.randn(bsz, hkv, pages + 8, generator=gen, device=dev)
            seq = torch.full((bsz,), args.tokens, dtype=torch.int32, device=dev)
            ref = None
            first = default_chunk(pages + 8)
            for chunk in [first] + [int(c) for c in args.chunks.split(",") if int(c) != first]:
                ws = select_workspace(bsz, hkv, pages + 8, args.k, dev, chunk=chunk)

                def fn():
                    return select_pages_paged(ranking, seq, page_size=16, k=args.k, workspace=ws)

                got = fn().clone()
                if ref is None:
                    ref = got
                emit(args.out, {"shape": shape, "batch": bsz, "tokens": args.tokens, "chunk": ws.chunk,
                                "n_chunks": ws.n_chunks, "us": graph_time(fn, n_graph=args.reps),
                                "same_as_default": bool(torch.equal(got, ref))})


if __name__ == "__main__":
    main()
