"""The task-suite plots: a method keeps its colour across panels and the legend names every method."""

import matplotlib

matplotlib.use("Agg")

from kvlocks_lab.eval.plots import method_colors, vs_budget_figure  # noqa: E402


def _cells():
    cells = []
    panels = ((4096, ("locks", "oracle", "quest")), (8192, ("locks", "locks_centroid", "oracle", "quest")))
    for length, methods in panels:
        for i, m in enumerate(methods):
            for b in (128, 512):
                cells.append({"length": length, "method": m, "budget": b, "score": 0.1 * i + b / 1000})
    cells.append({"length": 8192, "method": "fold@0.1", "budget": None, "kept": 300.0, "score": 0.5})
    return cells


def test_a_method_has_one_colour_in_every_panel_and_the_legend_names_all():
    import matplotlib.pyplot as plt

    cells = _cells()
    colors = method_colors(cells)
    assert len(set(colors.values())) == len(colors) == 5
    fig = vs_budget_figure(cells, "score", "mean task score", log=False, ref=lambda n: 0.7)
    try:
        for ax, length in zip(fig.axes, (4096, 8192)):
            drawn = {line.get_label(): line.get_color() for line in ax.get_lines() if line.get_label() != "full"}
            assert set(drawn) == {c["method"] for c in cells if c["length"] == length}
            assert all(drawn[m] == colors[m] for m in drawn)  # the panel without locks_centroid keeps the others'
        # the first panel's legend lists the methods of every panel (locks_centroid and fold only in the second)
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert sorted(labels) == sorted([*colors, "full"])
        # the values drawn are the cells' means
        line = next(x for x in fig.axes[1].get_lines() if x.get_label() == "locks_centroid")
        assert list(line.get_xdata()) == [128, 512] and list(line.get_ydata()) == [0.1 + 0.128, 0.1 + 0.512]
    finally:
        plt.close(fig)
    assert vs_budget_figure([], "score", "y", log=False) is None
