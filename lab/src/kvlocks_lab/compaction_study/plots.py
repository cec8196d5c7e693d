"""PNG plots of the compaction study (matplotlib, headless), made from its result rows.

* ``fold_am_heatmap.png``: median over records of err(fold)/err(am) per layer x KV head, near
  and far, one row of panels per ratio (log colour scale centred on 1);
* ``qu_hist.png``: histogram of q.u - 1 on near and far queries;
* ``qu_per_layer.png``: mean q.u per layer, near and far (1 = the fold is exact on average);
* ``kl_settings.png``: mean KL to full per (task, ratio) for every method;
* ``fold_am_by_delta.png``: median fold/AM far-error ratio per distance bin.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heat_matrix(heads: list[dict], ratio: float, field: str) -> np.ndarray:
    """Median over records of fold/AM ``field`` per (head, layer): array [Hkv, layers]."""
    am = {(h["task"], h["length"], h["index"], h["layer"], h["head"]): h[field]
          for h in heads if h["method"] == "am" and h["ratio"] == ratio}
    vals = defaultdict(list)
    for h in heads:
        if h["method"] == "fold" and h["ratio"] == ratio:
            ref = am.get((h["task"], h["length"], h["index"], h["layer"], h["head"]))
            if ref and h[field] is not None:
                vals[(h["layer"], h["head"])].append(h[field] / ref)
    if not vals:
        return np.zeros((0, 0))
    layers = 1 + max(k[0] for k in vals)
    hkv = 1 + max(k[1] for k in vals)
    out = np.full((hkv, layers), np.nan)
    for (layer, head), v in vals.items():
        out[head, layer] = float(np.median(v))
    return out


def _heatmap(summary: dict, heads: list[dict], out: Path) -> None:
    from matplotlib.colors import LogNorm

    plt = _plt()
    ratios = sorted({h["ratio"] for h in heads})
    fields = ("err_near", "err_far")
    mats = {(r, f): heat_matrix(heads, r, f) for r in ratios for f in fields}
    logs = [np.abs(np.log(np.clip(m, 1e-6, None))) for m in mats.values() if m.size]
    # one symmetric log range around 1 for every panel: at least 0.95..1.05, at most 0.25..4
    spread = float(np.nanmax([np.nanmax(x) for x in logs])) if logs else np.log(1.05)
    spread = min(max(spread, np.log(1.05)), np.log(4.0))
    norm = LogNorm(vmin=np.exp(-spread), vmax=np.exp(spread))
    fig, axes = plt.subplots(len(ratios), 2, figsize=(12, 1.6 + 1.3 * len(ratios)), squeeze=False)
    for row, ratio in zip(axes, ratios):
        for ax, field in zip(row, fields):
            m = mats[(ratio, field)]
            if m.size == 0:
                continue
            im = ax.imshow(m, aspect="auto", cmap="RdBu_r", norm=norm)
            ax.set_title(f"median fold/AM {field.split('_')[1]} error, ratio {ratio}", fontsize=9)
            ax.set_xlabel("layer")
            ax.set_ylabel("KV head")
            ax.set_yticks(range(m.shape[0]))
            fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    fig.savefig(out / "fold_am_heatmap.png", dpi=90)
    plt.close(fig)


def _qu(summary: dict, out: Path) -> None:
    plt = _plt()
    hist = summary["aggregate"]["qu_minus_1"]["hist"]
    edges = np.asarray(hist["edges"])
    centres = (edges[:-1] + edges[1:]) / 2
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for where in ("near", "far"):
        counts = hist.get(where)
        if not counts:
            continue
        c = np.asarray(counts[1:-1], dtype=float)
        tail = counts[0] + counts[-1]
        ax.plot(centres, c / max(1.0, float(sum(counts))), drawstyle="steps-mid",
                label=f"{where} (outside [-1, 1]: {tail / max(1, sum(counts)):.1%})")
    ax.axvline(0, color="k", lw=0.6)
    ax.set_xlabel("q . u - 1")
    ax.set_ylabel("fraction of queries")
    ax.set_title("q . u - 1 over every (layer, KV head) and record", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "qu_hist.png", dpi=90)
    plt.close(fig)
    per = summary["aggregate"]["qu_minus_1"]["per_layer_mean_qu"]
    if per:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        for where in ("near", "far"):
            ax.plot([p["layer"] for p in per], [p[where] for p in per], marker="o", ms=3, label=where)
        ax.axhline(1, color="k", lw=0.6)
        ax.set_xlabel("layer")
        ax.set_ylabel("mean q . u (over heads, records)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "qu_per_layer.png", dpi=90)
        plt.close(fig)


def _kl(summary: dict, out: Path) -> None:
    plt = _plt()
    settings = summary["aggregate"]["kl"]["settings"]
    if not settings:
        return
    methods = [m for m in ("am", "rank1", "fold", "merge_fold", "drop_refit", "drop")
               if any(m in s for s in settings)]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(settings)), 3.6))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ys = [max(s.get(m) or 0.0, 1e-5) for s in settings]
        ax.bar(np.arange(len(settings)) + i * width, ys, width, label=m)
    ax.set_xticks(np.arange(len(settings)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{s['task']}\n{s['ratio']}" for s in settings], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("mean KL(full || method), nats")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out / "kl_settings.png", dpi=90)
    plt.close(fig)


def _delta(summary: dict, out: Path) -> None:
    plt = _plt()
    cells = summary["aggregate"]["ratio_vs_am"]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for ratio, cell in cells.items():
        bins = cell["fold_far_by_delta"]
        labels = [k for k, v in bins.items() if v is not None]
        ax.plot(labels, [bins[k] for k in labels], marker="o", label=f"ratio {ratio}")
    ax.axhline(1, color="k", lw=0.6)
    ax.set_xlabel("distance from the end of the context (tokens)")
    ax.set_ylabel("median err(fold) / err(am)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fold_am_by_delta.png", dpi=90)
    plt.close(fig)


def plot_all(summary: dict, heads: list[dict], out: Path) -> None:
    """Write every plot of the module docstring to ``out``."""
    out = Path(out)
    _heatmap(summary, heads, out)
    _qu(summary, out)
    _kl(summary, out)
    _delta(summary, out)
