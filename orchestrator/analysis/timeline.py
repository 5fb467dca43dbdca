"""``meshpilot report``: one picture and a few lines that tell what happened in a run.

Runs on the user's machine, after (or during) a run; reads only ``RUN_DIR/events.jsonl``.
``summarize`` computes the figures, ``render_timeline`` draws loss, throughput, world size and
checkpoint stalls over time with failure / recovery / restore / drain / grow markers (matplotlib,
Agg canvas: no display, no pyplot global state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.errors import UserError
from orchestrator.observe.events import checkpoint_failure_reason, is_failure_recovery, read_events

# Marker styles, one per event kind: (colour, line style, legend label).
MARKERS: dict[str, tuple[str, str, str]] = {
    "failure": ("#d62728", "-", "failure"),
    "recovered": ("#2ca02c", "--", "recovered"),
    "restored": ("#9467bd", "-.", "restored from checkpoint"),
    "drain": ("#ff7f0e", ":", "drain"),
    "grow": ("#1f77b4", "-.", "grow"),
}
_MAX_MARKER_LABELS = 16  # beyond this, labels would pile up; lines and the legend still show them
STARTUP_COLOUR = "#bdbdbd"
STARTUP_ALPHA = 0.35
PARTIAL_LOSS_COLOUR = "#e377c2"


@dataclass(frozen=True)
class RunSummary:
    name: str
    status: str
    last_step: int
    target_steps: int | None
    wall_s: float
    effective_s: float
    failures: tuple[str, ...]
    recovery_s: tuple[float, ...]
    lost_steps: int
    restores: int
    checkpoints_committed: int
    checkpoint_failures: int
    stall_s: float
    drains: int
    grows: int
    world_sizes: tuple[int, ...] = field(default=())
    # Start event to the first step's start: actors, rendezvous, model build, restore.
    startup_s: float | None = None
    checkpoint_bytes: int = 0
    # Checkpoints dropped because a failure, drain or grow changed the mesh mid-save.
    checkpoints_interrupted: int = 0
    # Pauses that were no failure: a drain's, a grow's (seconds each).
    drain_pause_s: tuple[float, ...] = field(default=())
    grow_pause_s: tuple[float, ...] = field(default=())
    # Steps whose loss is the mean over the ranks that reported (a rank left before its report).
    partial_loss_steps: tuple[int, ...] = field(default=())

    @property
    def goodput(self) -> float:
        return self.effective_s / self.wall_s if self.wall_s > 0 else 0.0


def load_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's events; a UserError naming the directory when there is nothing to read."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(
            f"run directory {str(run_dir)!r} does not exist; pass the directory "
            "`meshpilot train` printed at start (under runs/)"
        )
    path = run_dir / "events.jsonl"
    if not path.is_file():
        raise UserError(
            f"{str(run_dir)!r} has no events.jsonl, so it is not a meshpilot run directory; "
            "pass the directory `meshpilot train` printed at start"
        )
    events = [event for event in read_events(path) if isinstance(event, dict) and "event" in event and "time" in event]
    if not events:
        raise UserError(
            f"{str(path)!r} holds no events: the run wrote nothing yet; "
            "wait for it to start, or pass another run directory"
        )
    return events


def productive_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step events whose work survived: a restore to step S discards the steps after S done before it."""
    kept: list[dict[str, Any]] = []
    for event in events:
        if event["event"] == "step":
            kept.append(event)
        elif event["event"] == "restored" and event.get("step") is not None:
            kept = [step for step in kept if step["step"] <= event["step"]]
    return kept


def summarize(events: list[dict[str, Any]]) -> RunSummary:
    start = next((e for e in events if e["event"] == "start"), events[0])
    done = next((e for e in reversed(events) if e["event"] == "done"), None)
    steps = [e for e in events if e["event"] == "step"]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        by_name.setdefault(event["event"], []).append(event)

    def of(name: str) -> list[dict[str, Any]]:
        return by_name.get(name, [])

    end_time = done["time"] if done else events[-1]["time"]
    world_sizes: list[int] = []
    for size in (int(e["world_size"]) for e in steps if e.get("world_size")):
        if not world_sizes or world_sizes[-1] != size:
            world_sizes.append(size)
    return RunSummary(
        name=str(start.get("name") or "meshpilot"),
        status=str(done.get("status")) if done else "running or killed (no done event)",
        last_step=int(steps[-1]["step"]) if steps else 0,
        target_steps=start.get("steps"),
        wall_s=max(0.0, end_time - start["time"]),
        effective_s=sum(float(e.get("step_time_s") or 0.0) for e in productive_steps(events)),
        failures=tuple(str(e.get("kind")) for e in of("failure")),
        recovery_s=tuple(float(e.get("mttr_s") or 0.0) for e in of("recovered") if is_failure_recovery(e)),
        lost_steps=sum(int(e.get("lost_steps") or 0) for e in of("recovered")),
        restores=len(of("restored")),
        checkpoints_committed=len(of("checkpoint_committed")),
        checkpoint_failures=len(of("checkpoint_failed")),
        stall_s=sum(float(e.get("stall_s") or 0.0) for e in of("checkpoint_staged")),
        drains=len(of("drain")),
        grows=len(of("grow")),
        world_sizes=tuple(world_sizes),
        startup_s=_startup_end(events) - start["time"] if steps else None,
        checkpoint_bytes=sum(int(e.get("bytes") or 0) for e in of("checkpoint_committed")),
        checkpoints_interrupted=sum(checkpoint_failure_reason(e) == "interrupted" for e in of("checkpoint_failed")),
        drain_pause_s=tuple(float(e.get("mttr_s") or 0.0) for e in of("recovered") if e.get("cause") == "drain"),
        grow_pause_s=tuple(float(e.get("join_s") or 0.0) for e in of("grow")),
        partial_loss_steps=tuple(int(e["step"]) for e in steps if e.get("loss_partial")),
    )


def _startup_end(events: list[dict[str, Any]]) -> float:
    """When the first step began (its event time less its duration): start-up ends there."""
    first = next(e for e in events if e["event"] == "step")
    start_time = next((e["time"] for e in events if e["event"] == "start"), events[0]["time"])
    return max(start_time, first["time"] - float(first.get("step_time_s") or 0.0))


def format_summary(summary: RunSummary) -> str:
    target = f"/{summary.target_steps}" if summary.target_steps else ""
    recoveries = ", ".join(f"{s:.1f} s" for s in summary.recovery_s) or "none"
    failures = ", ".join(f"{kind} x{summary.failures.count(kind)}" for kind in dict.fromkeys(summary.failures))
    startup = f" (start-up {_duration(summary.startup_s)})" if summary.startup_s is not None else ""
    failed = f"{summary.checkpoint_failures} failed"
    if summary.checkpoints_interrupted:
        failed += f" ({summary.checkpoints_interrupted} interrupted by a mesh change)"
    lines = [
        f"run {summary.name}: {summary.status}, step {summary.last_step}{target}, "
        f"wall time {_duration(summary.wall_s)}{startup}",
        f"effective training time: {_duration(summary.effective_s)} ({summary.goodput:.1%} of wall time)",
        f"failures: {len(summary.failures)}" + (f" ({failures})" if failures else ""),
        f"recovery times: {recoveries}; lost steps: {summary.lost_steps}; restores from checkpoint: {summary.restores}",
        _checkpoint_line(summary, failed),
        f"world size: {' -> '.join(str(size) for size in summary.world_sizes) or 'no steps'}; "
        f"drains: {summary.drains}{_pauses(summary.drain_pause_s)}; "
        f"grows: {summary.grows}{_pauses(summary.grow_pause_s)}",
    ]
    if summary.partial_loss_steps:
        shown = ", ".join(map(str, summary.partial_loss_steps))
        lines.append(f"loss from the ranks that reported only (a rank left before its report): step {shown}")
    return "\n".join(lines)


def _checkpoint_line(summary: RunSummary, failed: str) -> str:
    if not (summary.checkpoints_committed or summary.checkpoint_failures or summary.stall_s):
        return "checkpoints: none"
    return (
        f"checkpoints: {summary.checkpoints_committed} committed ({_size(summary.checkpoint_bytes)}), {failed}; "
        f"total stall {summary.stall_s:.2f} s"
    )


def _pauses(seconds: tuple[float, ...]) -> str:
    return f" (paused {', '.join(f'{s:.1f} s' for s in seconds)})" if seconds else ""


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


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
        f"wall {_duration(summary.wall_s)}, effective training {summary.goodput:.0%}",
        fontsize=13,
        fontweight="bold",
    )

    lost, partial = _draw_training(loss_ax, speed_ax, events, at)
    loss_ax.set_ylabel("loss")
    speed_ax.set_ylabel("tokens / s")
    speed_ax.set_ylim(bottom=0)
    _draw_world_size(world_ax, events, at)
    _draw_checkpoints(ckpt_ax, events, at)
    if not steps:
        loss_ax.text(0.5, 0.5, "no completed steps", transform=loss_ax.transAxes, ha="center", va="center")

    if summary.startup_s is not None:
        _draw_startup(
            (loss_ax, speed_ax, world_ax, ckpt_ax),
            summary.startup_s / scale,
            at(events[-1]),
            _duration(summary.startup_s),
        )
    _draw_markers((loss_ax, speed_ax, world_ax, ckpt_ax), events, at)
    for axis in (loss_ax, speed_ax, world_ax, ckpt_ax):
        axis.grid(True, alpha=0.3)
    ckpt_ax.set_xlabel(f"time since start ({unit})")
    ckpt_ax.set_xlim(left=0, right=max(at(events[-1]) * 1.01, 1.0))

    handles = _legend_handles(events, summary, lost=bool(lost), partial=bool(partial))
    if handles:  # under the panels, where it hides no data
        figure.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=9, frameon=False)

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


def _legend_handles(events: list[dict[str, Any]], summary: RunSummary, *, lost: bool, partial: bool) -> list[Any]:
    """What the legend explains: only the kinds of marker the picture shows."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    shown = {e["event"] for e in events if e["event"] != "recovered" or is_failure_recovery(e)}
    handles = [
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


def _draw_world_size(axis, events: list[dict[str, Any]], at) -> None:
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
            label=f"committed ({len(committed)}, {_size(total)} in all)",
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
