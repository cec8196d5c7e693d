"""How many Jacobi sweeps the summary-build kernel needs, by what LOCKS uses the summaries for.

The Triton build (:mod:`kvlocks.summary.triton`) runs ``SWEEPS`` = 5 parallel-Jacobi sweeps on each
page's 16 x 16 Gram matrix, and the sweeps are most of the build's time. The basis is then stored in int4, so the
question is not how close the eigenvectors are to float64 ones but whether fewer sweeps change
what the summaries are used for. This runs the kernel in the Triton interpreter (CPU) at several
sweep counts on

- real post-RoPE keys and decode-time queries of the bundled model (SmolLM2-135M, D = 64), a
  text prompt, several layers;
- synthetic D = 128 pages: Gaussian keys (flat spectrum, the slowest case for Jacobi) and
  low-rank-plus-noise keys,

and reports per sweep count: the quantized reconstruction's error against the keys (relative to
the centred keys' norm), its difference from the 5-sweep build, the Eq. 4 page scores' mean
absolute error against the exact per-page log-sum-exp, and the overlap of the top-k pages (per
query head) with the 5-sweep build's and with the exact ranking's. JSON to ``--out``.

    TRITON_INTERPRET=1 .venv/bin/python scripts/analysis/build_sweeps.py --out DIR/build_sweeps.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import torch  # noqa: E402

from kvlocks.cache.layout import SummaryStore  # noqa: E402
from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.scoring.reference import exact_page_lse, score_pages_from_summaries  # noqa: E402
from kvlocks.summary import triton as build_tri  # noqa: E402

S = 16


def _build(keys: torch.Tensor, sweeps: int, cfg: LocksConfig, solver: str = "lean"):
    """keys ``[Hkv, N, D]`` -> reference-layout summaries ``[Hkv, P, ...]`` built by the kernel."""
    hkv, n, d = keys.shape
    p = n // S
    cache = keys.reshape(hkv, p, S, d).permute(1, 2, 0, 3).contiguous()  # [P, S, Hkv, D]
    store = SummaryStore.empty(p, hkv, d, cfg)
    ids = torch.arange(p, dtype=torch.int32)
    build_tri.build_pages(cache, store, ids, sweeps=sweeps, launch={"BP": 16, "num_warps": 4},  # per-item results do not depend on BP
                          solver=solver)
    return store.gather(ids)


def _recon(s) -> torch.Tensor:
    return s.centroid_float()[..., None, :] + s.coef_float() @ s.basis_float()  # [Hkv, P, S, D]


def _topk_overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    """Mean |top-k(a) & top-k(b)| / k over the leading dims of ``[..., P]`` scores."""
    ta = a.topk(k, dim=-1).indices
    tb = b.topk(k, dim=-1).indices
    same = (ta.unsqueeze(-1) == tb.unsqueeze(-2)).any(-1).float().sum(-1) / k
    return float(same.mean())


def study(name: str, keys: torch.Tensor, queries: torch.Tensor, scale: float, sweeps: list[int], k: int,
          solvers: tuple[str, ...] = ("lean",)) -> list[dict]:
    """keys ``[Hkv, N, D]``, queries ``[Hkv, G, D]`` (one decode step's heads) -> one row per
    (solver, sweep count); "vs_5" compares with the lean solver at 5 sweeps, "vs_float64" with
    the reference build (float64 eigendecomposition, :mod:`kvlocks.summary.build`)."""
    from kvlocks.summary.build import build_summaries

    cfg = LocksConfig()
    hkv, n, d = keys.shape
    pages = keys.reshape(hkv, n // S, S, d)
    centred = pages - pages.mean(dim=-2, keepdim=True)
    exact = exact_page_lse(queries, keys, S, scale=scale)  # [Hkv, G, P]
    built = {}
    for sol in solvers:
        for sw in sorted(set(sweeps) | ({5} if sol == "lean" else set())):
            t0 = time.perf_counter()
            built[sol, sw] = (_build(keys, sw, cfg, sol), time.perf_counter() - t0)
    if ("lean", 5) not in built:
        built["lean", 5] = (_build(keys, 5, cfg), 0.0)
    ref_rec = _recon(built["lean", 5][0])
    ref_scores = score_pages_from_summaries(queries, built["lean", 5][0], scale=scale)
    f64_rec = _recon(build_summaries(pages.double(), cfg)).float()
    rows = []
    for sol, sw in [(r, w) for r in solvers for w in sweeps]:
        s, secs = built[sol, sw]
        rec = _recon(s)
        scores = score_pages_from_summaries(queries, s, scale=scale)
        rows.append({
            "case": name, "solver": sol, "sweeps": sw, "pages": hkv * (n // S), "head_dim": d,
            "recon_err_vs_keys": float((rec - pages).norm() / centred.norm()),
            "recon_diff_vs_5": float((rec - ref_rec).norm() / centred.norm()),
            "recon_diff_vs_float64": float((rec - f64_rec).norm() / centred.norm()),
            "score_mae_vs_exact": float((scores - exact).abs().mean()),
            "score_max_diff_vs_5": float((scores - ref_scores).abs().max()),
            f"top{k}_overlap_vs_5": _topk_overlap(scores, ref_scores, k),
            f"top{k}_overlap_vs_exact": _topk_overlap(scores, exact, k),
            "interpreter_s": round(secs, 1),
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def real_cases(layers: list[int], tokens: int) -> list[tuple]:
    from kvlocks_lab.fidelity.capture import capture_prompt
    from kvlocks_lab.fidelity.prompts import text_prompt
    from kvlocks.models import load

    model, tok = load("smollm2-135m")
    prompt = text_prompt(tok, length=tokens, queries=4, page_size=S, index=0, seed=0)
    cap = capture_prompt(model, prompt, queries=4, page_size=S)
    out = []
    for i in layers:
        keys, _, queries, scale = cap.layer(i)  # queries [Hkv, Q, G, D]
        out.append((f"smollm2-135m layer {i}", keys, queries[:, -1], scale))
    return out


def synthetic_cases(pages: int, seed: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    d, hkv, g = 128, 2, 4
    gauss = torch.randn(hkv, pages * S, d, generator=gen)
    basis = torch.linalg.qr(torch.randn(hkv, pages, d, 6, generator=gen)).Q.transpose(-1, -2)  # [Hkv, P, 6, D]
    coef = torch.randn(hkv, pages, S, 6, generator=gen) * torch.tensor([8.0, 6, 4, 3, 2, 1.5])
    low = (coef @ basis + 0.3 * torch.randn(hkv, pages, S, d, generator=gen)).reshape(hkv, pages * S, d)
    q = torch.randn(hkv, g, d, generator=gen) * 1.5
    return [("gaussian D=128", gauss, q, d ** -0.5), ("rank-6 + noise D=128", low, q, d ** -0.5)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweeps", default="3,4,5")
    ap.add_argument("--layers", default="0,7,15,22,29")
    ap.add_argument("--tokens", type=int, default=1024, help="real prompt's prefix tokens (bundled model)")
    ap.add_argument("--synthetic-pages", type=int, default=96)
    ap.add_argument("--k", type=int, default=8, help="pages in the top-k overlap")
    ap.add_argument("--solvers", default="lean", help="comma-separated build solvers: lean, onesided")
    ap.add_argument("--no-real", action="store_true", help="synthetic pages only (no bundled model)")
    args = ap.parse_args()
    sweeps = [int(x) for x in args.sweeps.split(",")]
    rows = []
    cases = synthetic_cases(args.synthetic_pages, 0)
    if not args.no_real:
        cases += real_cases([int(x) for x in args.layers.split(",")], args.tokens)
    solvers = tuple(args.solvers.split(","))
    for name, keys, queries, scale in cases:
        rows += study(name, keys.float().contiguous(), queries.float().contiguous(), scale, sweeps, args.k,
                      solvers)
    with open(args.out, "w") as f:
        flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                 for k, v in vars(args).items() if k != "out" and v is not False]
        json.dump({"command": "scripts/analysis/build_sweeps.py " + " ".join(flags), "rows": rows}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
