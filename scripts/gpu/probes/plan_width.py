"""Where a wide block table costs a LOCKS decode step: the score kernel, the fused selection and the
attention timed apart, at several block-table widths and selection chunk sizes.

    python3 scripts/gpu/probes/plan_width.py --out DIR [--widths 2056 8200 65544] [--contexts 32768 1048576]
        [--batches 1 4] [--chunks 0 512 1024 2048 4096] [--short-pages 2056 5120 8200]
        [--shapes glm4-9b-1m llama3.1-8b]

vLLM sizes kvlocks' plans by its block table (``max_model_len`` / 16 pages), so a 32K row in a 1M
engine runs launches chosen for 1M rows (docs/results/2026-12-07-h100-plan-width/). For each shape,
width, context (at most the width's tokens) and batch: ``score`` (the score kernel alone, the
plan's workspace), ``score_select`` (then the fused selection), ``step`` (``DecodePlan.run``), each
with the selection's pages per program as the plan chooses them (chunk 0) and as given by
``--chunks``, and with the plan's chunk plus a second selection launch for short rows
(``--short-pages``, ``KernelOptions.short_row_pages``; left out at widths where it would not
split). Times: one CUDA-graph replay of ``--layers`` layer steps over disjoint pages, divided by
the layers. Writes ``DIR/plan_width.json`` (rows, date, commit, GPU); every variant's
pages are checked equal to the plan's own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_time, paged_layers, write_result  # noqa: E402

from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.plan import DecodePlan  # noqa: E402
from kvlocks.scoring.triton import score_pages_paged  # noqa: E402
from kvlocks.selection.fused import fused_workspace, rank_and_select  # noqa: E402

SHAPES = {"glm4-9b-1m": (2, 16, 128), "llama3.1-8b": (8, 4, 128)}
MAX_KV_BYTES = 40e9


def one_case(shape, ctx, bsz, width, chunks, shorts, layers, cfg) -> list[dict]:
    hkv, g, d = SHAPES[shape]
    q, k, v, tables, store, seq = paged_layers(hkv, g, d, ctx, bsz, layers, width, cfg)
    plan = DecodePlan(batch=bsz, num_kv_heads=hkv, group=g, head_dim=d, max_pages=width, config=cfg,
                      dtype=q.dtype, device=q.device)
    out = torch.empty_like(q)
    c = cfg

    def score(li):
        score_pages_paged(q, store, tables[li], seq, scale=plan.scale, combine=c.combine, workspace=plan.score_ws,
                          rank=False, options=plan.options)

    plan.run(q, k, v, store, tables[0], seq, out=out)
    ref_pages = plan.pages.clone()
    rows = []
    default_ws = plan.select_ws
    variants = [(chunk, 0) for chunk in chunks] + [(0, n) for n in shorts if n]
    for chunk, short in variants:
        ws = default_ws if chunk == 0 and not short else fused_workspace(
            bsz, hkv, width, plan.k, q.device, chunk=chunk or None, short_pages=short)
        if short and ws.short is None:  # no second launch at this width: the plan's own row
            continue

        def select(li, ws=ws):
            score(li)
            return rank_and_select(plan.score_ws, seq, page_size=c.page_size, k=plan.k, combine=c.combine,
                                   sink_pages=c.sink_pages, recent_pages=c.recent_pages, workspace=ws,
                                   options=plan.options)

        plan.select_ws = ws
        plan.run(q, k, v, store, tables[0], seq, out=out)
        same = bool(torch.equal(plan.pages, ref_pages))
        row = {"shape": shape, "context": ctx, "batch": bsz, "width": width, "chunk": chunk or ws.chunk,
               "plan_chunk": chunk == 0, "select_programs": ws.n_chunks, "score_programs": plan.score_ws.n_chunks,
               "short_pages": ws.short_pages, "short_chunk": ws.short.chunk if ws.short else None,
               "pages_equal_plan": same}
        for name, fn in (("score", score), ("score_select", select),
                         ("step", lambda li: plan.run(q, k, v, store, tables[li], seq, out=out))):
            row[f"{name}_us"] = graph_time(lambda fn=fn: [fn(li) for li in range(layers)], n_graph=1,
                                           replays=20) / layers
        rows.append(row)
        print(row, flush=True)
    plan.select_ws = default_ws
    del k, v, store
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--widths", nargs="+", type=int, default=[2056, 8200, 65544])
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768, 1048576])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--chunks", nargs="+", type=int, default=[0, 512, 1024, 2048, 4096],
                    help="selection pages per program (0: the plan's own choice)")
    ap.add_argument("--short-pages", nargs="*", type=int, default=[2056, 5120, 8200],
                    help="also the plan's chunk with a second selection launch for rows of at most this many pages "
                         "(KernelOptions.short_row_pages; none where it would not differ)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    cfg = LocksConfig(budget=2048)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes:
        for width in args.widths:
            for ctx in args.contexts:
                if -(-ctx // cfg.page_size) > width:
                    continue
                for bsz in args.batches:
                    hkv, _, d = SHAPES[shape]
                    if 4 * args.layers * bsz * ctx * hkv * d > MAX_KV_BYTES:  # K and V, bf16
                        print(f"skipped {shape} {ctx} x {bsz}: its K/V exceed {MAX_KV_BYTES / 1e9:.0f} GB", flush=True)
                        continue
                    rows += one_case(shape, ctx, bsz, width, args.chunks, args.short_pages, args.layers, cfg)
                    write_result(args.out / "plan_width.json", rows)  # after each case: a cut-off run keeps its rows
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
