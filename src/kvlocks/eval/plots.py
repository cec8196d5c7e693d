"""PNG plots of task-suite results (matplotlib, headless)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def plot_all(rows: list[dict], cells: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({c["length"] for c in cells})
    methods = sorted({c["method"] for c in cells if c["method"] != "full"})
    budgets = sorted({c["budget"] for c in cells if c["budget"] is not None})
    # score and KL vs budget, averaged over tasks, one panel per length
    for field, fname, log in (("score", "score_vs_budget.png", False), ("kl", "kl_vs_budget.png", True)):
        fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.6), squeeze=False)
        for ax, length in zip(axes[0], lengths):
            for m in methods:
                ys = []
                for b in budgets:
                    v = [c[field] for c in cells if c["length"] == length and c["method"] == m and c["budget"] == b and c[field] is not None]
                    ys.append(sum(v) / len(v) if v else float("nan"))
                if field == "kl":
                    ys = [max(y, 1e-6) for y in ys]
                ax.plot(budgets, ys, marker="o", label=m)
            if field == "score":
                fv = [c["score"] for c in cells if c["length"] == length and c["method"] == "full"]
                if fv:
                    ax.axhline(sum(fv) / len(fv), color="k", ls="--", label="full")
            ax.set_xscale("log", base=2)
            if log:
                ax.set_yscale("log")
            ax.set_title(f"L={length}")
            ax.set_xlabel("budget (tokens per layer and KV head)")
            ax.set_ylabel("mean task score" if field == "score" else "KL(full || method)")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
    # needle depth x length heat maps at one budget
    b0 = 256 if 256 in budgets else (budgets[len(budgets) // 2] if budgets else None)
    panels = [("full", None)] + [(m, b0) for m in methods]
    bins = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0001]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), squeeze=False)
    for ax, (m, b) in zip(axes[0], panels):
        grid = [[float("nan")] * (len(bins) - 1) for _ in lengths]
        acc: dict[tuple, list] = defaultdict(list)
        for r in rows:
            if r["method"] == m and r["budget"] == b and r.get("depth") is not None:
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
