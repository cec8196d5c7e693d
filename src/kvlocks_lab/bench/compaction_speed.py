"""Compaction speed on the CPU: the compaction library at another commit against this tree's.

``python -m kvlocks_lab.bench.compaction_speed --out DIR --before-rev REV [--tokens 1024]``

``--before-rev`` names a commit whose ``src/kvlocks/compaction`` is the "before" library (for
instance one that still solved the bias fit with scipy, run with each ``--before-solver``:
``lsq_linear``'s ``trf`` and/or ``bvls``); it is read with ``git show`` into a temporary package,
so both libraries run in one process on the same inputs. One bundled-model prefix of
``--tokens`` tokens is captured once (the reference passes of ``kvlocks compact``, timed per
pass). Then, for every layer and KV head, the default ``fold`` pipeline runs stage by stage with
each library: ``target`` (exact attention over the full cache), ``select`` (attention
selection), ``bias`` (partition targets, design and the box-constrained fit), ``fold``
(direction and folded keys) and ``values`` (refit). Each head records how the two agree (kept
positions, bias objective, beta, values) and the bias fit's solve alone on the same design
(``solve_only``: this tree's ``bounded_lstsq`` against ``scipy.optimize.lsq_linear``).
``--omp-heads`` heads also time OMP selection. Last, ``compact_layer`` of every layer runs
whole with each library (``layers_s``: what ``kvlocks compact`` spends after the capture).

Writes ``DIR/heads.jsonl`` (one record per head) and ``DIR/summary.json`` (date, commit, tree
state, machine, thread settings, versions, capture passes, per-stage totals, whole layers).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import kvlocks.compaction as after_lib
from kvlocks.compaction.solvers import bounded_lstsq

STAGES = ("target", "select", "bias", "fold", "values")
_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")  # scipy's BLAS threads
_REPO = Path(__file__).resolve().parents[3]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, check=True,
                          timeout=30).stdout


def library_at(rev: str):
    """``kvlocks.compaction`` as of commit ``rev``, imported as ``kvlocks_before.compaction``."""
    root = Path(tempfile.mkdtemp(prefix="kvlocks_before_"))
    pkg = root / "kvlocks_before" / "compaction"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    for path in _git("ls-tree", "--name-only", rev, "src/kvlocks/compaction/").split():
        (pkg / Path(path).name).write_text(_git("show", f"{rev}:{path}"))
    sys.path.insert(0, str(root))
    return importlib.import_module("kvlocks_before.compaction")


def _dirty() -> bool | None:
    """Whether the source tree has uncommitted changes (None: not a git checkout)."""
    try:
        return bool(_git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------- one head

def _clock(spent: dict, name: str, fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
    return out


def _path(lib, cfg, k, v, q, t, s) -> tuple[dict, dict]:
    """The ``fold`` pipeline of one head with library ``lib``: seconds per stage and outputs."""
    spent: dict = {}
    target, _ = _clock(spent, "target", lib.exact_attention, q, k, v, scale=s)
    idx = _clock(spent, "select", lib.select_keys, k, q, t, scale=s)
    beta = _clock(spent, "bias", lib.fit_bias, k, idx, q, scale=s, solver=cfg.bias_solver)
    start = time.perf_counter()
    u = lib.fold_direction(q, fold_lambda=cfg.fold_lambda)
    folded = lib.fold_keys(k[idx], beta, u, scale=s, round_dtype=cfg.round_dtype)
    spent["fold"] = time.perf_counter() - start
    vals = _clock(spent, "values", lib.refit_values, folded, q, target, scale=s, ridge=cfg.ridge)
    return spent, {"idx": idx, "beta": beta, "values": vals}


def _design(k, idx, q, s) -> torch.Tensor:
    z, shift = after_lib.partition_targets(k, q, scale=s)
    return after_lib.mass_design(k[idx], q, shift, scale=s) / z[:, None]  # [n, t] float64


def _solve_only(a: torch.Tensor, methods: tuple[str, ...]) -> dict:
    """Seconds of the bias fit's solve alone on one design [n, t]: torch and each scipy method."""
    from scipy.optimize import lsq_linear

    lo, hi = math.exp(-3.0), math.exp(3.0)
    start = time.perf_counter()
    bounded_lstsq(a, torch.ones(a.shape[0], dtype=torch.float64), lo, hi,
                  x0=torch.ones(a.shape[1], dtype=torch.float64))
    out = {"active_set": round(time.perf_counter() - start, 5)}
    for method in methods:
        start = time.perf_counter()
        lsq_linear(a.numpy(), np.ones(a.shape[0]), bounds=(lo, hi), method=method)
        out[method] = round(time.perf_counter() - start, 5)
    return out


def bench_head(before_lib, before_cfgs: dict, k, v, q, t, s) -> dict:
    """Both libraries on one head: stage seconds and agreement (``rel_obj``: bias objective of
    after minus before, relative; ``values_rel_diff``: largest value change over largest value)."""
    k, v = k.float(), v.float()
    spent, after = _path(after_lib, after_lib.CompactionConfig(), k, v, q, t, s)
    row: dict = {"after": {n: round(x, 5) for n, x in spent.items()}}
    a = _design(k, after["idx"], q, s)
    fa = float(((a @ after["beta"].double().exp() - 1.0) ** 2).sum())
    row["solve_only"] = _solve_only(a, tuple(before_cfgs))
    for name, cfg in before_cfgs.items():
        spent, old = _path(before_lib, cfg, k, v, q, t, s)
        same = torch.equal(after["idx"], old["idx"])
        rec: dict = {"s": {n: round(x, 5) for n, x in spent.items()}, "same_indices": same}
        if same:
            fb = float(((a @ old["beta"].double().exp() - 1.0) ** 2).sum())
            dv = (after["values"] - old["values"]).abs().max() / old["values"].abs().max().clamp_min(1e-30)
            rec.update(rel_obj=float(f"{(fa - fb) / max(fb, 1e-300):.3g}"),
                       max_dbeta=float(f"{(after['beta'] - old['beta']).abs().max():.3g}"),
                       values_rel_diff=float(f"{dv:.3g}"))
        row[f"before_{name}"] = rec
    return row


def bench_omp(before_lib, k, q, t, s) -> dict:
    k = k.float()
    start = time.perf_counter()
    new = after_lib.select_omp(k, q, t, scale=s)
    mid = time.perf_counter()
    old = before_lib.select_omp(k, q, t, scale=s)
    return {"t": t, "after_s": round(mid - start, 4), "before_s": round(time.perf_counter() - mid, 4),
            "same_indices": torch.equal(new, old)}


def bench_layers(lib, cfg, cap, t) -> float:
    """Seconds of ``compact_layer`` over every layer of the capture with library ``lib``."""
    start = time.perf_counter()
    for k, v, q, s in zip(cap.keys, cap.values, cap.queries, cap.scales):
        lib.compact_layer(k.float(), v.float(), q, t, cfg, scale=s)
    return round(time.perf_counter() - start, 3)


# ---------------------------------------------------------------- whole run

def _prefix(tok, tokens: int) -> torch.Tensor:
    from kvlocks.corpus import natural_units

    text = ""
    for unit in natural_units() * 4:
        text += unit
        if len(text) > 6 * tokens:
            break
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        raise ValueError(f"--tokens={tokens}: the corpus gives only {ids.shape[1]} tokens")
    return ids


def _capture(model, tok, ids, cfg):
    from kvlocks.compaction.capture import capture_queries
    from kvlocks.compaction.passes import ReferenceConfig, reference_passes

    marks: list[tuple[str, float]] = []
    cap = capture_queries(model, ids, reference_passes(tok, ids, ReferenceConfig()),
                          max_queries=cfg.max_queries, seed=cfg.seed,
                          progress=lambda name: marks.append((name, time.perf_counter())))
    ends = [m[1] for m in marks[1:]] + [marks[0][1] + cap.seconds]
    return cap, {name: round(end - at, 3) for (name, at), end in zip(marks, ends)}


def _totals(recs: list[dict]) -> dict:
    tot = {n: round(sum(r.get(n, 0.0) for r in recs), 3) for n in STAGES}
    tot["total"] = round(sum(tot.values()), 3)
    return tot


def _agreement(rows: list[dict], key: str) -> dict:
    recs = [r[key] for r in rows]
    worst = {name: max((r.get(name, 0.0) for r in recs), default=None)
             for name in ("rel_obj", "max_dbeta", "values_rel_diff")}
    return {"same_indices": all(r["same_indices"] for r in recs), "worst_rel_obj": worst["rel_obj"],
            "max_dbeta": worst["max_dbeta"], "max_values_rel_diff": worst["values_rel_diff"]}


def run(args) -> dict:
    from kvlocks.models import load
    from kvlocks_lab.compaction_study.summary import commit, versions

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before_lib = library_at(args.before_rev)
    before_cfgs = {m: before_lib.CompactionConfig(bias_solver=m) for m in args.before_solver}
    load_start = os.getloadavg()
    model, tok = load(args.model)
    cfg = after_lib.CompactionConfig(method="fold", ratio=args.ratio)
    cap, passes = _capture(model, tok, _prefix(tok, args.tokens), cfg)
    t = cfg.budget(cap.prefix_len)
    rows = []
    with open(out / "heads.jsonl", "w") as fh:
        for layer in range(len(cap.keys)) if args.layers is None else args.layers:
            for head in range(cap.keys[layer].shape[0]):
                k, v, q = cap.keys[layer][head], cap.values[layer][head], cap.queries[layer][head]
                row = {"layer": layer, "head": head, "T": cap.prefix_len, "t": t, "n": q.shape[0],
                       **bench_head(before_lib, before_cfgs, k, v, q, t, cap.scales[layer])}
                if len(rows) < args.omp_heads:
                    row["omp"] = bench_omp(before_lib, k, q, t, cap.scales[layer])
                rows.append(row)
                fh.write(json.dumps(row) + "\n")
                fh.flush()
    layers_s = {"after": bench_layers(after_lib, cfg, cap, t)}
    for name, bcfg in before_cfgs.items():
        layers_s[f"before_{name}"] = bench_layers(before_lib, bcfg, cap, t)
    after = _totals([r["after"] for r in rows])
    before = {m: _totals([r[f"before_{m}"]["s"] for r in rows]) for m in before_cfgs}
    summary = {
        "date": datetime.date.today().isoformat(), "commit": commit(), "tree_dirty": _dirty(),
        "before_rev": args.before_rev,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                    "thread_env": {k: os.environ.get(k) for k in _THREAD_ENV}},
        "versions": versions(), "args": vars(args), "config": json.loads(cfg.to_json()),
        "T": cap.prefix_len, "t": t, "n": int(cap.queries[0].shape[1]), "heads": len(rows),
        "capture_s": round(cap.seconds, 3), "capture_passes_s": passes,
        "after_s": after, "before_s": before,
        "speedup": {m: {n: round(b[n] / after[n], 2) if after[n] > 0 else None for n in b}
                    for m, b in before.items()},
        "solve_only_s": {m: round(sum(r["solve_only"][m] for r in rows), 3)
                         for m in ("active_set", *before_cfgs)},
        "layers_s": layers_s,
        "agreement": {m: _agreement(rows, f"before_{m}") for m in before_cfgs},
        "omp": [r["omp"] for r in rows if "omp" in r],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _solvers(text: str) -> tuple[str, ...]:
    names = tuple(x for x in text.split(",") if x)
    if not names or any(x not in ("trf", "bvls") for x in names):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of trf,bvls")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--before-rev", required=True,
                   help="git commit whose src/kvlocks/compaction is the before library")
    p.add_argument("--before-solver", type=_solvers, default=("trf",), metavar="trf,bvls",
                   help="bias solvers of the before library (its CompactionConfig.bias_solver)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=1024, help="prefix length T")
    p.add_argument("--ratio", type=float, default=0.1)
    p.add_argument("--layers", type=lambda x: [int(i) for i in x.split(",")], default=None,
                   help="comma-separated layers for the per-head stages (default: all)")
    p.add_argument("--omp-heads", type=int, default=1, help="heads that also time OMP selection")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a shared CPU: 1)")
    args = p.parse_args(argv)
    s = run(args)
    keys = ("T", "t", "n", "heads", "capture_s", "after_s", "before_s", "speedup", "solve_only_s",
            "layers_s", "agreement")
    print(json.dumps({k: s[k] for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
