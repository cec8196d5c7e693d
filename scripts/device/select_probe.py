"""Selection probe (issue 5/6): the page-selection kernels' time against their chunk size.

The end-to-end profile (``scripts/device/step_profile.py``) puts the selection's radix merge at
~50 us per layer at 1M tokens (32 chunks x 128 winners per row, one program per row), far above
``kvlocks bench kernels``' ``locks_select``. For each shape, batch and chunk size (pages per stage-1
program, ``select_workspace(chunk=...)``) this times ``select_pages_paged`` on a random ranking at
``--tokens`` (a CUDA graph of ``--reps`` launches, median of 7 replays) and checks that every
chunk size selects exactly the pages of the default one (the selection is exact, so the output
must not depend on the chunking). JSON lines to ``--out``.

    python scripts/device/select_probe.py --out OUT/select_probe.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvlocks_lab.bench.kernels import SHAPES
from kvlocks.selection.triton import default_chunk, select_pages_paged, select_workspace

sys.path.insert(0, str(Path(__file__).parent))
from score_probe import _time  # noqa: E402  (CUDA-graph timing of one launch, shared)


def main() -> None:
    ap = argparse.ArgumentParser()
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
                row = {"shape": shape, "batch": bsz, "tokens": args.tokens, "chunk": ws["chunk"],
                       "n_chunks": ws["n_chunks"], "us": _time(fn, n_graph=args.reps),
                       "same_as_default": bool(torch.equal(got, ref))}
                print(json.dumps(row), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
