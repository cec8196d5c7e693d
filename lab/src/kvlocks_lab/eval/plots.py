"""PNG plots of task-suite results (matplotlib, headless).

Selectors are lines over their budgets; a compaction method (``fold@0.1``) has no budget and is
drawn as one marker per length at x = the mean entries it kept per layer and KV head, the
compacted cache's counterpart of a budget.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def _avg(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def method_colors(cells) -> dict:
    """One colour per method of ``cells`` (sorted names, matplotlib's default cycle), so a method
    has the same colour in every panel even where a panel lacks some methods."""
    import matplotlib.pyplot as plt

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {m: cycle[i % len(cycle)] for i, m in enumerate(sorted({c["method"] for c in cells}))}


def _panel(ax, cells, length, field, log, colors):
    """One length: selector lines over budgets, compaction markers at their kept entries."""
    here = [c for c in cells if c["length"] == length and c.get(field) is not None]
    selectors = sorted({c["method"] for c in here if c["budget"] is not None})
    for m in selectors:
        budgets = sorted({c["budget"] for c in here if c["method"] == m})
        ys = [_avg([c[field] for c in here if c["method"] == m and c["budget"] == b]) for b in budgets]
        ax.plot(budgets, [max(y, 1e-6) for y in ys] if log else ys, marker="o", label=m, color=colors[m])
    for m in sorted({c["method"] for c in here if c.get("kept") is not None and c["budget"] is None}):
        cs = [c for c in here if c["method"] == m]
        y = _avg([c[field] for c in cs])
        ax.plot([_avg([c["kept"] for c in cs])], [max(y, 1e-6) if log else y], marker="s", ls="none", label=m,
                color=colors[m])
    ax.set_xscale("log", base=2)
    if log:
        ax.set_yscale("log")
    ax.set_title(f"L={length}")
    ax.set_xlabel("budget / kept entries (per layer and KV head)")


def vs_budget_figure(cells, field: str, ylabel: str, *, log: bool, ref=None):
    """The figure of :func:`_vs_budget` (None without cells): one panel per length, every method in
    its own colour in all panels, one legend naming every method drawn."""
    import matplotlib.pyplot as plt

    lengths = sorted({c["length"] for c in cells})
    if not lengths:
        return None
    colors = method_colors(cells)
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.6), squeeze=False)
    legend = {}
    for ax, length in zip(axes[0], lengths):
        _panel(ax, cells, length, field, log, colors)
        if ref is not None:
            y = ref(length)
            if y is not None:
                ax.axhline(y, color="k", ls="--", label="full")
        ax.set_ylabel(ylabel)
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    axes[0][0].legend(list(legend.values()), list(legend), fontsize=7)
    fig.tight_layout()
    return fig


def _vs_budget(cells, out: Path, field: str, fname: str, ylabel: str, *, log: bool, ref=None) -> None:
    import matplotlib.pyplot as plt

    fig = vs_budget_figure(cells, field, ylabel, log=log, ref=ref)
    if fig is not None:
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)


def _depth_heatmap(rows, cells, out: Path) -> None:
    import matplotlib.pyplot as plt

    lengths = sorted({c["length"] for c in cells})
    budgets = sorted({c["budget"] for c in cells if c["budget"] is not None})
    b0 = 256 if 256 in budgets else (budgets[len(budgets) // 2] if budgets else None)
    selectors = sorted({c["method"] for c in cells if c["budget"] is not None})
    compactions = sorted({c["method"] for c in cells if c.get("kept") is not None and c["budget"] is None})
    panels = [("full", None)] + [(m, b0) for m in selectors] + [(m, None) for m in compactions]
    bins = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0001]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), squeeze=False)
    im = None
    for ax, (m, b) in zip(axes[0], panels):
        grid = [[float("nan")] * (len(bins) - 1) for _ in lengths]
        acc: dict[tuple, list] = defaultdict(list)
        for r in rows:
            if r["method"] == m and r["budget"] == b and r.get("depth") is not None and r.get("score") is not None:
                k = next(i for i in range(len(bins) - 1) if r["depth"] < bins[i + 1])
                acc[(lengths.index(r["length"]), k)].append(r["score"])
        for (i, k), v in acc.items():
            grid[i][k] = sum(v) / len(v)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_yticks(range(len(lengths)), [str(x) for x in lengths])
        ax.set_xticks(range(len(bins) - 1), ["0-.2", ".2-.4", ".4-.6", ".6-.8", ".8-1"], fontsize=7)
        ax.set_title(m if b is None else f"{m} @ {b}", fontsize=9)
        ax.set_xlabel("needle depth")
    axes[0][0].set_ylabel("length")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(out / "depth_heatmap.png", dpi=110)
    plt.close(fig)


def plot_all(rows: list[dict], cells: list[dict], out: Path, *, ppl: list[dict] | None = None) -> None:
    """score_vs_budget.png, kl_vs_budget.png, depth_heatmap.png (scored tasks) and, with
    ``ppl_continuation`` cells, ppl_vs_budget.png (perplexity relative to full)."""
    import matplotlib
    matplotlib.use("Agg")

    if cells:
        def full_score(length):
            fv = [c["score"] for c in cells if c["length"] == length and c["method"] == "full" and c["score"] is not None]
            return sum(fv) / len(fv) if fv else None

        others = [c for c in cells if c["method"] != "full"]
        _vs_budget(others, out, "score", "score_vs_budget.png", "mean task score", log=False, ref=full_score)
        _vs_budget(others, out, "kl", "kl_vs_budget.png", "KL(full || method)", log=True)
        if any(r.get("depth") is not None for r in rows):  # records with a needle
            _depth_heatmap(rows, cells, out)
    if ppl:
        _vs_budget([c for c in ppl if c["method"] != "full"], out, "ppl_ratio_vs_full", "ppl_vs_budget.png",
                   "perplexity / full's (geometric mean)", log=False, ref=lambda _length: 1.0)
