"""PNG figures of a fidelity run, made from its files (``summary.json``, ``share_scatter.json``,
``rows.jsonl``): ``python -c "from kvlocks_lab.fidelity.plots import plot_all; plot_all(Path(DIR))"``.

- ``share_scatter.png``: exact vs estimated page-mass share at matched bytes, page-local
  (LOCKS) vs per-sequence (ShadowKV scope), and global scopes;
- ``carrier_vs_budget.png``: carrier-page retention vs budget per selector (carrier-attending
  steps; relative to the exact selection; all steps);
- ``coverage_vs_budget.png``: mean coverage and worst-query-head coverage vs budget;
- ``error_ladder.png``: logit MAE, LSE MAE, Spearman and Kendall by scope at matched bytes;
- ``energy_scope.png``: within-page energy captured vs rank and vs bytes per page, per scope;
- ``eta_bound.png``: eta against its Eq. 7 bound, coverage retention against exp(-4 eta) (Eq. 8),
  output error against the Eq. 9 bound (unquantized summaries);
- ``quant_tails.png``: quantiles of the quantization log-mass error per precision (and per
  adaptive-precision variant, when one ran).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SCOPE_VARIANTS = (("global", "global (calib.)"), ("loki", "Loki (global PCA)"), ("shadowkv", "per-sequence"),
                  ("locks", "per-page int4"), ("locks_fp32", "per-page fp32"))
_STYLE = {"oracle": ("k", "--"), "oracle_per_head": ("0.4", ":"), "locks": ("tab:green", "-"),
          "quest": ("tab:red", "-"), "centroid": ("tab:brown", "-"), "shadowkv": ("tab:blue", "-"),
          "loki": ("tab:purple", "-"), "global": ("tab:cyan", "-"), "streaming": ("tab:gray", "-"),
          "random": ("tab:olive", "-"), "locks_fp32": ("tab:green", "--"), "locks_int2": ("tab:green", ":"),
          "locks_int8": ("tab:green", "-.")}
_MAIN = ("oracle", "oracle_per_head", "locks", "locks_int2", "quest", "centroid", "shadowkv", "loki", "global",
         "streaming", "random")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)


def plot_share_scatter(scatter: dict, summary: dict, out: Path) -> None:
    plt = _plt()
    names = [n for n in ("locks", "shadowkv", "global", "loki") if scatter.get(n)]
    if not names:
        return
    sel = summary["selectors"]
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.6), squeeze=False)
    for ax, n in zip(axes[0], names):
        pts = np.array([[a if a is not None else 0, b if b is not None else 0] for a, b in scatter[n]], dtype=float)
        ax.scatter(np.maximum(pts[:, 0], 1e-7), np.maximum(pts[:, 1], 1e-7), s=2, alpha=0.25, color=_STYLE[n][0])
        ax.plot([1e-7, 1], [1e-7, 1], "k-", lw=0.7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(1e-7, 1)
        ax.set_ylim(1e-7, 1)
        rho = sel.get(n, {}).get("scores", {}).get("spearman", {}).get("mean")
        label = dict(SCOPE_VARIANTS).get(n, n)
        ax.set_title(f"{label}, {sel.get(n, {}).get('bytes_per_page')} B/page\nSpearman {rho:.3f}" if rho is not None
                     else label, fontsize=9)
        ax.set_xlabel("exact page-mass share")
    axes[0][0].set_ylabel("estimated share")
    _save(fig, out / "share_scatter.png")


def _by_budget(summary: dict, field: str, names) -> tuple[list[int], dict]:
    budgets = [int(b) for b in summary["config"]["budgets"]]
    sel = summary["selectors"]
    return budgets, {n: [sel[n]["budgets"][str(b)].get(field) for b in budgets] for n in names if n in sel}


def _lines(ax, budgets, series, ylabel):
    for n, ys in series.items():
        if all(y is None for y in ys):
            continue
        color, ls = _STYLE.get(n, (None, "-"))
        ax.plot(budgets, [np.nan if y is None else y for y in ys], marker="o", ms=3, color=color, ls=ls, label=n)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget (tokens per layer and KV head)")
    ax.set_ylabel(ylabel)


def plot_by_budget(summary: dict, out: Path) -> None:
    plt = _plt()
    for fname, fields in (("carrier_vs_budget.png", (("carrier_hot", "carrier retention, carrier-attending steps"),
                                                     ("carrier_of_oracle", "carrier pages kept / kept by oracle"),
                                                     ("carrier", "carrier retention, all steps"))),
                          ("coverage_vs_budget.png", (("coverage", "mean coverage"),
                                                      ("coverage_worst_qhead", "worst query head coverage")))):
        fig, axes = plt.subplots(1, len(fields), figsize=(5 * len(fields), 4))
        for ax, (field, label) in zip(axes, fields):
            budgets, series = _by_budget(summary, field, _MAIN)
            _lines(ax, budgets, series, label)
        axes[-1].legend(fontsize=7, ncol=2)
        _save(fig, out / fname)


def plot_error_ladder(summary: dict, out: Path) -> None:
    plt = _plt()
    sel = summary["selectors"]
    present = [(n, label) for n, label in SCOPE_VARIANTS if n in sel]
    if not present:
        return
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
    for ax, field in zip(axes, ("logit_mae", "lse_mae", "spearman", "kendall")):
        vals = [sel[n]["scores"][field]["mean"] for n, _ in present]
        ax.bar(range(len(present)), [np.nan if v is None else v for v in vals],
               color=[_STYLE[n][0] for n, _ in present])
        ax.set_xticks(range(len(present)), [f"{lab}\n{sel[n]['bytes_per_page']} B" for n, lab in present],
                      fontsize=7, rotation=20)
        ax.set_title(field.replace("_", " "))
    _save(fig, out / "error_ladder.png")


def plot_energy(summary: dict, out: Path) -> None:
    plt = _plt()
    e = summary["energy"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    colors = {"page": "tab:green", "sequence": "tab:blue", "global": "tab:cyan"}
    for scope, curve in e["curves"].items():
        ranks = np.arange(1, len(curve) + 1)
        axes[0].plot(ranks, curve, marker=".", color=colors[scope], label=scope)
        axes[1].plot(e["bytes_per_page"][scope][: len(curve)], curve, marker=".", color=colors[scope], label=scope)
    axes[0].set_xlabel("rank r")
    axes[0].set_xlim(0, 32)
    axes[1].set_xlabel("summary bytes per page")
    m = e["matched"]
    axes[1].axvline(m["page"]["bytes_per_page"], color="k", lw=0.7, ls=":")
    for ax in axes:
        ax.set_ylabel("within-page key energy captured")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
    axes[1].set_title(f"matched bytes ({m['page']['bytes_per_page']} B): " + ", ".join(
        f"{s} {v['energy']:.2f}" for s, v in m.items()), fontsize=8)
    _save(fig, out / "energy_scope.png")


def _read_rows(path: Path, kinds) -> list[dict]:
    rows = []
    if path.is_file():
        with path.open() as fh:
            for line in fh:
                r = json.loads(line)
                if r["kind"] in kinds:
                    rows.append(r)
    return rows


def plot_eta(rows: list[dict], summary: dict, out: Path) -> None:
    plt = _plt()
    eta = np.array([x for r in rows if r["kind"] == "eta" for x in r["eta"]], dtype=float)
    eq7 = np.array([x for r in rows if r["kind"] == "eta" for x in r["eq7"]], dtype=float)
    if eta.size == 0:
        return
    budgets = summary["config"]["budgets"]
    b = budgets[len(budgets) // 2]
    at_b = [r for r in rows if r["kind"] == "retention" and r["budget"] == b]
    ratio = np.array([x for r in at_b for x in r["ratio"]], dtype=float)
    eq8 = np.array([x for r in at_b for x in r["eq8"]], dtype=float)
    err, eq9 = (np.array([x for r in at_b for x in r[f]], dtype=float) for f in ("out_err", "eq9"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    lo = max(1e-4, float(np.nanmin(eta[eta > 0])) if (eta > 0).any() else 1e-4)
    axes[0].scatter(eq7, np.maximum(eta, lo), s=2, alpha=0.3)
    hi = float(np.nanmax(eq7))
    axes[0].plot([lo, hi], [lo, hi], "k-", lw=0.7, label="eta = bound")
    axes[0].set_xscale("log")
    axes[0].set_yscale("log")
    axes[0].set_xlabel("Eq. 7 bound  max scale*||q_perp||*sqrt(tau)")
    axes[0].set_ylabel("eta (Eq. 6), unquantized summaries")
    axes[0].legend(fontsize=8)
    axes[1].scatter(eq8, ratio, s=2, alpha=0.3)
    axes[1].plot([0, 1], [0, 1], "k-", lw=0.7, label="retention = exp(-4 eta)")
    axes[1].set_xlabel("exp(-4 eta) (Eq. 8)")
    axes[1].set_ylabel(f"coverage retention vs exact selection, budget {b}")
    axes[1].legend(fontsize=8)
    axes[2].scatter(eq9, err, s=2, alpha=0.3)
    top = float(np.nanmax(eq9))
    axes[2].plot([0, top], [0, top], "k-", lw=0.7, label="error = bound")
    axes[2].set_xlabel("Eq. 9 bound 2R(1 - exp(-4 eta) gamma*)")
    axes[2].set_ylabel(f"group-mean ||o_S - o||, budget {b}")
    axes[2].legend(fontsize=8)
    _save(fig, out / "eta_bound.png")


def plot_quant(summary: dict, out: Path) -> None:
    plt = _plt()
    q = summary["quant_tails"]["quantiles"]
    base = ("fp32_vs_exact", "int8_vs_fp32", "int4_vs_fp32", "int2_vs_fp32", "int8_vs_exact", "int4_vs_exact",
            "int2_vs_exact")
    adapt = [k for k in q if k.startswith("adapt")]  # adaptive precision, after int4 of the same reference
    keys = [k for k in base[:4] if k in q] + [k for k in adapt if k.endswith("_vs_fp32")]
    keys += [k for k in base[4:] if k in q] + [k for k in adapt if k.endswith("_vs_exact")]
    if not keys:
        return
    fig, ax = plt.subplots(figsize=(max(10, 1.1 * len(keys)), 3.8))
    stats = ("median", "p95", "p99", "max")
    width = 0.8 / len(stats)
    for i, s in enumerate(stats):
        ax.bar(np.arange(len(keys)) + i * width, [max(q[k][s], 1e-6) for k in keys], width, label=s)
    labels = [k.replace("_vs_", "\nvs ").replace("_", " ") if len(keys) > 7 else k.replace("_", " ") for k in keys]
    ax.set_xticks(np.arange(len(keys)) + 0.4 - width / 2, labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("|log-mass error| (nats)")
    ax.legend(fontsize=8)
    _save(fig, out / "quant_tails.png")


def plot_all(out: Path) -> None:
    """Every figure from the files in ``out``."""
    summary = json.loads((out / "summary.json").read_text())
    scatter_path = out / "share_scatter.json"
    scatter = json.loads(scatter_path.read_text()) if scatter_path.is_file() else {}
    plot_share_scatter(scatter, summary, out)
    plot_by_budget(summary, out)
    plot_error_ladder(summary, out)
    plot_energy(summary, out)
    plot_eta(_read_rows(out / "rows.jsonl", ("eta", "retention")), summary, out)
    plot_quant(summary, out)
