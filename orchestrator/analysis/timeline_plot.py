"""``meshpilot report``'s picture: a run's timeline PNG, drawn from its events.

Runs on the user's machine, after (or during) a run. ``render_timeline`` draws loss (and the eval
loss, when the run evaluated), throughput,
world size and checkpoint stalls over time with failure / recovery / restore / drain / grow
markers (matplotlib, Agg canvas: no display, no pyplot global state); the figures it titles and
shades come from ``timeline.summarize``. matplotlib is imported inside the drawing functions, so
the CLI starts without it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.analysis.timeline import RunSummary, format_duration, format_size, productive_steps, summarize
from orchestrator.observe.events import checkpoint_failure_reason, is_failure_recovery

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.typing import LineStyleType

# Marker styles, one per event kind: (colour, line style, legend label).
MARKERS: dict[str, tuple[str, LineStyleType, str]] = {
    "failure": ("#d62728", "-", "failure"),
    "recovered": ("#2ca02c", "--", "recovered"),
    "restored": ("#9467bd", "-.", "restored (checkpoint or peer memory)"),
    "drain": ("#ff7f0e", ":", "drain"),
    "grow": ("#1f77b4", "-.", "grow"),
}
LEGEND_COLUMNS = 8
_MAX_MARKER_LABELS = 16  # beyond this, labels would pile up; lines and the legend still show them
STARTUP_COLOUR = "#bdbdbd"
STARTUP_ALPHA = 0.35
PARTIAL_LOSS_COLOUR = "#e377c2"
EVAL_COLOUR = "#6b8e23"  # olive: apart from the markers' reds, greens, blues and oranges


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s > 3 * 3600:
        return 3600.0, "hours"
    if span_s > 5 * 60:
        return 60.0, "minutes"
    return 1.0, "seconds"


def render_timeline(events: list[dict[str, Any]], out: str | Path, *, summary: RunSummary | None = None) -> Path:
    """Draw the run's timeline as a PNG at ``out``; returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary = summary or summarize(events)
    start_time = next((e["time"] for e in events if e["event"] == "start"), events[0]["time"])
    scale, unit = _time_unit(events[-1]["time"] - start_time)

    def at(event: dict[str, Any]) -> float:
        """x of an event: time since the start, in the picture's unit."""
        return (event["time"] - start_time) / scale

    steps = [e for e in events if e["event"] == "step"]

    figure = Figure(figsize=(13, 10), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    loss_ax, speed_ax, world_ax, ckpt_ax = figure.subplots(
        4, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.6, 1.6]}
    )
    figure.suptitle(
        f"meshpilot run '{summary.name}': {summary.status}, step {summary.last_step}"
        f"{'/' + str(summary.target_steps) if summary.target_steps else ''}, "
        f"wall {format_duration(summary.wall_s)}, effective training {summary.goodput:.0%}",
        fontsize=13,
        fontweight="bold",
    )

    lost, partial = _draw_training(loss_ax, speed_ax, events, at)
    _draw_eval(loss_ax, events, at)
    loss_ax.set_ylabel("loss")
    speed_ax.set_ylabel("tokens / s")
    speed_ax.set_ylim(bottom=0)
    _draw_worldformat_size(world_ax, events, at)
    _draw_checkpoints(ckpt_ax, events, at)
    if not steps:
        loss_ax.text(0.5, 0.5, "no completed steps", transform=loss_ax.transAxes, ha="center", va="center")

    if summary.startup_s is not None:
        _draw_startup(
            (loss_ax, speed_ax, world_ax, ckpt_ax),
            summary.startup_s / scale,
            at(events[-1]),
            format_duration(summary.startup_s),
        )
    _draw_markers((loss_ax, speed_ax, world_ax, ckpt_ax), events, at)
    for axis in (loss_ax, speed_ax, world_ax, ckpt_ax):
        axis.grid(True, alpha=0.3)
    ckpt_ax.set_xlabel(f"time since start ({unit})")
    ckpt_ax.set_xlim(left=0, right=max(at(events[-1]) * 1.01, 1.0))

    handles = _legend_handles(events, summary, lost=bool(lost), partial=bool(partial))
    if handles:  # under the panels, where it hides no data
        columns = min(len(handles), LEGEND_COLUMNS)  # more wrap to a second row rather than leave the figure
        figure.legend(handles=handles, loc="outside lower center", ncol=columns, fontsize=9, frameon=False)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    return out


def _draw_training(
    loss_ax: Any, speed_ax: Any, events: list[dict[str, Any]], at: Callable[[dict[str, Any]], float]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Loss and tokens/s, one line per stretch of training; returns the lost and the partial-loss steps."""
    steps = [e for e in events if e["event"] == "step"]
    # One line per stretch of uninterrupted training: no line drawn across a failure's downtime.
    for segment in _segments(events):
        xs = [at(e) for e in segment]
        loss_ax.plot(xs, [e.get("loss") for e in segment], color="#222222", linewidth=1.4)
        speed_ax.plot(xs, [_tokens_per_s(e) for e in segment], color="#17becf", linewidth=1.2)
    kept = {id(e) for e in productive_steps(events)}
    lost = [e for e in steps if id(e) not in kept]
    partial = [e for e in steps if e.get("loss_partial") and e.get("loss") is not None]
    if partial:  # a blip there is the missing ranks' share, not the model
        loss_ax.scatter(
            [at(e) for e in partial],
            [e["loss"] for e in partial],
            marker="o",
            s=70,
            facecolors="none",
            edgecolors=PARTIAL_LOSS_COLOUR,
            linewidths=2.0,
            zorder=4,
        )
    if lost:
        loss_ax.scatter(
            [at(e) for e in lost],
            [e.get("loss") for e in lost],
            marker="x",
            s=40,
            color="#7f7f7f",
            zorder=3,
            label="lost step (redone)",
        )
        speed_ax.scatter(
            [at(e) for e in lost], [_tokens_per_s(e) for e in lost], marker="x", s=40, color="#7f7f7f", zorder=3
        )
    return lost, partial


def _draw_eval(loss_ax: Any, events: list[dict[str, Any]], at: Callable[[dict[str, Any]], float]) -> None:
    """The eval loss at each evaluation, on the loss panel: points joined in time order."""
    evals = [e for e in events if e["event"] == "eval" and e.get("loss") is not None]
    if evals:
        loss_ax.plot(
            [at(e) for e in evals],
            [e["loss"] for e in evals],
            color=EVAL_COLOUR,
            marker="o",
            markersize=4,
            linewidth=1.4,
        )


def _legend_handles(events: list[dict[str, Any]], summary: RunSummary, *, lost: bool, partial: bool) -> list[Artist]:
    """What the legend explains: only the kinds of marker the picture shows."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    shown = {e["event"] for e in events if e["event"] != "recovered" or is_failure_recovery(e)}
    handles: list[Artist] = [
        Line2D([], [], color=colour, linestyle=style, linewidth=2, label=label)
        for kind, (colour, style, label) in MARKERS.items()
        if kind in shown
    ]
    if any(e["event"] == "recovered" and e.get("cause") == "drain" for e in events):
        handles.append(
            Line2D(
                [],
                [],
                color=MARKERS["drain"][0],
                linestyle=MARKERS["recovered"][1],
                linewidth=2,
                label="training again after a drain",
            )
        )
    if any(e["event"] == "eval" for e in events):  # two loss lines: say which is which
        handles[:0] = [
            Line2D([], [], color="#222222", linewidth=1.4, label="training loss"),
            Line2D([], [], color=EVAL_COLOUR, marker="o", markersize=4, linewidth=1.4, label="eval loss"),
        ]
    if summary.startup_s is not None:
        handles.insert(0, Patch(color=STARTUP_COLOUR, alpha=STARTUP_ALPHA, label="start-up"))
    if any(e["event"] == "failure" for e in events):
        handles.append(Patch(color=MARKERS["failure"][0], alpha=0.12, label="failure -> recovered"))
    if lost:
        handles.append(Line2D([], [], color="#7f7f7f", marker="x", linestyle="", label="lost step (redone)"))
    if partial:
        handles.append(
            Line2D(
                [],
                [],
                color=PARTIAL_LOSS_COLOUR,
                marker="o",
                markerfacecolor="none",
                linestyle="",
                label="partial loss (a rank did not report)",
            )
        )
    return handles


def _segments(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Step events split wherever training stopped or the mesh changed (failure, drain, restore, grow)."""
    segments: list[list[dict[str, Any]]] = [[]]
    for event in events:
        if event["event"] == "step":
            segments[-1].append(event)
        elif event["event"] in ("failure", "drain", "restored", "grow") and segments[-1]:
            segments.append([])
    return [segment for segment in segments if segment]


def _tokens_per_s(step: dict[str, Any]) -> float | None:
    seconds = step.get("step_time_s")
    return step.get("tokens", 0) / seconds if seconds else None


def _mesh_world(mesh: Any) -> int | None:
    if not isinstance(mesh, dict) or not mesh:
        return None
    size = 1
    for degree in mesh.values():
        size *= int(degree)
    return size


def _draw_worldformat_size(axis, events: list[dict[str, Any]], at) -> None:
    """World size as a step line: set by start and steps, changed by recovered / grow / restored."""
    points: list[tuple[float, int]] = []
    for event in events:
        size = None
        if event["event"] in ("start", "step"):
            size = event.get("world_size")
        elif event["event"] in ("recovered", "grow"):
            size = _mesh_world(event.get("new_mesh"))
        elif event["event"] == "restored":
            size = _mesh_world(event.get("to_mesh"))
        if size and (not points or points[-1][1] != size):
            points.append((at(event), int(size)))
    if not points:
        return
    points.append((at(events[-1]), points[-1][1]))
    axis.step([x for x, _ in points], [y for _, y in points], where="post", color="#8c564b", linewidth=2)
    for x, size in points[:-1]:
        axis.annotate(f"{size}", (x, size), textcoords="offset points", xytext=(3, 3), fontsize=9, color="#8c564b")
    top = max(size for _, size in points)
    axis.set_ylim(0, top * 1.3)
    axis.set_ylabel("world size\n(ranks)")
    axis.yaxis.get_major_locator().set_params(integer=True)


def _draw_checkpoints(axis, events: list[dict[str, Any]], at) -> None:
    """Stall per checkpoint as stems, commits and failures as markers at their time."""
    staged = [e for e in events if e["event"] == "checkpoint_staged"]
    committed = [e for e in events if e["event"] == "checkpoint_committed"]
    failed = [e for e in events if e["event"] == "checkpoint_failed"]
    if staged:
        stalls = [float(e.get("stall_s") or 0.0) for e in staged]
        axis.vlines([at(e) for e in staged], 0, stalls, color="#7f7f7f", linewidth=3, label="stall (s)")
        top = max(stalls) or 1.0
    else:
        top = 1.0
    axis.set_ylim(0, top * 2.0)  # the top quarter holds the legend, clear of the markers below it
    marker_y = top * 1.3
    if committed:
        total = sum(int(e.get("bytes") or 0) for e in committed)
        axis.scatter(
            [at(e) for e in committed],
            [marker_y] * len(committed),
            marker="^",
            s=60,
            color="#006d2c",
            zorder=3,
            label=f"committed ({len(committed)}, {format_size(total)} in all)",
        )
    for reason, colour, label in (
        ("storage", "#8b0000", "upload failed"),
        ("interrupted", "#7f7f7f", "dropped: mesh changed mid-save"),
    ):
        these = [e for e in failed if checkpoint_failure_reason(e) == reason]
        if these:
            axis.scatter(
                [at(e) for e in these], [marker_y] * len(these), marker="X", s=80, color=colour, zorder=3, label=label
            )
    if staged or committed or failed:
        axis.legend(loc="upper left", fontsize=8, ncol=4, framealpha=0.9)
    else:
        axis.text(0.5, 0.5, "no checkpoints", transform=axis.transAxes, ha="center", va="center", color="#7f7f7f")
    axis.set_ylabel("checkpoint\nstall (s)")


def _node_text(node: Any) -> str:
    """Ray node ids are 56 hex digits: the first 8 tell them apart in a picture."""
    if isinstance(node, list):
        return f"{len(node)} nodes"
    text = str(node or "?")
    return f"node {text[:8]}" if len(text) > 12 else f"node {text}"


def _ranks_text(ranks: list[Any]) -> str:
    return ", ".join(map(str, ranks[:6])) + (f" (+{len(ranks) - 6})" if len(ranks) > 6 else "")


def _draw_startup(axes, end: float, last: float, duration: str) -> None:
    """Grey from the start to the first step: the time nothing could train yet."""
    for axis in axes:
        axis.axvspan(0, end, color=STARTUP_COLOUR, alpha=STARTUP_ALPHA, linewidth=0)
    if end > 0.08 * last:  # room for the words
        axes[0].text(
            end / 2,
            0.5,
            f"start-up\n{duration}",
            transform=axes[0].get_xaxis_transform(),
            ha="center",
            va="center",
            fontsize=10,
            color="#525252",
        )


def _draw_markers(axes, events: list[dict[str, Any]], at) -> None:
    """Vertical lines for failures, recoveries, restores, drains and grows; shaded downtime."""
    marked = [e for e in events if e["event"] in MARKERS]
    label_them = len(marked) <= _MAX_MARKER_LABELS
    top_axis = axes[0]
    pending_failure: float | None = None
    for event in marked:
        colour, style, _ = MARKERS[event["event"]]
        if event["event"] == "recovered" and event.get("cause") in MARKERS and not is_failure_recovery(event):
            colour = MARKERS[event["cause"]][0]  # the end of a drain's pause: no failure to recover from
        x = at(event)
        for axis in axes:
            axis.axvline(x, color=colour, linestyle=style, linewidth=1.3, alpha=0.85)
        if event["event"] == "failure" and pending_failure is None:
            pending_failure = x
        elif is_failure_recovery(event) and pending_failure is not None:
            for axis in axes:
                axis.axvspan(pending_failure, x, color=MARKERS["failure"][0], alpha=0.12, linewidth=0)
            pending_failure = None
        if label_them:
            # What begins a pause is labelled left of its line, what ends it right of its own:
            # a failure and its recovery a second apart still read apart.
            left = event["event"] in ("failure", "drain")
            top_axis.annotate(
                _marker_text(event),
                (x, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(-2 if left else 2, -4),
                textcoords="offset points",
                rotation=90,
                va="top",
                ha="right" if left else "left",
                fontsize=8,
                color=colour,
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1},
            )


def _marker_text(event: dict[str, Any]) -> str:
    name = event["event"]
    if name == "failure":
        ranks = event.get("ranks") or []
        which = f", rank{'s' if len(ranks) > 1 else ''} {_ranks_text(ranks)}" if ranks else ""
        return f"failure: {event.get('kind')}{which}"
    if name == "recovered":
        seconds = float(event.get("mttr_s") or 0)
        if not is_failure_recovery(event):
            return f"training again after {event.get('cause')}, {seconds:.1f} s"
        return f"recovered {seconds:.1f} s, lost {event.get('lost_steps') or 0}"
    if name == "restored":
        return f"restored step {event.get('step')}"
    if name == "drain":
        ranks = event.get("ranks") or []
        return f"drain: {_node_text(event.get('node'))}, rank{'s' if len(ranks) > 1 else ''} {_ranks_text(ranks)}"
    return f"grow +{len(event.get('added_ranks') or [])} ranks"
