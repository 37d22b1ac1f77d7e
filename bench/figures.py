"""Line figures for the benchmarks' docs (matplotlib, PNG files under docs/figures/), drawn from the figures a
bench module has just measured: one helper, so every figure looks alike."""

from __future__ import annotations

from pathlib import Path

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"
COLOURS = ("#2471a3", "#c0392b", "#229954", "#8e44ad", "#d68910", "#5d6d7e")


def line_figure(path: Path, title: str, panels: list[dict], columns: int | None = None) -> Path:
    """``panels``: each ``{"title", "x", "y", "series": [(label, xs, ys), ...], "log_y": bool}``, side by side (``columns`` to a row, then the next row);
    a panel's optional ``"levels": [(label, y), ...]`` are dashed horizontal lines (a configuration with no x,
    such as an adaptive depth, beside the series that sweep it)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    columns = columns or len(panels)
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.8 * columns, 4 * rows), constrained_layout=True, squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    for axis, panel in zip(axes.flat, panels):
        for colour, (label, xs, ys) in zip(COLOURS, panel["series"]):
            axis.plot(xs, ys, marker="o", markersize=3.5, linewidth=1.4, color=colour, label=label)
        for colour, (label, y) in zip(COLOURS[len(panel["series"]) :], panel.get("levels", ())):
            axis.axhline(y, linestyle="--", linewidth=1.2, color=colour, label=label)
        if panel.get("log_y"):
            axis.set_yscale("log")
        axis.set_title(panel["title"], fontsize=10)
        axis.set_xlabel(panel["x"])
        axis.set_ylabel(panel["y"])
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
