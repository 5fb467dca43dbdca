"""PNG of ``meshpilot simulate``: goodput against the checkpoint interval, one line per policy.

Runs on the driver (matplotlib with the Agg backend: no display needed).
"""

from __future__ import annotations

from pathlib import Path

from elastic.simulator import Sweep

COLOURS = {"restart": "#c0392b", "shrink": "#2471a3", "drain": "#239b56"}
# drain equals shrink when there are no spot notices: dashed, so both lines stay visible.
STYLES = {"restart": "-", "shrink": "-", "drain": "--"}


def render_goodput_plot(result: Sweep, path: str | Path, *, title: str) -> Path:
    """Write the plot to ``path`` (parent directories are created) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(8, 4.8), dpi=100)
    for curve in result.curves:
        colour = COLOURS.get(curve.policy)
        minutes = [interval / 60 for interval in curve.intervals_s]
        axes.plot(
            minutes,
            [100 * g for g in curve.goodput],
            label=curve.policy,
            color=colour,
            linewidth=1.8,
            linestyle=STYLES.get(curve.policy, "-"),
        )
        axes.plot([curve.best_interval_s / 60], [100 * curve.best_goodput], "o", color=colour, markersize=6)
        axes.annotate(
            f"{100 * curve.best_goodput:.1f}%",
            (curve.best_interval_s / 60, 100 * curve.best_goodput),
            textcoords="offset points",
            xytext=(-10, 7),
            fontsize=8,
            color=colour,
        )
    axes.set_xscale("log")
    # The interesting part is near the optimum; far-off intervals run off the bottom.
    low = min(100 * curve.best_goodput for curve in result.curves)
    axes.set_ylim(max(0.0, low - 20), 100.5)
    axes.axvline(result.young_daly_s / 60, color="#555555", linestyle="--", linewidth=1)
    axes.text(
        result.young_daly_s / 60,
        axes.get_ylim()[0],
        f" Young/Daly {result.young_daly_s / 60:.1f} min",
        rotation=90,
        va="bottom",
        ha="right",
        fontsize=8,
        color="#555555",
    )
    axes.set_xlabel("checkpoint interval (minutes, log scale)")
    axes.set_ylabel("effective training time (%)")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)
    return path
