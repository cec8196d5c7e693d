"""CUDA score kernel probe (issue 5): correctness against the torch reference, then speed at 1M.

``--check``: :mod:`kvlocks.scoring.cuda_mma` against the torch backend for D 64/128, G 1-16,
float16/bfloat16 queries, a partial last page, queries far outside float16's range and logits
large enough to take the kernel's exact (max-subtracted) path. ``--time``: at ``--tokens`` (batch 1)
for both benchmark shapes, the CUDA kernel (warps per block 2/4/8), the Triton packed kernel (the
previous default) and the load-only kernel of ``score_probe.py``, graph-replayed, against the
copy bandwidth measured in the same run. JSON lines to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvlocks_lab.bench.kernels import SHAPES, _random_store, copy_bandwidth
from kvlocks.config import LocksConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from score_probe import _case, _load_launch, _time, store_bytes  # noqa: E402


def _err(got, exp, seq, s=16):
    worst = 0.0
    for b in range(len(seq)):
        pc = int(seq[b]) // s
        for name, x, y in zip(("scores", "lse", "ranking"), got, exp):
            xb, yb = (x[b], y[b]) if name == "lse" else (x[b, ..., :pc], y[b, ..., :pc])
            if xb.numel():
                scale = max(1.0, float(yb.abs().max()))
                worst = max(worst, float((xb - yb).abs().max()) / scale)
    return worst


def check(warps: int = 4) -> int:
    from kvlocks.dispatch import score_pages
    from kvlocks.scoring import cuda_mma

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
                    exp = score_pages(q, store, table, seq, backend="torch", scale=scale)
                    try:
                        got = cuda_mma.score_pages_mma(q, store, table, seq, scale=scale, warps=warps)
                    except RuntimeError as exc:  # a (D, G) this source does not compile at `warps`
                        if "unsupported" not in str(exc):
                            raise
                        print(f"SKIP d={d} g={g}: not compiled at {warps} warps", flush=True)
                        continue
                    err = _err(got, exp, seq)
                    ok = err <= 1e-4
                    fails += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} d={d} g={g} {dt} q*{factor:g}: rel err {err:.2e}", flush=True)
    # warp runs that end inside a tile, several tiles per warp, programs past the last page
    from kvlocks.scoring import triton as st

    for ppp in (16, 48, 112, 336, 1024):
        gen = torch.Generator(device=dev).manual_seed(ppp)
        hkv, pc, g, d = 2, 300, 8, 128
        store = _random_store(pc * 2, hkv, d, LocksConfig(page_size=16, budget=256), dev, gen)
        table = torch.randperm(pc * 2, generator=gen, device=dev).to(torch.int32).view(2, pc)
        seq = torch.tensor([pc * 16 - 3, 16 * 201], dtype=torch.int32, device=dev)
        q = torch.empty(2, hkv * g, d, device=dev).normal_(generator=gen).to(torch.bfloat16)
        exp = score_pages(q, store, table, seq, backend="torch")
        ws = st.score_workspace(2, hkv, g, pc, dev, pages_per_program=ppp)
        err = _err(cuda_mma.score_pages_mma(q, store, table, seq, workspace=ws, warps=warps), exp, seq)
        fails += not err <= 1e-4
        print(f"{'ok  ' if err <= 1e-4 else 'FAIL'} ppp={ppp}: rel err {err:.2e}", flush=True)
    print("FAILURES:", fails)
    return fails


def time_shapes(tokens: int, out: str, sources: list[tuple[str, str, int]] | None = None, reps: int = 1) -> None:
    """``sources``: (label, path, warps per block) of CUDA sources to time side by side (default: the
    library's at 4 warps)."""
    from kvlocks.scoring import cuda_mma
    from kvlocks.scoring import triton as st

    default_source = cuda_mma.SOURCE
    sources = sources or [("library", str(default_source), 4)]

    dev = torch.device("cuda")
    copy = copy_bandwidth(dev)
    for shape in ("llama3-8b", "glm4-9b-1m"):
        store, table, q, seq = _case(shape, tokens, dev)
        hkv, g, d = SHAPES[shape][:3]
        pc = tokens // 16
        nbytes = store_bytes(store)

        def emit(**r):
            r.update(shape=shape, tokens=tokens, bytes=nbytes, copy_gbps=copy)
            r["gbps"] = nbytes / (r["us"] * 1e-6) / 1e9
            r["pct_copy"] = 100 * r["gbps"] / copy
            print(json.dumps(r), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(r) + "\n")

        ws_t = st.score_workspace(1, hkv, g, pc, dev)
        ws_t["kernel"] = "packed"
        ref = [x.clone() for x in st.score_pages_paged(q, store, table, seq, workspace=ws_t)]
        emit(name="triton_packed", us=_time(lambda: st.score_pages_paged(q, store, table, seq, workspace=ws_t)))
        for rep in range(reps):  # sources interleaved: A B A B ...
            for label, path, warps in sources:
                cuda_mma.SOURCE = Path(path)
                # launch sized from this source's own resident blocks per SM (a variant's may differ)
                ppp = cuda_mma.pages_per_program(pc, hkv, dev, d, g, warps)
                ws = st.score_workspace(1, hkv, g, pc, dev, pages_per_program=ppp)
                fn = lambda: cuda_mma.score_pages_mma(q, store, table, seq, workspace=ws, warps=warps)  # noqa: E731
                got = fn()
                errs = [float((x[..., :pc] - y[..., :pc]).abs().max()) for x, y in zip(got, ref)]
                emit(name="cuda_mma", source=label, rep=rep, warps=warps, ppp=ppp, us=_time(fn),
                     max_err_vs_triton=errs)
        cuda_mma.SOURCE = default_source
        emit(name="combine_only", us=_time(lambda: st._combine_launch(ws, seq, hkv, g, pc, 16, "mean_share")))
        emit(name="load_only", us=_time(lambda: _load_launch(store, table[0], hkv, pc, 16, 4, 512)))


def ncu_target(spec: str, tokens: int) -> None:
    from kvlocks.scoring import cuda_mma
    from kvlocks.scoring import triton as st

    shape, warps = spec.split(":")
    dev = torch.device("cuda")
    store, table, q, seq = _case(shape, tokens, dev)
    hkv, g, d = SHAPES[shape][:3]
    pc = tokens // 16
    ws = st.score_workspace(1, hkv, g, pc, dev, pages_per_program=cuda_mma.pages_per_program(pc, hkv, dev, d, g, int(warps)))
    for _ in range(3):
        cuda_mma.score_pages_mma(q, store, table, seq, workspace=ws, warps=int(warps))
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--tokens", default=str(1 << 20), help="context(s) timed, comma-separated")
    ap.add_argument("--out", default="mma_probe.jsonl")
    ap.add_argument("--sources", default=None,
                    help="LABEL=PATH[@WARPS],...: CUDA score sources checked, and timed side by side, "
                         "interleaved, at WARPS warps per block (default 4; default source: the library's)")
    ap.add_argument("--reps", type=int, default=1, help="rounds of the interleaved --sources timings")
    ap.add_argument("--ncu", default=None, help="SHAPE:WARPS: three launches of the CUDA kernel, for Nsight Compute")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.ncu:
        ncu_target(args.ncu, tokens[0])
        return
    sources = None
    if args.sources:
        sources = []
        for item in args.sources.split(","):
            label, path = item.split("=", 1)
            path, _, warps = path.partition("@")
            sources.append((label, path, int(warps or 4)))
    fails = 0
    if args.check:  # every source against the torch reference
        from kvlocks.scoring import cuda_mma

        default_source = cuda_mma.SOURCE
        for label, path, warps in sources or [("library", str(default_source), 4)]:
            print("source:", label, "warps:", warps, flush=True)
            cuda_mma.SOURCE = Path(path)
            fails += check(warps)
        cuda_mma.SOURCE = default_source
    if args.time:
        for t in tokens:
            time_shapes(t, args.out, sources, args.reps)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
