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
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from kvlocks.attention.triton import attention_workspace, identity_pages, paged_decode
from kvlocks.cache.layout import SummaryStore
from kvlocks.config import LocksConfig
from kvlocks.plan import DecodePlan, paged_build

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


def capture(fn):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def replay_us(g, layers: int, replays: int = 20) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(replays):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / layers)
    return statistics.median(ts)


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
    dev = torch.device("cuda")
    pages = -(-ctx // S)
    num_pages = layers * bsz * pages
    k = torch.randn(num_pages, S, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(bsz, hkv * g, d, device=dev, dtype=torch.bfloat16)
    tables = []
    for li in range(layers):
        t = torch.zeros(bsz, width, dtype=torch.int32, device=dev)
        t[:, :pages] = (li * bsz * pages + torch.arange(bsz * pages, device=dev, dtype=torch.int32)).view(bsz, pages)
        tables.append(t)
    store = SummaryStore.empty(num_pages, hkv, d, cfg, device=dev)
    paged_build(k, store, torch.arange(num_pages, device=dev, dtype=torch.int32), cfg)
    seq = torch.full((bsz,), ctx, dtype=torch.int32, device=dev)
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
            graphs[name] = capture(fn)
        except Exception as e:  # noqa: BLE001 - the probe reports what fails
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
    if "cond" not in graphs:
        return row
    row["flash_us"] = replay_us(graphs["flash"], layers)
    row["locks_us"] = replay_us(graphs["locks"], layers)
    flips = []
    for side in ("flash", "locks", "flash", "locks"):
        use_flash.fill_(side == "flash")
        use_locks.fill_(side == "locks")
        outs["cond"].zero_()
        graphs["cond"].replay()
        graphs[side].replay()
        torch.cuda.synchronize()
        flips.append(bool(torch.equal(outs["cond"], outs[side])))
        row[f"cond_{side}_us"] = replay_us(graphs["cond"], layers)
    row["cond_matches"] = flips
    both_off = torch.zeros_like(use_flash)
    use_flash.copy_(both_off)
    use_locks.copy_(both_off)
    row["cond_none_us"] = replay_us(graphs["cond"], layers)
    del k, v, store
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", nargs="+", type=int, default=[8192, 131072])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=131072 // S + 8, help="block-table pages (a 131K engine's)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    api = hasattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph") and hasattr(
        torch._C._CUDAGraph, "begin_capture_to_if_node")
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "if_node_api": api}), flush=True)
    rows = []
    if api:
        cfg = LocksConfig(budget=2048)
        for shape in args.shapes:
            for ctx in args.contexts:
                for bsz in args.batches:
                    row = one_case(shape, ctx, bsz, args.layers, args.width, cfg)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    commit = os.environ.get("KVLOCKS_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                 text=True).stdout.strip() or None
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit, "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "if_node_api": api, "command": "python3 " + " ".join(sys.argv),
              "rows": rows}
    (args.out / "conditional_step.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
