"""Where a decode row should stop selecting: one layer's decode step on the GPU, three ways, side by side.

    python3 scripts/gpu/dense_rows.py --out DIR [--contexts 8192 16384 32768 65536] [--batches 1 4]

For each head shape (GLM-4-9B: 2 KV heads x 16 queries x 128; Llama-3.1-8B: 8 x 4 x 128), context and
batch, with a block table as wide as a 131K-token engine's (as vLLM sizes the plans) and budget 2,048:

- ``locks``: ``DecodePlan.run`` selecting on every row (score, selection, attention over the pages);
- ``dense_rows``: the same plan with ``sparse_lens`` 0 on every row (the vLLM backend's rows below
  ``dense_below``: score and selection skip them, the split-KV kernel reads every page);
- ``dense_splitk``: the split-KV kernel over the identity page list with its own dense launch.

Each time is one CUDA-graph replay of ``--layers`` layer steps over disjoint pages (more bytes than
the L2 holds), divided by the layers. Writes ``DIR/dense_rows.json`` (rows, date, commit, GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "probes"))
from common import graph_time  # noqa: E402

from kvlocks.attention.triton import attention_workspace, identity_pages, paged_decode  # noqa: E402
from kvlocks.cache.layout import SummaryStore  # noqa: E402
from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.plan import DecodePlan, paged_build  # noqa: E402

SHAPES = {"glm4-9b-1m": (2, 16, 128), "llama3.1-8b": (8, 4, 128)}
S = 16


def graph_us(fn, layers: int) -> float:
    """Microseconds per layer step: ``fn(layer)`` for every layer, captured in one CUDA graph."""
    return graph_time(lambda: [fn(li) for li in range(layers)], n_graph=1, replays=20) / layers


def one_case(shape: str, ctx: int, bsz: int, layers: int, width: int, cfg: LocksConfig) -> dict:
    hkv, g, d = SHAPES[shape]
    dev = torch.device("cuda")
    pages = -(-ctx // S)
    num_pages = layers * bsz * pages
    k = torch.randn(num_pages, S, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(bsz, hkv * g, d, device=dev, dtype=torch.bfloat16)
    tables = []
    for li in range(layers):
        t = torch.zeros(bsz, width, dtype=torch.int32, device=dev)
        base = li * bsz * pages
        t[:, :pages] = (base + torch.arange(bsz * pages, device=dev, dtype=torch.int32)).view(bsz, pages)
        tables.append(t)
    store = SummaryStore.empty(num_pages, hkv, d, cfg, device=dev)
    paged_build(k, store, torch.arange(num_pages, device=dev, dtype=torch.int32), cfg)
    seq = torch.full((bsz,), ctx, dtype=torch.int32, device=dev)
    zero = torch.zeros_like(seq)
    plan = DecodePlan(batch=bsz, num_kv_heads=hkv, group=g, head_dim=d, max_pages=width, config=cfg,
                      dtype=q.dtype, device=dev, dense_tokens=65536)
    dense_ws = attention_workspace(bsz, hkv * g, d, width, bsz * hkv, q.dtype, dev)
    ident = identity_pages(bsz, hkv, width, dev)
    out = torch.empty_like(q)
    ways = {
        "locks": lambda li: plan.run(q, k, v, store, tables[li], seq, out=out),
        "dense_rows": lambda li: plan.run(q, k, v, store, tables[li], seq, out=out, sparse_lens=zero),
        "dense_splitk": lambda li: paged_decode(q, k, v, tables[li], seq, ident, workspace=dense_ws, out=out),
    }
    row = {"shape": shape, "context": ctx, "batch": bsz, "budget": cfg.budget, "block_table_pages": width,
           "layers": layers}
    for name, fn in ways.items():
        row[f"{name}_us"] = graph_us(fn, layers)
    ref = torch.empty_like(q)
    paged_decode(q, k, v, tables[0], seq, ident, out=ref)
    plan.run(q, k, v, store, tables[0], seq, out=out, sparse_lens=zero)
    row["dense_rows_max_abs_diff"] = float((out.float() - ref.float()).abs().max())
    del k, v, store
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", nargs="+", type=int, default=[8192, 16384, 32768, 65536])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=131072 // S + 8, help="block-table pages (a 131K engine's)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = LocksConfig(budget=2048)
    rows = []
    for shape in args.shapes:
        for ctx in args.contexts:
            for bsz in args.batches:
                row = one_case(shape, ctx, bsz, args.layers, args.width, cfg)
                rows.append(row)
                print(json.dumps(row), flush=True)
    commit = os.environ.get("KVLOCKS_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                 text=True).stdout.strip() or None
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit, "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "command": "python3 scripts/gpu/dense_rows.py " + " ".join(
                  f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()
                  if k != "out"), "rows": rows}
    (args.out / "dense_rows.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
