"""How the CUDA score kernel is launched, against its speed (issue 5): page split and blocks per SM.

At 1M tokens, batch 1, the default static split (``ppp`` a multiple of 64 pages) gives glm4-9b-1m
588 programs for 660 resident-block slots (4 rows x 147), llama3-8b 632: some SMs run 5 programs
and others 4. And 5 blocks of 4 warps per SM (92 registers) leave each scheduler 5 warps to hide
the latency of its groups' copies and tensor-core chains. This probe times the kernel
(graph-replayed, inputs rotated past the L2) with:

- ``static``: the default split; ``static16``: ``ppp`` a multiple of 16 (tiles) filling one wave;
- ``balanced``: each sequence's tiles in near-equal runs over ``ceil(max_pages / ppp)`` programs,
  sized for one wave (``cuda_mma.pages_per_program(..., balanced=True)``) and for two;
- ``six`` / ``six_balanced``: the variant compiled for 6 blocks per SM (``min_blocks=6``: at most
  80 registers, one centroid slot per warp; D = 128 and G <= 8 only), static and balanced splits
  sized for its wave;
- the load-only kernel of ``score_probe.py`` with the static split, as a bound.

Every variant's page scores must equal the static split's bit for bit (the per-page arithmetic does
not depend on the split or the variant) and its per-head log-sum-exp agree to 1e-5. JSON lines to
``--out``.

    python scripts/device/score_launch_probe.py --out OUT/launch.jsonl --tokens 1048576,262144
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from kvlocks_lab.bench.kernels import SHAPES, copy_bandwidth

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from score_probe import _case, _load_launch, _time, store_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1048576,262144")
    ap.add_argument("--shapes", default="glm4-9b-1m,llama3-8b")
    args = ap.parse_args()
    from kvlocks.scoring import cuda_mma
    from kvlocks.scoring import triton as st

    dev = torch.device("cuda")
    copy = copy_bandwidth(dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    for shape in args.shapes.split(","):
        hkv, g, d = SHAPES[shape][:3]
        for tokens in (int(t) for t in args.tokens.split(",")):
            first = _case(shape, tokens, dev, seed=0)
            nbytes = store_bytes(first[0])
            sets = [first] + [_case(shape, tokens, dev, seed=s) for s in range(1, max(1, -(-3 * l2 // nbytes)))]
            pc = tokens // 16
            static = cuda_mma.pages_per_program(pc, hkv, dev, d, g, balanced=False)
            one_wave = cuda_mma.pages_per_program(pc, hkv, dev, d, g, balanced=True)
            variants = [("static", static, False, 1), ("static16", -(-one_wave // 16) * 16, False, 1),
                        ("balanced", one_wave, True, 1),
                        ("balanced_2waves", -(-pc // (2 * -(-pc // one_wave))), True, 1)]
            if cuda_mma.variant_min_blocks(d, g, cuda_mma.WARPS, 6) == 6:
                variants += [("six", cuda_mma.pages_per_program(pc, hkv, dev, d, g, balanced=False, min_blocks=6),
                              False, 6),
                             ("six_balanced", cuda_mma.pages_per_program(pc, hkv, dev, d, g, balanced=True,
                                                                         min_blocks=6), True, 6)]
            ref = None
            for name, ppp, balanced, min_blocks in variants:
                wss = []
                for _ in sets:
                    ws = st.score_workspace(1, hkv, g, pc, dev, pages_per_program=ppp)
                    ws["balanced"], ws["min_blocks"] = balanced, min_blocks
                    wss.append(ws)
                calls = [lambda s=s, ws=ws: cuda_mma.score_pages_mma(s[2], s[0], s[1], s[3], workspace=ws)
                         for s, ws in zip(sets, wss)]
                got = [x.clone() for x in calls[0]()]
                same = None
                if ref is None:
                    ref = got
                else:
                    same = bool(torch.equal(got[0], ref[0])) and float((got[1] - ref[1]).abs().max()) <= 1e-5
                at = [0]

                def fn(calls=calls, at=at):
                    calls[at[0] % len(calls)]()
                    at[0] += 1

                us = _time(fn)
                row = dict(shape=shape, tokens=tokens, variant=name, ppp=ppp, min_blocks=min_blocks,
                           n_chunks=wss[0]["n_chunks"],
                           programs=wss[0]["n_chunks"] * hkv, us=us, pct_copy=100 * nbytes / (us * 1e-6) / 1e9 / copy,
                           same_as_static=same, copy_gbps=copy, sets=len(sets))
                print(json.dumps(row), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            at = [0]

            def load(at=at):
                s = sets[at[0] % len(sets)]
                at[0] += 1
                _load_launch(s[0], s[1][0], hkv, pc, 16, 4, static)

            us = _time(load)
            row = dict(shape=shape, tokens=tokens, variant="load_only", ppp=static, us=us,
                       pct_copy=100 * nbytes / (us * 1e-6) / 1e9 / copy, copy_gbps=copy)
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
