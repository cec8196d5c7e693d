"""Score-kernel probe (issue 5): where does the time go, and does a leaner kernel stream faster?

Times, on one random llama3-8b- or glm4-9b-1m-shaped summary store (1M tokens, batch 1):

- ``cur``: the library's score kernel (autotuned), as ``kvlocks bench kernels`` runs it;
- ``load``: a load-only kernel with the same page-gathered access (every summary byte of BLOCK
  pages per step, summed into an integer): the bandwidth this access pattern can reach;
- ``packed``: the small-group kernel (:mod:`kvlocks.scoring.triton_packed`) at several launch shapes.

``--check`` runs the packed kernel against the torch reference at small sizes (CPU: set
``TRITON_INTERPRET=1``). ``--ncu NAME`` runs one launch of one variant for Nsight Compute.
Writes JSON lines to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from kvlocks_lab.bench.kernels import SHAPES, _random_store, copy_bandwidth
from kvlocks.config import LocksConfig


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


def _load_launch(store, table, hkv, pc, block, warps, ppp):
    n_chunks = -(-pc // ppp)
    out = torch.empty(hkv * n_chunks * block, device=table.device)
    i32 = lambda t: t.view(torch.int32)  # noqa: E731
    _load_kernel[(n_chunks, hkv)](i32(store.basis), store.basis_scale, i32(store.coef), store.coef_scale,
                                  i32(store.centroid), store.centroid_scale, table, out, hkv, pc, ppp,
                                  D=store.head_dim, S=store.page_size, R=store.rank, BLOCK=block, num_warps=warps)
    return out


def _time(fn, n_graph=20, replays=7):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n_graph):
            fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(replays):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n_graph)
    return statistics.median(ts)


def _shape(name):
    """A kernel-benchmark shape name, or ``HKV:G:D`` (e.g. ``32:1:128`` for multi-head attention)."""
    if name in SHAPES:
        return SHAPES[name][:3]
    try:
        hkv, g, d = (int(x) for x in name.split(":"))
    except ValueError:
        raise SystemExit(f"--shape {name!r}: allowed {sorted(SHAPES)} or HKV:G:D") from None
    return hkv, g, d


def _case(shape, n_tokens, device, seed=0):
    hkv, g, d = _shape(shape)
    lcfg = LocksConfig(page_size=16, budget=2048)
    pc = n_tokens // 16
    gen = torch.Generator(device=device).manual_seed(seed)
    store = _random_store(pc, hkv, d, lcfg, device, gen)
    perm = torch.randperm(pc, generator=gen, device=device).to(torch.int32)  # a scattered block table
    table = perm.view(1, pc)
    q = torch.empty(1, hkv * g, d, dtype=torch.bfloat16, device=device).normal_(generator=gen)
    seq = torch.tensor([n_tokens], dtype=torch.int32, device=device)
    return store, table, q, seq


def store_bytes(store) -> int:
    return sum(t.numel() * t.element_size() for t in (store.basis, store.basis_scale, store.coef, store.coef_scale,
                                                    store.centroid, store.centroid_scale))


def check() -> None:
    """The packed kernel (inline-PTX unpacking on CUDA) against the torch backend, small sizes."""
    from kvlocks.dispatch import score_pages
    from kvlocks.scoring import triton_packed

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bad = []
    for d in (64, 128):
        for g in (1, 2, 3, 4, 8, 16):
            for dt in (torch.bfloat16, torch.float32) + ((torch.float16,) if d == 128 else ()):
                for block, coef in [(b, c) for b in ((16, 32) if device.type == "cuda" else (8,))
                                    for c in ((2,) if g == 1 else (None,))]:
                    gen = torch.Generator(device=device).manual_seed(g * 100 + d)
                    hkv, pc = 2, 40
                    store = _random_store(pc * 2, hkv, d, LocksConfig(page_size=16, budget=256), device, gen)
                    table = torch.randperm(pc * 2, generator=gen, device=device).to(torch.int32).view(2, pc)
                    seq = torch.tensor([pc * 16, 16 * 23 + 5], dtype=torch.int32, device=device)
                    q = torch.empty(2, hkv * g, d, device=device).normal_(generator=gen).to(dt)
                    exp = score_pages(q, store, table, seq, backend="torch")
                    got = triton_packed.score_pages_packed(q, store, table, seq, launch={"BLOCK": block, "num_warps": 4},
                                                           coef=coef)
                    for b in range(2):
                        np_ = int(seq[b]) // 16
                        for name, x, y in zip(("scores", "lse", "ranking"), got, exp):
                            x, y = x[b, ..., :np_] if name != "lse" else x[b], y[b, ..., :np_] if name != "lse" else y[b]
                            err = (x - y).abs().max().item()
                            tol = 2e-3 if name != "ranking" else 2e-5
                            if not err <= tol:
                                bad.append((d, g, str(dt), block, coef, name, err))
                                print("FAIL", bad[-1], flush=True)
                    print(f"done d={d} g={g} {dt} block={block} coef={coef}", flush=True)
    print("FAILURES:", bad if bad else "none")
    assert not bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--ncu", default=None, help="cur | load | packed:BLOCK:WARPS:STAGES")
    ap.add_argument("--out", default="probe.jsonl")
    args = ap.parse_args()
    if args.check:
        check()
        return
    from kvlocks.scoring import triton as st
    from kvlocks.scoring import triton_packed

    device = torch.device("cuda")
    store, table, q, seq = _case(args.shape, args.tokens, device)
    hkv, g, d = _shape(args.shape)
    pc = args.tokens // 16
    nbytes = store_bytes(store)
    ws = st.score_workspace(1, hkv, g, pc, device)
    ws["kernel"] = "mma"  # "cur" = the three-dot kernel (the default for G > 4)
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def packed_fn(block, warps, stages, unpack=2, ppp=None, coef=3):
        launch = {"BLOCK": block, "num_warps": warps, "num_stages": stages}
        wsv = st.score_workspace(1, hkv, g, pc, device, ppp)
        return lambda: triton_packed.score_pages_packed(q, store, table, seq, launch=launch, workspace=wsv, unpack=unpack,
                                                    coef=coef)

    if args.ncu:
        name, *rest = args.ncu.split(":")
        if name == "cur":
            fn = lambda: st.score_pages_paged(q, store, table, seq, workspace=ws)  # noqa: E731
        elif name == "load":
            fn = lambda: _load_launch(store, table[0], hkv, pc, int(rest[0]), int(rest[1]), 512)  # noqa: E731
        else:
            fn = packed_fn(*map(int, rest))
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return
    copy = copy_bandwidth(device)
    rows = []

    def emit(**r):
        r.update(shape=args.shape, tokens=args.tokens, bytes=nbytes)
        r["gbps"] = nbytes / (r["us"] * 1e-6) / 1e9
        r["pct_copy"] = 100 * r["gbps"] / copy
        rows.append(r)
        print(json.dumps(r), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(r) + "\n")

    emit(name="cur", us=_time(lambda: st.score_pages_paged(q, store, table, seq, workspace=ws)),
         config=str(getattr(st._score_mma_tuned, "best_config", None)))
    # the reference result for the packed kernel's correctness at full size
    ref = [x.clone() for x in st.score_pages_paged(q, store, table, seq, workspace=ws)]
    for block in ():
        for warps in (4, 8):
            for ppp in (512,):
                try:
                    emit(name="load", block=block, warps=warps, ppp=ppp,
                         us=_time(lambda: _load_launch(store, table[0], hkv, pc, block, warps, ppp)))
                except Exception as e:  # noqa: BLE001
                    print("load failed", block, warps, e, file=sys.stderr)
    def ppp_for(programs, block):  # pages per program for about this many programs in all
        per_row = max(1, programs // hkv)
        return -(-(-(-pc // per_row)) // block) * block

    configs = [dict(coef=3, block=b, warps=w, stages=st) for b, w, st in
               ((16, 4, 1), (32, 4, 2), (16, 2, 2), (32, 4, 1), (16, 4, 2), (32, 8, 2), (8, 4, 1))]
    if g <= 4:
        configs += [dict(coef=2, block=b, warps=w, stages=2) for b, w in ((32, 4), (16, 4), (16, 2))]
    for c in configs:
        try:
            fn = packed_fn(**c)
            t0 = time.time()
            got = fn()
            errs = [(x[..., :pc] - y[..., :pc]).abs().max().item() for x, y in zip(got, ref)]
            emit(name="packed", **c, us=_time(fn), max_err=errs, compile_s=time.time() - t0)
        except Exception as e:  # noqa: BLE001
            print("packed failed", c, repr(e)[:300], file=sys.stderr)
    best = min((r for r in rows if r["name"] == "packed"), key=lambda r: r["us"], default=None)
    print("best packed:", best)


if __name__ == "__main__":
    main()
