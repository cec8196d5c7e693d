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
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "probes"))
from common import add_layer_grid_args, graph_time, paged_layers, run_layer_grid, write_result  # noqa: E402

from kvlocks.attention.triton import attention_workspace, identity_pages, paged_decode  # noqa: E402
from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.plan import DecodePlan  # noqa: E402

SHAPES = {"glm4-9b-1m": (2, 16, 128), "llama3.1-8b": (8, 4, 128)}
S = 16


def graph_us(fn, layers: int) -> float:
    """Microseconds per layer step: ``fn(layer)`` for every layer, captured in one CUDA graph."""
    return graph_time(lambda: [fn(li) for li in range(layers)], n_graph=1, replays=20) / layers


def one_case(shape: str, ctx: int, bsz: int, layers: int, width: int, cfg: LocksConfig) -> dict:
    hkv, g, d = SHAPES[shape]
    q, k, v, tables, store, seq = paged_layers(hkv, g, d, ctx, bsz, layers, width, cfg, S)
    dev = q.device
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
    add_layer_grid_args(ap, SHAPES, [8192, 16384, 32768, 65536])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_result(args.out / "dense_rows.json", run_layer_grid(args, one_case))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
