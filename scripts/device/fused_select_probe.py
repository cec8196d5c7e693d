"""Fused combine + selection probe (issues 5/6): one launch against session 6's three.

For each shape, context and batch, on random per-head scores with their per-program statistics
(as the score kernel leaves them), times

- ``unfused``: the combine pass, then the two-launch selection (chunk top-k, merge), as the
  decode plan ran them until session 6;
- ``fused@CH``: :func:`kvlocks.selection.fused.rank_and_select` at several pages per program
  (``default`` = :func:`default_fused_chunk`), each also with the radix passes stopped early
  (``+early``, ``--early``), with the merge's passes on one register tile (``+regs``,
  ``--regs``), with 5-bit radix digits (``+bits5``, ``--bits 4,5``) and with the passes over
  rebased keys (``+rebase``, ``--rebase``),

each as a CUDA graph of ``--reps`` launches (median of 7 replays; inputs stay in L2, as they do
in the decode step, where the score kernel has just written them), and checks that every fused
variant selects the pages the unfused path selects (``same``; the rankings differ by float
rounding, so a near-tie may rarely flip) and that its ranking matches (``rank_err``). JSON lines
to ``--out``.

    python scripts/device/fused_select_probe.py --out OUT/fused_select.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvlocks_lab.bench.kernels import SHAPES
from kvlocks.scoring.triton import LOG2E, _combine_launch, score_workspace
from kvlocks.selection.fused import default_fused_chunk, fused_workspace, rank_and_select
from kvlocks.selection.triton import select_pages_paged, select_workspace

sys.path.insert(0, str(Path(__file__).parent))
from score_probe import _time  # noqa: E402  (CUDA-graph timing of one launch, shared)


def _scored(bsz, hkv, g, pages, tokens, dev, seed):
    """A score workspace holding random per-head scores and one score program's statistics per row."""
    sw = score_workspace(bsz, hkv, g, pages, dev, pages_per_program=pages)
    gen = torch.Generator(device=dev).manual_seed(seed)
    pc = tokens // 16
    sc = torch.randn(bsz, hkv, g, pages, generator=gen, device=dev) * 2.0
    sw["scores"].copy_(sc)
    s2 = sc[..., :pc] * LOG2E
    m = s2.amax(-1)
    sw["stats"].zero_()
    sw["stats"][:, 0, 0, :g] = m.reshape(bsz * hkv, g)
    sw["stats"][:, 0, 1, :g] = torch.exp2(s2 - m[..., None]).sum(-1).reshape(bsz * hkv, g)
    return sw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama3-8b,glm4-9b-1m")
    ap.add_argument("--contexts", default="16384,32768,65536,262144,1048576")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--chunks", default="default,1024,2048,4096,8192")
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--early", default="both", choices=("off", "on", "both"),
                    help="radix passes stopped early (EARLY_EXIT) in the fused variants: off, on, or both")
    ap.add_argument("--regs", default="off", choices=("off", "on", "both"),
                    help="the merge's radix passes on one register tile (MERGE_IN_REGISTERS): off, on, or both")
    ap.add_argument("--bits", default="4", help="radix digit widths to try in the fused variants, e.g. 4,5")
    ap.add_argument("--rebase", default="off", choices=("off", "on", "both"),
                    help="radix passes over rebased keys (REBASE_KEYS): off, on, or both")
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
                uw = select_workspace(bsz, hkv, pages, args.k, dev)

                def unfused():
                    _combine_launch(sw, seq, hkv, g, pages, 16, "mean_share")
                    return select_pages_paged(sw["ranking"], seq, workspace=uw, **sel)

                ref = unfused().clone()
                ref_rank = sw["ranking"].clone()
                base = {"shape": shape, "batch": bsz, "tokens": tokens}
                rows = [{**base, "variant": "unfused", "chunk": uw["chunk"], "n_chunks": uw["n_chunks"],
                         "us": _time(unfused, n_graph=args.reps)}]
                seen = set()
                flags = {"off": (False,), "on": (True,), "both": (False, True)}
                for ch, ee, rg, bits, rb in [(c, e, r, int(b), x) for c in args.chunks.split(",")
                                             for e in flags[args.early] for r in flags[args.regs]
                                             for b in args.bits.split(",") for x in flags[args.rebase]]:
                    chunk = default_fused_chunk(pages) if ch == "default" else int(ch)
                    fw = fused_workspace(bsz, hkv, pages, args.k, dev, chunk=chunk)
                    fw["early_exit"] = ee
                    fw["merge_in_registers"] = rg
                    fw["digit_bits"] = bits
                    fw["rebase_keys"] = rb
                    if (fw["chunk"], ee, rg, bits, rb) in seen:
                        continue
                    seen.add((fw["chunk"], ee, rg, bits, rb))
                    ch = ch + ("+early" if ee else "") + ("+regs" if rg else "") + ("+bits5" if bits == 5 else "") \
                        + ("+rebase" if rb else "")

                    def fused(fw=fw):
                        return rank_and_select(sw, seq, workspace=fw, **sel)

                    got = fused().clone()
                    rows.append({**base, "variant": f"fused@{ch}", "chunk": fw["chunk"], "n_chunks": fw["n_chunks"],
                                 "us": _time(fused, n_graph=args.reps), "same": bool(torch.equal(got, ref)),
                                 "rank_err": float((sw["ranking"] - ref_rank).abs().max() / ref_rank.abs().max()),
                                 "counters_zero": int(fw["done"].abs().sum()) == 0})
                for row in rows:
                    print(json.dumps(row), flush=True)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
