"""The CUDA score kernel (``scoring/score_mma.cu``): correctness against the torch reference, then speed.

``--check``: :func:`kvlocks.scoring.cuda_mma.score_pages_mma` against the torch backend for D 64/128,
G 1-16, float16/bfloat16 queries, a partial last page, queries far outside float16's range (with
the scale undoing it), logits large enough to take the kernel's exact (max-subtracted) path, and
launches whose warp runs end inside a tile or whose programs lie past the last page. Exit status 1
on any failure. ``--time``: at each of ``--tokens`` (batch 1) for both benchmark shapes, the CUDA
kernel, the packed Triton kernel, the combine pass alone and the load-only bound
(``common.load_only``), CUDA-graph replayed, against the copy bandwidth measured in the same run.
``--ncu SHAPE``: three launches at the first of ``--tokens``, for Nsight Compute
(``ncu -k regex:score_kernel python3 ...``). JSON lines to ``--out``.

    python3 scripts/gpu/probes/score_cuda.py --check --time --out OUT/score_cuda.jsonl
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import emit, graph_time, load_only, random_case, store_bytes

from kvlocks.config import KernelOptions, LocksConfig
from kvlocks.plan import paged_score
from kvlocks.scoring import cuda_mma
from kvlocks.scoring import triton as st
from kvlocks.scoring.triton_combine import combine_launch
from kvlocks_lab.bench.kernels import SHAPES, _random_store, copy_bandwidth


def _err(got, exp, seq, s=16):
    """Largest error of (scores, lse, ranking) over each sequence's full pages, relative to max(1, |ref|)."""
    worst = 0.0
    for b in range(len(seq)):
        pc = int(seq[b]) // s
        for name, x, y in zip(("scores", "lse", "ranking"), got, exp):
            xb, yb = (x[b], y[b]) if name == "lse" else (x[b, ..., :pc], y[b, ..., :pc])
            if xb.numel():
                worst = max(worst, float((xb - yb).abs().max()) / max(1.0, float(yb.abs().max())))
    return worst


def check() -> int:
    dev = torch.device("cuda")
    print("library:", cuda_mma.unavailable_reason(dev) or "ok", flush=True)
    fails = 0
    for d in (64, 128):
        for g in (1, 2, 3, 4, 8, 12, 16):
            for dt in (torch.bfloat16, torch.float16):
                for factor, scale in ((1.0, None), (1e4, 1e-4), (1e-6, 1e6), (40.0, None)):
                    gen = torch.Generator(device=dev).manual_seed(g * 100 + d)
                    hkv, pc = 3, 77
                    store = _random_store(pc * 2 + 5, hkv, d, LocksConfig(page_size=16, budget=256), dev, gen)
                    table = torch.randperm(pc * 2 + 5, generator=gen, device=dev)[: 2 * pc].to(torch.int32).view(2, pc)
                    seq = torch.tensor([pc * 16, 16 * 23 + 5], dtype=torch.int32, device=dev)
                    q = (torch.empty(2, hkv * g, d, device=dev).normal_(generator=gen) * factor).to(dt)
                    exp = paged_score(q, store, table, seq, backend="torch", scale=scale)
                    err = _err(cuda_mma.score_pages_mma(q, store, table, seq, scale=scale), exp, seq)
                    fails += not err <= 1e-4
                    print(f"{'ok  ' if err <= 1e-4 else 'FAIL'} d={d} g={g} {dt} q*{factor:g}: rel err {err:.2e}",
                          flush=True)
    for ppp in (16, 48, 112, 336, 1024):  # warp runs ending inside a tile, programs past the last page
        gen = torch.Generator(device=dev).manual_seed(ppp)
        hkv, pc, g, d = 2, 300, 8, 128
        store = _random_store(pc * 2, hkv, d, LocksConfig(page_size=16, budget=256), dev, gen)
        table = torch.randperm(pc * 2, generator=gen, device=dev).to(torch.int32).view(2, pc)
        seq = torch.tensor([pc * 16 - 3, 16 * 201], dtype=torch.int32, device=dev)
        q = torch.empty(2, hkv * g, d, device=dev).normal_(generator=gen).to(torch.bfloat16)
        exp = paged_score(q, store, table, seq, backend="torch")
        ws = st.score_workspace(2, hkv, g, pc, dev, pages_per_program=ppp)
        err = _err(cuda_mma.score_pages_mma(q, store, table, seq, workspace=ws), exp, seq)
        fails += not err <= 1e-4
        print(f"{'ok  ' if err <= 1e-4 else 'FAIL'} ppp={ppp}: rel err {err:.2e}", flush=True)
    print("FAILURES:", fails)
    return fails


def time_shapes(tokens: int, out: str) -> None:
    dev = torch.device("cuda")
    copy = copy_bandwidth(dev)
    for shape in ("llama3-8b", "glm4-9b-1m"):
        store, table, q, seq = random_case(shape, tokens, dev)
        hkv, g, d = SHAPES[shape][:3]
        pc = tokens // 16
        nbytes = store_bytes(store)

        def row(**r):
            r.update(shape=shape, tokens=tokens, bytes=nbytes, copy_gbps=copy)
            r["gbps"] = nbytes / (r["us"] * 1e-6) / 1e9
            r["pct_copy"] = 100 * r["gbps"] / copy
            emit(out, r)

        ws_t = st.score_workspace(1, hkv, g, pc, dev)
        packed = KernelOptions(score_kernel="packed")
        ref = [x.clone() for x in st.score_pages_paged(q, store, table, seq, workspace=ws_t, options=packed)]
        row(name="triton_packed", us=graph_time(lambda: st.score_pages_paged(q, store, table, seq, workspace=ws_t,
                                                                              options=packed)))
        ws = st.score_workspace(1, hkv, g, pc, dev)
        fn = lambda: cuda_mma.score_pages_mma(q, store, table, seq, workspace=ws)  # noqa: E731
        errs = [float((x[..., :pc] - y[..., :pc]).abs().max()) for x, y in zip(fn(), ref)]
        row(name="cuda_mma", ppp=ws.ppp, us=graph_time(fn), max_err_vs_packed=errs)
        row(name="combine_only", us=graph_time(lambda: combine_launch(ws, seq, hkv, g, pc, 16, "mean_share")))
        row(name="load_only", us=graph_time(lambda: load_only(store, table[0], hkv, pc, 16, 4, 512)))


def ncu_target(shape: str, tokens: int) -> None:
    dev = torch.device("cuda")
    store, table, q, seq = random_case(shape, tokens, dev)
    ws = st.score_workspace(1, SHAPES[shape][0], SHAPES[shape][1], tokens // 16, dev)
    for _ in range(3):
        cuda_mma.score_pages_mma(q, store, table, seq, workspace=ws)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="against the torch reference (exit 1 on failure)")
    ap.add_argument("--time", action="store_true", help="speed against the packed kernel and the load-only bound")
    ap.add_argument("--tokens", default=str(1 << 20), help="context(s) timed, comma-separated")
    ap.add_argument("--out", default="score_cuda.jsonl")
    ap.add_argument("--ncu", default=None, metavar="SHAPE", help=f"three launches at one of {sorted(SHAPES)}")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.ncu:
        ncu_target(args.ncu, tokens[0])
        return
    fails = check() if args.check else 0
    if args.time:
        for t in tokens:
            time_shapes(t, args.out)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
