"""One layer's decode step chosen on the device at graph replay: CUDA-graph conditional nodes.

vLLM replays one full CUDA graph per batch size for decode. A step short enough that FlashAttention
beats the LOCKS chain should run FlashAttention alone; a longer one the chain alone. Both are captured
into the same graph, each inside an IF node whose predicate (a device scalar written before the
replay) says which runs; this probe checks that it works and what it costs:

- ``flash``: FlashAttention 3 (``vllm.vllm_flash_attn``; kvlocks' dense split-KV kernel when vLLM is
  not importable) over every page;
- ``locks``: ``DecodePlan.run`` (score, selection, attention; PDL launches);
- ``cond_flash`` / ``cond_locks``: ``if (use_flash) flash; if (use_locks) locks`` with the predicate
  on either side, one graph, the predicate flipped between replays.

Checks: each conditional replay's output equals the plain path's (bitwise), after the predicate is
flipped back and forth. Times: microseconds per layer, ``--layers`` layers per graph over disjoint
pages. Writes ``OUT/conditional_step.json``.

    python3 scripts/gpu/probes/conditional_step.py --out OUT [--contexts 8192 131072] [--batches 1 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_layer_grid_args, capture_graph, paged_layers, replay_time, run_layer_grid, write_result,
)

from kvlocks.attention.triton import attention_workspace, identity_pages, paged_decode  # noqa: E402
from kvlocks.plan import DecodePlan  # noqa: E402

SHAPES = {"glm4-9b-1m": (2, 16, 128), "llama3.1-8b": (8, 4, 128)}
S = 16


@contextmanager
def if_node(pred: torch.Tensor):
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    graph.begin_capture_to_if_node(pred)
    try:
        yield
    finally:
        graph.end_capture_to_conditional_node()


def flash_fn(q, k, v, table, seq, out, width, scale):
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        ident = identity_pages(q.shape[0], k.shape[2], width, q.device)
        ws = attention_workspace(q.shape[0], q.shape[1], q.shape[2], width, q.shape[0] * k.shape[2], q.dtype,
                                 q.device)
        return "kvlocks_splitk", lambda: paged_decode(q, k, v, table, seq, ident, workspace=ws, out=out)
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)

    def run():
        flash_attn_varlen_func(q=q, k=k, v=v, out=out, cu_seqlens_q=qsl, max_seqlen_q=1, seqused_k=seq,
                               max_seqlen_k=width * S, softmax_scale=scale, causal=True, window_size=[-1, -1],
                               block_table=table, softcap=0.0, scheduler_metadata=None, fa_version=3,
                               num_splits=32)
    return "fa3", run


def one_case(shape, ctx, bsz, layers, width, cfg):
    hkv, g, d = SHAPES[shape]
    q, k, v, tables, store, seq = paged_layers(hkv, g, d, ctx, bsz, layers, width, cfg, S)
    dev = q.device
    plan = DecodePlan(batch=bsz, num_kv_heads=hkv, group=g, head_dim=d, max_pages=width, config=cfg,
                      dtype=q.dtype, device=dev)
    outs = {name: torch.zeros_like(q) for name in ("flash", "locks", "cond")}
    flashes = [flash_fn(q, k, v, tables[li], seq, outs["flash"], width, d ** -0.5) for li in range(layers)]
    flashes_c = [flash_fn(q, k, v, tables[li], seq, outs["cond"], width, d ** -0.5) for li in range(layers)]
    use_flash = torch.ones((), dtype=torch.bool, device=dev)
    use_locks = torch.zeros((), dtype=torch.bool, device=dev)

    def flash():
        for li in range(layers):
            flashes[li][1]()

    def locks():
        for li in range(layers):
            plan.run(q, k, v, store, tables[li], seq, out=outs["locks"])

    def cond():
        for li in range(layers):
            if torch.cuda.is_current_stream_capturing():
                with if_node(use_flash):
                    flashes_c[li][1]()
                with if_node(use_locks):
                    plan.run(q, k, v, store, tables[li], seq, out=outs["cond"])
            else:  # warm-up outside the capture: both sides
                flashes_c[li][1]()
                plan.run(q, k, v, store, tables[li], seq, out=outs["cond"])

    row = {"shape": shape, "context": ctx, "batch": bsz, "layers": layers, "flash_kernel": flashes[0][0]}
    graphs = {}
    for name, fn in (("flash", flash), ("locks", locks), ("cond", cond)):
        try:
            graphs[name] = capture_graph(fn)
        except Exception as e:  # noqa: BLE001 - the probe reports what fails
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
    if "cond" not in graphs:
        return row
    row["flash_us"] = replay_time(graphs["flash"], layers, 20)
    row["locks_us"] = replay_time(graphs["locks"], layers, 20)
    flips = []
    for side in ("flash", "locks", "flash", "locks"):
        use_flash.fill_(side == "flash")
        use_locks.fill_(side == "locks")
        outs["cond"].zero_()
        graphs["cond"].replay()
        graphs[side].replay()
        torch.cuda.synchronize()
        flips.append(bool(torch.equal(outs["cond"], outs[side])))
        row[f"cond_{side}_us"] = replay_time(graphs["cond"], layers, 20)
    row["cond_matches"] = flips
    both_off = torch.zeros_like(use_flash)
    use_flash.copy_(both_off)
    use_locks.copy_(both_off)
    row["cond_none_us"] = replay_time(graphs["cond"], layers, 20)
    del k, v, store
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_layer_grid_args(ap, SHAPES, [8192, 131072])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    api = hasattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph") and hasattr(
        torch._C._CUDAGraph, "begin_capture_to_if_node")
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "if_node_api": api}), flush=True)
    rows = run_layer_grid(args, one_case) if api else []
    write_result(args.out / "conditional_step.json", rows, if_node_api=api)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
