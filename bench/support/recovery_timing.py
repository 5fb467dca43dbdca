"""Recovery figures from what a run left behind: pure functions, no Ray, no torch.

Runs on the benchmark's driver (``bench/recovery.py``), after each scenario. Two inputs:

- a meshpilot run's events (``events.jsonl`` as dicts): ``step`` events carry ``completed_at``
  (when the slowest rank finished the step) and the ``mesh`` that took it;
- the Ray Train reference's per-rank records (``bench/support/recovery_reference.py``): one dict per
  completed step and rank, ``{"attempt", "step", "completed_at", ...}``.

A figure is always measured from the fault's own wall-clock time (the SIGKILL, the node's
removal, the drain notice) to the moment the slowest rank completes the first step on the
new mesh, and "steps lost" counts steps completed before the fault that had to be done again.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MeshChange:
    """One change of mesh in a meshpilot run, timed from ``began_at`` (wall clock)."""

    began_at: float
    first_step: int  # the first step completed on the new mesh
    first_step_at: float  # when its slowest rank completed it
    last_step_before: int  # the last step completed before the change began
    last_step_before_at: float | None
    first_step_time_s: float | None = None  # the first new step's own duration (slowest rank)
    # The median duration of the later steps on the new mesh: what the first one compares to.
    steady_step_time_s: float | None = None

    @property
    def to_first_step_s(self) -> float:
        return self.first_step_at - self.began_at

    @property
    def lost_steps(self) -> int:
        """Steps completed before the change that the new mesh had to take again."""
        return max(0, self.last_step_before - (self.first_step - 1))

    @property
    def pause_s(self) -> float | None:
        """Gap between the last step on the old mesh and the first on the new one."""
        if self.last_step_before_at is None:
            return None
        return self.first_step_at - self.last_step_before_at

    @property
    def idle_s(self) -> float | None:
        """The part of the pause in which no step ran: the pause less the first new step itself."""
        if self.pause_s is None or self.first_step_time_s is None:
            return None
        return self.pause_s - self.first_step_time_s


def of_kind(events: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == kind]


def mesh_change(
    events: list[dict[str, Any]], *, after_event: str, new_mesh_event: str, began_at: float, skip: int = 0
) -> MeshChange:
    """The first step on the new mesh after the ``skip``-th ``after_event`` of the run.

    ``after_event`` marks where the old mesh stopped counting (``failure``, ``drain``, or
    ``recovered`` for a grow that follows a shrink); ``new_mesh_event`` (``recovered`` or
    ``grow``) names the mesh the job moved to. Steps after the marker still on the old mesh
    (a drain pauses at the next step boundary) count as taken before the change.
    """
    markers = [i for i, e in enumerate(events) if e.get("event") == after_event]
    if len(markers) <= skip:
        raise ValueError(f"the run has no {after_event!r} event number {skip + 1}")
    marker = markers[skip]
    transition = next((e for e in events[marker:] if e.get("event") == new_mesh_event), None)
    if transition is None:
        raise ValueError(f"the run has no {new_mesh_event!r} event after its {after_event!r} event")
    new_mesh = transition["new_mesh"]
    steps = [(i, e) for i, e in enumerate(events) if e.get("event") == "step"]
    first_index, first = next(((i, e) for i, e in steps if i > marker and e["mesh"] == new_mesh), (None, None))
    if first is None or first_index is None:
        raise ValueError(f"no step completed on the new mesh {new_mesh} after the {after_event!r} event")
    before = [e for i, e in steps if i < first_index]
    last = before[-1] if before else None
    later = [e["step_time_s"] for i, e in steps if i > first_index and e["mesh"] == new_mesh and "step_time_s" in e]
    return MeshChange(
        began_at=began_at,
        first_step=first["step"],
        first_step_at=first["completed_at"],
        last_step_before=last["step"] if last else 0,
        last_step_before_at=last["completed_at"] if last else None,
        first_step_time_s=first.get("step_time_s"),
        steady_step_time_s=statistics.median(later) if later else None,
    )


def step_completed_at(events: list[dict[str, Any]], step: int) -> float:
    """When the slowest rank completed ``step`` (its first completion in the run)."""
    for event in events:
        if event.get("event") == "step" and event["step"] == step:
            return event["completed_at"]
    raise ValueError(f"the run has no step {step}")


@dataclass(frozen=True)
class Restart:
    """A Ray Train restart read from per-rank step records."""

    fault_at: float
    last_step_before: int  # last step every rank completed before the fault
    resumed_from: int  # the checkpointed step the new worker group started after
    first_step_at: float  # first step the restarted group completed (slowest rank)
    caught_up_at: float | None  # first step beyond ``last_step_before`` completed again
    ready_at: float | None = None  # every restarted worker has built its model and loaded the checkpoint

    @property
    def to_first_step_s(self) -> float:
        return self.first_step_at - self.fault_at

    @property
    def to_new_progress_s(self) -> float | None:
        return None if self.caught_up_at is None else self.caught_up_at - self.fault_at

    @property
    def to_workers_ready_s(self) -> float | None:
        return None if self.ready_at is None else self.ready_at - self.fault_at

    @property
    def lost_steps(self) -> int:
        return max(0, self.last_step_before - self.resumed_from)


def completions_by_attempt(records: Iterable[dict[str, Any]], world_size: int) -> dict[int, dict[int, float]]:
    """{attempt: {step: completion time of its slowest rank}}, for steps every rank completed."""
    seen: dict[tuple[int, int], list[float]] = {}
    for record in records:
        if record.get("kind") == "step":
            seen.setdefault((record["attempt"], record["step"]), []).append(record["completed_at"])
    attempts: dict[int, dict[int, float]] = {}
    for (attempt, step), times in seen.items():
        if len(times) == world_size:
            attempts.setdefault(attempt, {})[step] = max(times)
    return {attempt: dict(sorted(steps.items())) for attempt, steps in sorted(attempts.items())}


def restart_from_records(records: list[dict[str, Any]], *, fault_at: float, world_size: int) -> Restart:
    """The first restart after ``fault_at``: steps lost and when training moved again."""
    attempts = completions_by_attempt(records, world_size)
    if len(attempts) < 2:
        raise ValueError(f"expected a restarted worker group, found {len(attempts)} attempt(s) with whole steps")
    first, second = list(attempts)[:2]
    before = [step for step, at in attempts[first].items() if at <= fault_at]
    last_before = max(before) if before else 0
    starts = [r for r in records if r.get("kind") == "start" and r["attempt"] == second]
    resumed_from = min((r["resumed_from"] for r in starts), default=min(attempts[second]) - 1)
    redone = attempts[second]
    first_step = min(redone)
    return Restart(
        fault_at=fault_at,
        last_step_before=last_before,
        resumed_from=resumed_from,
        first_step_at=redone[first_step],
        caught_up_at=next((at for step, at in redone.items() if step > last_before), None),
        ready_at=max((r["time"] for r in starts), default=None),
    )


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(reference: float | None, ours: float | None) -> float | None:
    """How many times longer the reference took (None when either is missing)."""
    if reference is None or ours is None or ours <= 0:
        return None
    return reference / ours


def table(rows: Sequence[tuple[str, ...]]) -> str:
    """Plain aligned columns; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
