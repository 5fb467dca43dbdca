"""``meshpilot report``: a few lines that tell what happened in a run, and the figures behind them.

Runs on the user's machine, after (or during) a run; reads only ``RUN_DIR/events.jsonl`` (or the
mirrored record's, from ``s3://``).
``summarize`` computes the figures, ``format_summary`` words them; ``timeline_plot.render_timeline``
draws the picture from the same events and figures.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpointing.storage import open_storage
from orchestrator.config_checks import uri_problems
from orchestrator.errors import UserError
from orchestrator.observe.events import checkpoint_failure_reason, is_failure_recovery, read_events
from orchestrator.observe.record_mirror import read_record_events


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
    # Restores from peer-memory snapshots (``restores`` counts those from a checkpoint), and the
    # bytes they read from other ranks' memory.
    memory_restores: int = 0
    memory_restore_bytes: int = 0
    # One line per ``straggler`` event: rank, node, factor, action.
    stragglers: tuple[str, ...] = field(default=())

    @property
    def goodput(self) -> float:
        return self.effective_s / self.wall_s if self.wall_s > 0 else 0.0


def load_events(
    run_dir: str | Path, *, endpoint_url: str | None = None, region: str | None = None
) -> list[dict[str, Any]]:
    """The run's events, from a run directory or a mirrored record (``s3://bucket/prefix``, read
    with ``endpoint_url`` and ``region``); a UserError naming the place when there is nothing to read."""
    if str(run_dir).startswith("s3:"):
        with tempfile.TemporaryDirectory(prefix="meshpilot-record-") as downloaded:
            path = _download_events(str(run_dir), Path(downloaded), endpoint_url=endpoint_url, region=region)
            return _events_in(path)
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
    return _events_in(path)


def _download_events(uri: str, into: Path, *, endpoint_url: str | None, region: str | None) -> Path:
    """A mirrored record's events.jsonl (whole, or its parts so far) as ``into/events.jsonl``."""
    problems = uri_problems(uri, "RUN_DIR")
    if problems:
        raise UserError(problems[0])
    storage = open_storage(uri, endpoint_url=endpoint_url, region=region)
    try:
        data = read_record_events(storage)
    finally:
        storage.close()
    path = into / "events.jsonl"
    path.write_bytes(data)
    return path


def _events_in(path: Path) -> list[dict[str, Any]]:
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
        restores=sum(e.get("source") != "peer_memory" for e in of("restored")),
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
        memory_restores=sum(e.get("source") == "peer_memory" for e in of("restored")),
        memory_restore_bytes=sum(int(e.get("bytes_from_peers") or 0) for e in of("restored")),
        stragglers=tuple(_straggler(e) for e in of("straggler")),
    )


def _straggler(event: dict[str, Any]) -> str:
    """``rank 1 (node n0) 4.02x at step 8: replace`` (and why an action was only a warning)."""
    why = f" ({event['reason']})" if event.get("reason") else ""
    return (
        f"rank {event.get('rank')} (node {event.get('node')}) {float(event.get('factor') or 0):.2f}x "
        f"at step {event.get('step')}: {event.get('action')}{why}"
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
    startup = f" (start-up {format_duration(summary.startup_s)})" if summary.startup_s is not None else ""
    failed = f"{summary.checkpoint_failures} failed"
    if summary.checkpoints_interrupted:
        failed += f" ({summary.checkpoints_interrupted} interrupted by a mesh change)"
    lines = [
        f"run {summary.name}: {summary.status}, step {summary.last_step}{target}, "
        f"wall time {format_duration(summary.wall_s)}{startup}",
        f"effective training time: {format_duration(summary.effective_s)} ({summary.goodput:.1%} of wall time)",
        f"failures: {len(summary.failures)}" + (f" ({failures})" if failures else ""),
        f"recovery times: {recoveries}; lost steps: {summary.lost_steps}; restores from checkpoint: {summary.restores}"
        + (
            f"; from peer memory: {summary.memory_restores} ({summary.memory_restore_bytes / 2**20:.1f} MiB from peers)"
            if summary.memory_restores
            else ""
        ),
        _checkpoint_line(summary, failed),
        f"world size: {' -> '.join(str(size) for size in summary.world_sizes) or 'no steps'}; "
        f"drains: {summary.drains}{_pauses(summary.drain_pause_s)}; "
        f"grows: {summary.grows}{_pauses(summary.grow_pause_s)}",
    ]
    if summary.stragglers:
        lines.append(f"stragglers: {len(summary.stragglers)}: " + "; ".join(summary.stragglers))
    if summary.partial_loss_steps:
        shown = ", ".join(map(str, summary.partial_loss_steps))
        lines.append(f"loss from the ranks that reported only (a rank left before its report): step {shown}")
    return "\n".join(lines)


def _checkpoint_line(summary: RunSummary, failed: str) -> str:
    if not (summary.checkpoints_committed or summary.checkpoint_failures or summary.stall_s):
        return "checkpoints: none"
    return (
        f"checkpoints: {summary.checkpoints_committed} committed ({format_size(summary.checkpoint_bytes)}), {failed}; "
        f"total stall {summary.stall_s:.2f} s"
    )


def _pauses(seconds: tuple[float, ...]) -> str:
    return f" (paused {', '.join(f'{s:.1f} s' for s in seconds)})" if seconds else ""


def format_size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def format_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
