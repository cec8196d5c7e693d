"""What the GPU probes share: CUDA-graph timing, a random summary store, a load-only bound.

The load-only kernel reads every summary byte of the pages a score launch reads, with the same
page-gathered access (block table, ``BLOCK`` pages per step), and sums them into an integer: the
bandwidth that access pattern can reach, the bound a score kernel is held against.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from kvlocks.cache.layout import SummaryStore
from kvlocks.config import LocksConfig
from kvlocks.plan import paged_build
from kvlocks_lab.bench.kernels import SHAPES, _random_store


@triton.jit
def _load_kernel(basis_ptr, bscale_ptr, coef_ptr, cscale_ptr, cen_ptr, censcale_ptr, bt_ptr, out_ptr, Hkv, pc,
                 pages_per_prog, D: tl.constexpr, S: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr):
    pid_c = tl.program_id(0)
    h = tl.program_id(1)
    start = pid_c * pages_per_prog
    end = tl.minimum(start + pages_per_prog, pc)
    pb = tl.arange(0, BLOCK)
    wb = tl.arange(0, R * D // 8)  # basis record as int32 words
    wc = tl.arange(0, S * R // 4)
    wm = tl.arange(0, D // 4)
    sr = tl.arange(0, R)
    ss = tl.arange(0, S)
    acc = tl.zeros([BLOCK], tl.int32)
    facc = tl.zeros([BLOCK], tl.float32)
    for p0 in range(start, end, BLOCK):
        p = p0 + pb
        pm = p < end
        ph = tl.load(bt_ptr + p, mask=pm, other=0).to(tl.int64) * Hkv + h
        x = tl.load(basis_ptr + ph[:, None] * (R * D // 8) + wb[None, :], mask=pm[:, None], other=0)
        y = tl.load(coef_ptr + ph[:, None] * (S * R // 4) + wc[None, :], mask=pm[:, None], other=0)
        z = tl.load(cen_ptr + ph[:, None] * (D // 4) + wm[None, :], mask=pm[:, None], other=0)
        acc += tl.sum(x, axis=1) + tl.sum(y, axis=1) + tl.sum(z, axis=1)
        f = tl.sum(tl.load(bscale_ptr + ph[:, None] * R + sr[None, :], mask=pm[:, None], other=0).to(tl.float32), 1)
        f += tl.sum(tl.load(cscale_ptr + ph[:, None] * S + ss[None, :], mask=pm[:, None], other=0).to(tl.float32), 1)
        facc += f + tl.load(censcale_ptr + ph, mask=pm, other=0).to(tl.float32)
    tl.store(out_ptr + (h * tl.num_programs(0) + pid_c) * BLOCK + pb, acc.to(tl.float32) + facc)


def load_only(store, table, hkv, pc, block, warps, ppp):
    """One load-only launch over ``pc`` pages of one sequence (``table`` ``[pc]`` int32), ``ppp``
    pages per program; returns its ``[Hkv * programs * BLOCK]`` float32 sums."""
    n_chunks = -(-pc // ppp)
    out = torch.empty(hkv * n_chunks * block, device=table.device)
    i32 = lambda t: t.view(torch.int32)  # noqa: E731
    _load_kernel[(n_chunks, hkv)](i32(store.basis), store.basis_scale, i32(store.coef), store.coef_scale,
                                  i32(store.centroid), store.centroid_scale, table, out, hkv, pc, ppp,
                                  D=store.head_dim, S=store.page_size, R=store.rank, BLOCK=block, num_warps=warps)
    return out


def capture_graph(fn, warm=None):
    """``warm`` (default ``fn``) run once (compiles the kernels) and once on a side stream, then
    ``fn`` captured in a CUDA graph."""
    warm = warm or fn
    warm()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        warm()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def replay_time(g, calls=1, replays=7):
    """Microseconds per call: the median of ``replays`` replays of graph ``g`` holding ``calls`` calls."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(replays):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(ts)


def graph_time(fn, n_graph=20, replays=7):
    """Microseconds per call of ``fn``: ``n_graph`` calls captured in one CUDA graph, median of
    ``replays`` replays (inputs stay where ``fn`` leaves them, e.g. in L2)."""
    return replay_time(capture_graph(lambda: [fn() for _ in range(n_graph)], warm=fn), n_graph, replays)


def paged_layers(hkv, g, d, ctx, bsz, layers, width, cfg, page_size=16):
    """``layers`` layers of a batch of ``bsz`` rows of ``ctx`` tokens over disjoint pages of one random
    bf16 paged cache (more bytes than the L2 holds), block tables ``width`` pages wide:
    ``(q [B, Hq, D], k, v [pages, S, Hkv, D], tables [layers] of [B, width] int32, store, seq [B] int32)``,
    the store's summaries built from the keys."""
    dev = torch.device("cuda")
    pages = -(-ctx // page_size)
    num_pages = layers * bsz * pages
    k = torch.randn(num_pages, page_size, hkv, d, device=dev, dtype=torch.bfloat16)
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
    return q, k, v, tables, store, seq


def add_layer_grid_args(ap, shapes, contexts):
    """The options of a one-layer-step grid (``dense_rows.py``, ``probes/conditional_step.py``)."""
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", nargs="+", type=int, default=contexts)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--shapes", nargs="+", default=list(shapes), choices=shapes)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=131072 // 16 + 8, help="block-table pages (a 131K engine's)")


def run_layer_grid(args, one_case) -> list[dict]:
    """``one_case(shape, context, batch, layers, width, LocksConfig(budget=2048))`` over the grid of
    ``args``, each row printed as it comes."""
    cfg = LocksConfig(budget=2048)
    rows = []
    for shape in args.shapes:
        for ctx in args.contexts:
            for bsz in args.batches:
                rows.append(one_case(shape, ctx, bsz, args.layers, args.width, cfg))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def write_result(path, rows: list[dict], **facts) -> None:
    """``path``: the rows with the date, commit (``KVLOCKS_COMMIT`` or git), GPU, torch, the command
    and ``facts``."""
    commit = os.environ.get("KVLOCKS_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                 text=True).stdout.strip() or None
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit, "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, **facts, "command": "python3 " + " ".join(sys.argv), "rows": rows}
    Path(path).write_text(json.dumps(result, indent=1))


def parse_shape(name):
    """A kernel-benchmark shape name, or ``HKV:G:D`` (e.g. ``32:1:128`` for multi-head attention)."""
    if name in SHAPES:
        return SHAPES[name][:3]
    try:
        hkv, g, d = (int(x) for x in name.split(":"))
    except ValueError:
        raise SystemExit(f"--shape {name!r}: allowed {sorted(SHAPES)} or HKV:G:D") from None
    return hkv, g, d


def random_case(shape, n_tokens, device, seed=0):
    """One sequence of ``n_tokens`` (full pages) at ``shape``: a random summary store ``[P, Hkv]``,
    a scattered block table ``[1, P]`` int32, bf16 queries ``[1, Hq, D]`` and lengths ``[1]`` int32."""
    hkv, g, d = parse_shape(shape)
    lcfg = LocksConfig(page_size=16, budget=2048)
    pc = n_tokens // 16
    gen = torch.Generator(device=device).manual_seed(seed)
    store = _random_store(pc, hkv, d, lcfg, device, gen)
    table = torch.randperm(pc, generator=gen, device=device).to(torch.int32).view(1, pc)
    q = torch.empty(1, hkv * g, d, dtype=torch.bfloat16, device=device).normal_(generator=gen)
    seq = torch.tensor([n_tokens], dtype=torch.int32, device=device)
    return store, table, q, seq


def store_bytes(store) -> int:
    """Bytes of every summary tensor of ``store`` (what one score launch over all pages reads)."""
    return sum(t.numel() * t.element_size() for t in (store.basis, store.basis_scale, store.coef, store.coef_scale,
                                                    store.centroid, store.centroid_scale))


def emit(path, row: dict) -> None:
    """Print ``row`` as one JSON line and append it to ``path``."""
    line = json.dumps(row)
    print(line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")
