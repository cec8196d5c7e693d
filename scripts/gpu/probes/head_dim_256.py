"""The decode kernels at head_dim 256 on the GPU: checked against the references, timed against D = 128.

Two Gemma 3 shapes at ``--tokens`` (default 32K), batch 1, bfloat16: ``gemma3-12b`` (Hkv = 8, G = 2)
and ``gemma3-270m`` (Hkv = 1, G = 4). For each, at D = 256:

- checks: the summary build (lean, the D = 256 default) against the float64 reference (relative
  reconstruction error, share of int4 basis values that differ); the page scores of the packed
  kernel (what ``"auto"`` runs at D = 256 on CUDA) and of the three-dot kernel against the torch
  backend; the decode plan's pages and output against the torch backend's (budget 2048); the dense
  split-KV attention against the torch backend; the exact re-rank's pages against the PyTorch re-rank;
- timings (CUDA graphs, median of replays), at D = 256 and at D = 128 on the same shape: the bulk
  build of the layer's pages (lean, fixed launches) and the packed score kernel at each D = 256
  launch and at D = 128's best (H200: 32 pages, 4 warps, 2 stages) on the first shape; on both, the
  decode plan's whole step with the packed score kernel and the dense attention at the default
  launch and at 8 pages / 8 warps / 2 stages.

One JSON file: ``OUT/head_dim_256.json`` (``checks``, ``timings_us``, ``ok``, device and versions).
Without a GPU it runs in the Triton interpreter (a smoke test at small ``--tokens``; timings are
single wall-clock calls there).

    python3 scripts/gpu/probes/head_dim_256.py --out $OUT
    TRITON_INTERPRET=1 python3 scripts/gpu/probes/head_dim_256.py --out /tmp/d256 --tokens 300
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402

from kvlocks.attention import triton as attn_tri  # noqa: E402
from kvlocks.cache.layout import SummaryStore  # noqa: E402
from kvlocks.config import DenseLaunch, KernelOptions, LocksConfig  # noqa: E402
from kvlocks.plan import DecodePlan, paged_build, paged_decode, paged_score, paged_select  # noqa: E402
from kvlocks.scoring import triton as score_tri  # noqa: E402
from kvlocks.scoring import triton_packed  # noqa: E402
from kvlocks.selection.rerank_paged import paged_rerank  # noqa: E402
from kvlocks.selection.triton_rerank import rerank_pages  # noqa: E402
from kvlocks.summary import triton as build_tri  # noqa: E402

import common  # noqa: E402  (scripts/gpu/probes/common.py: CUDA-graph timing)

SHAPES = {"gemma3-12b": (8, 2), "gemma3-270m": (1, 4)}
S = 16
PACKED = KernelOptions(score_kernel="packed")


def graph_time(fn, n_graph=10, replays=5) -> float:
    """Microseconds per call: ``n_graph`` calls in one CUDA graph, median of ``replays`` replays
    (:func:`common.graph_time`); on the CPU, one call's wall clock."""
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return round((time.perf_counter() - t) * 1e6, 1)
    return round(common.graph_time(fn, n_graph=n_graph, replays=replays), 2)


def case(hkv, g, d, n, seed=0):
    """A scattered paged cache of one sequence of ``n`` tokens: q ``[1, Hq, D]``, K/V, table, seq_lens."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    pages = -(-n // S)
    k = torch.randn(pages + 3, S, hkv, d, device=DEV, generator=gen).to(torch.bfloat16)
    v = torch.randn(pages + 3, S, hkv, d, device=DEV, generator=gen).to(torch.bfloat16)
    k += torch.randn(pages + 3, 1, hkv, d, device=DEV, generator=gen).to(torch.bfloat16)  # pages differ
    q = (torch.randn(1, hkv * g, d, device=DEV, generator=gen) * 1.5).to(torch.bfloat16)
    table = torch.randperm(pages + 3, device=DEV, generator=gen)[:pages].to(torch.int32).view(1, pages)
    return q, k, v, table, torch.tensor([n], dtype=torch.int32, device=DEV)


def int4(packed):
    q = packed.to(torch.int32)
    return torch.stack((((q & 15) ^ 8) - 8, ((q >> 4) ^ 8) - 8), -1).flatten(-2)


def checks(hkv, g, n, cfg) -> dict:
    """D = 256 kernels against the references on one shape."""
    d = 256
    q, k, v, table, seq = case(hkv, g, d, n)
    full = table[0, : n // S].contiguous()
    ref = SummaryStore.empty(k.shape[0], hkv, d, cfg, device=DEV)
    paged_build(k, ref, full, cfg, backend="torch")
    got = SummaryStore.empty(k.shape[0], hkv, d, cfg, device=DEV)
    build_tri.build_pages(k, got, full, solver="lean", launch={"BP": 1, "num_warps": 1})  # not the tuner's 5 compiles
    ids = full.long()
    rg, rr = got.gather(ids), ref.gather(ids)
    recon = [s.centroid_float()[..., None, :] + s.coef_float() @ s.basis_float() for s in (rg, rr)]
    keys = k[ids].float().permute(0, 2, 1, 3)
    sign = torch.where((rg.basis_float() * rr.basis_float()).sum(-1) < 0, -1, 1)
    out = {"build_recon_rel_err": float((recon[0] - recon[1]).norm() / keys.norm()),
           "build_int4_flip_share": float((int4(rg.basis) != sign[..., None] * int4(rr.basis)).float().mean())}
    want = paged_score(q, ref, table, seq, backend="torch")
    pc = n // S
    mma_launch = {"BLOCK": 16, "num_warps": 8, "num_stages": 2}  # one compile, not the tuner's four
    for name, opts, launch in (("packed", PACKED, None), ("mma", KernelOptions(score_kernel="mma"), mma_launch)):
        sc = score_tri.score_pages_paged(q, ref, table, seq, options=opts, launch=launch)
        scale = max(1.0, float(want[0][..., :pc].abs().max()))
        out[f"score_{name}_max_err"] = float((sc[0][..., :pc] - want[0][..., :pc]).abs().max()) / scale
        out[f"score_{name}_lse_max_err"] = float((sc[1] - want[1]).abs().max())
    kw = dict(batch=1, num_kv_heads=hkv, group=g, head_dim=d, max_pages=table.shape[1], config=cfg,
              dtype=q.dtype, device=DEV)
    tri, tor = DecodePlan(**kw), DecodePlan(backend="torch", **kw)
    o_t, l_t = tri.run(q, k, v, ref, table, seq)
    o_r, l_r = tor.run(q, k, v, ref, table, seq)
    out["plan_pages_equal"] = bool(torch.equal(tri.pages, tor.pages))
    out["plan_out_max_err"] = float((o_t.float() - o_r.float()).abs().max())
    out["plan_lse_max_err"] = float((l_t - l_r).abs().max())
    dense = attn_tri.identity_pages(1, hkv, table.shape[1], DEV)
    a_t = paged_decode(q, k, v, table, seq, dense, backend="triton")
    a_r = paged_decode(q, k, v, table, seq, dense, backend="torch")
    out["dense_out_max_err"] = float((a_t[0].float() - a_r[0].float()).abs().max())
    out["dense_lse_max_err"] = float((a_t[1] - a_r[1]).abs().max())
    rcfg = LocksConfig(budget=cfg.budget, rerank=4)
    width = table.shape[1]
    kc = min(width, rcfg.rerank_candidates(width) + rcfg.sink_pages + rcfg.recent_pages)
    sel = dict(page_size=S, sink_pages=rcfg.sink_pages, recent_pages=rcfg.recent_pages, backend="torch")
    cand = paged_select(want[2], seq, k=kc, **sel).contiguous()
    exp = paged_select(paged_rerank(q, k, table, seq, want[0], rcfg, scale=d ** -0.5), seq, k=rcfg.pages_per_step,
                       **sel)
    got_pages = rerank_pages(q, k, table, seq, want[0], want[1], cand, rcfg, scale=d ** -0.5)
    out["rerank_pages_equal"] = bool(torch.equal(got_pages, exp))
    out["ok"] = bool(out["build_recon_rel_err"] < 4e-3 and out["build_int4_flip_share"] < 2e-3
                     and max(out["score_packed_max_err"], out["score_mma_max_err"]) < 1e-3
                     and max(out["score_packed_lse_max_err"], out["score_mma_lse_max_err"]) < 1e-2
                     and out["plan_pages_equal"] and out["plan_out_max_err"] < 3e-2 and out["dense_out_max_err"] < 3e-2
                     and out["rerank_pages_equal"])
    return out


def timings(hkv, g, d, n, cfg, full_grid: bool) -> dict:
    """Microseconds per launch (per layer) of the D = ``d`` kernels on one shape; ``full_grid``:
    also the build and the packed score launches (every one at D = 256: one compile each)."""
    q, k, v, table, seq = case(hkv, g, d, n, seed=1)
    full = table[0, : n // S].contiguous()
    store = SummaryStore.empty(k.shape[0], hkv, d, cfg, device=DEV)
    out = {}
    builds = ([(1, 1), (1, 2)] if d == 256 else [(1, 1)]) if full_grid else []
    for bp, w in builds:
        launch = {"BP": bp, "num_warps": w}
        out[f"build_lean_bp{bp}_w{w}"] = graph_time(
            lambda launch=launch: build_tri.build_pages(k, store, full, solver="lean", launch=launch), 3, 3)
    packed = (list(triton_packed._PACKED_CONFIGS_256) if d == 256
              else [triton.Config({"BLOCK": 32}, num_warps=4, num_stages=2)]) if full_grid else []
    ws = score_tri.score_workspace(1, hkv, g, table.shape[1], DEV, head_dim=256)
    for c in packed:
        launch = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
        label = f"score_packed_b{c.kwargs['BLOCK']}_w{c.num_warps}_s{c.num_stages}"
        out[label] = graph_time(lambda launch=launch: triton_packed.score_pages_packed(
            q, store, table, seq, launch=launch, workspace=ws, rank=False))
    plan = DecodePlan(batch=1, num_kv_heads=hkv, group=g, head_dim=d, max_pages=table.shape[1], config=cfg,
                      dtype=q.dtype, device=DEV, options=PACKED)
    build_tri.build_pages(k, store, full, solver="lean", launch={"BP": 1, "num_warps": 1})
    out["plan_step_packed_scores"] = graph_time(lambda: plan.run(q, k, v, store, table, seq))
    dense = attn_tri.identity_pages(1, hkv, table.shape[1], DEV)
    for launch in (DenseLaunch(), DenseLaunch(8, 8, 2)):
        aws = attn_tri.attention_workspace(1, hkv * g, d, table.shape[1], hkv, q.dtype, DEV, launch=launch)
        out[f"dense_{launch.label()}"] = graph_time(
            lambda aws=aws: attn_tri.paged_decode(q, k, v, table, seq, dense, workspace=aws))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    cfg = LocksConfig(budget=2048)
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (Triton interpreter)",
           "torch": torch.__version__, "triton": triton.__version__, "tokens": args.tokens, "budget": cfg.budget, "checks": {}, "timings_us": {}}
    t0 = time.time()
    Path(args.out).mkdir(parents=True, exist_ok=True)

    def save():  # after every stage, so a run cut short keeps what it measured
        res["ok"] = bool(res["checks"]) and all(c["ok"] for c in res["checks"].values())
        res["seconds"] = round(time.time() - t0, 1)
        (Path(args.out) / "head_dim_256.json").write_text(json.dumps(res, indent=1))

    for i, name in enumerate(args.shapes.split(",")):
        hkv, g = SHAPES[name]
        res["checks"][name] = checks(hkv, g, args.tokens, cfg)
        print(name, "checks", json.dumps(res["checks"][name]), f"{time.time() - t0:.0f} s", flush=True)
        save()
        for d in (256, 128):
            res["timings_us"][f"{name}/D{d}"] = timings(hkv, g, d, args.tokens, cfg, full_grid=i == 0)
            print(name, d, json.dumps(res["timings_us"][f"{name}/D{d}"]), f"{time.time() - t0:.0f} s", flush=True)
            save()
    print("ok" if res["ok"] else "FAILED", res["seconds"], "s")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
