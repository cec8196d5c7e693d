"""Small-batch weight products: cuBLAS (``F.linear``) against ``kvlocks.engine.gemv`` launches.

For each model shape's weight products of one decode step (fused q/k/v, o_proj, gate/up, down, LM
head), each batch, each launch: the time per product (a CUDA graph of ``--reps`` products over
``--copies`` copies of the weight, so the weights come from HBM as they do in the step), the bytes
streamed per second, and the largest difference from cuBLAS's output relative to its largest
value. Then, per (shape, batch): the whole step's products summed over the layers for cuBLAS and
for the fastest launch of each product. JSON lines to ``--out``.

    python scripts/device/gemv_probe.py --out OUT/gemv.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from kvlocks.engine.gemv import gemv
from kvlocks.engine.models import SHAPES

sys.path.insert(0, str(Path(__file__).parent))
from score_probe import _time  # noqa: E402  (CUDA-graph timing, shared)


def products(shape: str) -> list[tuple[str, int, int, int]]:
    """(name, N, K, times per step) of a model shape's decode-step weight products."""
    f = SHAPES[shape][1]
    h, d, ff = f["hidden_size"], f["head_dim"], f["intermediate_size"]
    nq, nkv, layers = f["num_attention_heads"] * d, f["num_key_value_heads"] * d, f["num_hidden_layers"]
    gate_up = [("gate_up", 2 * ff, h, layers)] if SHAPES[shape][0] == "glm" else [("gate", ff, h, layers),
                                                                                ("up", ff, h, layers)]
    return [("qkv", nq + 2 * nkv, h, layers), ("o", h, nq, layers), *gate_up, ("down", h, ff, layers),
            ("lm_head", f["vocab_size"], h, 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="glm4-9b-1m,llama3.1-8b")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--block-k", default="128,256")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    launches = list(itertools.product(*(map(int, getattr(args, a).split(",")) for a in
                                        ("block_n", "block_k", "warps", "stages"))))

    def emit(row):
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")

    for shape in args.shapes.split(","):
        for bsz in map(int, args.batches.split(",")):
            step = {"cublas": 0.0, "best": 0.0}
            for name, n, k, times in products(shape):
                gen = torch.Generator(device=dev).manual_seed(n + k)
                ws = [torch.randn(n, k, generator=gen, device=dev).to(dt) * 0.02 for _ in range(args.copies)]
                x = torch.randn(bsz, k, generator=gen, device=dev).to(dt)
                ys = [torch.empty(bsz, n, dtype=dt, device=dev) for _ in range(args.copies)]
                nbytes = n * k * 2

                def run(fn):
                    def many():
                        for i in range(args.reps):
                            fn(ws[i % args.copies], ys[i % args.copies])
                    return _time(many, n_graph=1) / args.reps

                ref = torch.nn.functional.linear(x, ws[0]).float()
                us = run(lambda w, y: torch.mm(x, w.t(), out=y))
                base = {"shape": shape, "batch": bsz, "product": name, "N": n, "K": k, "per_step": times}
                emit({**base, "launch": "cublas", "us": us, "gbps": nbytes / us / 1e3})
                best = us
                for bn, bk, w_, st in launches:
                    kw = dict(block_n=bn, block_k=bk, num_warps=w_, num_stages=st)
                    try:
                        got = gemv(x, ws[0], **kw).float()
                        t = run(lambda w, y, kw=kw: gemv(x, w, out=y, **kw))
                    except Exception as exc:  # noqa: BLE001 (a launch that does not compile is reported)
                        emit({**base, "launch": f"n{bn}_k{bk}_w{w_}_s{st}", "error": str(exc)[:200]})
                        continue
                    err = float((got - ref).abs().max() / ref.abs().max())
                    emit({**base, "launch": f"n{bn}_k{bk}_w{w_}_s{st}", "us": t, "gbps": nbytes / t / 1e3,
                          "rel_err": err})
                    if err < 1e-2:
                        best = min(best, t)
                step["cublas"] += us * times / 1e3
                step["best"] += best * times / 1e3
                del ws, ys
            emit({"shape": shape, "batch": bsz, "step_ms_cublas": step["cublas"], "step_ms_best": step["best"]})


if __name__ == "__main__":
    main()
