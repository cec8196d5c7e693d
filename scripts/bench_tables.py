"""Markdown tables from benchmark result files (used for docs/benchmarks.md and the README).

    python scripts/bench_tables.py kernels docs/results/bench_kernels.json
    python scripts/bench_tables.py e2e docs/results/bench_e2e.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def _fmt(x, nd=1):
    return "" if x is None else f"{x:.{nd}f}"


def kernels_table(summary: dict) -> str:
    cells = defaultdict(dict)
    for r in summary["rows"]:
        cells[(r["shape"], r["context"], r["batch"])][r["method"]] = r
    head = ("| shape | context | B | dense_splitk µs (% copy) | locks_score µs (% copy) | select µs | "
            "attend µs (% copy) | locks_total µs | dense / total | build, whole model s |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (shape, ctx, b), m in cells.items():
        def t(name):
            return m.get(name, {}).get("time_us")

        def pc(name):
            return m.get(name, {}).get("pct_copy_bw")
        # the fastest dense measured (dense_splitk is the tuned launch; files from before the tuner
        # timed an 8-page, 8-warp launch as x_splitk_ppi8_nw8)
        dense = min(x for x in (t("dense_splitk"), t("dense_sdpa"), t("x_splitk_ppi8_nw8"), t("x_splitk_default")) if x)
        build = t("build")
        lines.append(
            f"| {shape} | {ctx // 1024}K | {b} | {_fmt(t('dense_splitk'))} ({_fmt(pc('dense_splitk'), 0)}%) | "
            f"{_fmt(t('locks_score'))} ({_fmt(pc('locks_score'), 1)}%) | {_fmt(t('locks_select'))} | "
            f"{_fmt(t('locks_attend'))} ({_fmt(pc('locks_attend'), 0)}%) | {_fmt(t('locks_total'))} | "
            f"{dense / t('locks_total'):.2f}x | {'' if build is None else f'{build / 1e6:.2f}'} |")
    return "\n".join(lines)


def e2e_table(summary: dict) -> str:
    lines = ["| model | context | B | method | TPOT ms | floor ms | TPOT / floor | vs dense | TTFT ms | build ms "
             "(exposed) | bytes/step GB | GPU GB |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        sp = r.get("speedup_vs_dense")
        exposed = r.get("build_exposed_ms")
        build = _fmt(r.get("build_ms"), 0) + ("" if exposed is None else f" ({exposed:.0f})")
        lines.append(
            f"| {r['model']} | {r['context'] // 1024}K | {r['batch']} | {r['method']} | {_fmt(r['tpot_ms'], 2)} | "
            f"{_fmt(r['floor_ms'], 2)} | {_fmt(r.get('tpot_over_floor'), 2)} | {'' if sp is None else f'{sp:.2f}x'} | "
            f"{_fmt(r.get('ttft_ms'), 0)} | {build} | {r['bytes_per_step'] / 1e9:.1f} | "
            f"{_fmt(r.get('gpu_mem_gb'), 1)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    tables = {"kernels": kernels_table, "e2e": e2e_table}
    ap = argparse.ArgumentParser(description="Markdown table from a kvlocks bench result file")
    ap.add_argument("kind", choices=sorted(tables), help="which benchmark wrote the file")
    ap.add_argument("path", help="the result file (bench_kernels.json or bench_e2e.json)")
    args = ap.parse_args()
    with open(args.path) as f:
        print(tables[args.kind](json.load(f)))
