"""``bench/chaos.py``'s figures from what its runs left behind: pure functions, no Ray, no torch.

Runs on the benchmark's driver, after the runs. Two inputs:

- a meshpilot run's events (``events.jsonl`` as dicts, see ``orchestrator/observe/events.py``);
- the Ray Train reference's per-rank records (``bench/support/recovery_reference.py``): ``start``,
  ``step`` (with ``step_time_s``) and the ``kill`` / ``raise`` a worker fired on itself.

How each figure is counted:

- faults landed: ``failure`` events plus ``drain`` events (a kill, raise, hang or node loss
  gives a ``failure``, a drain notice or a SIGTERM a ``drain``). Events, not faults: a storage
  outage gives neither (the uploads retry, or a save gives up as ``checkpoint_failed`` with
  reason ``storage``: counted apart); a fault never fires when its rank left the mesh, when an
  earlier failure interrupted its step (the redo does not fire it again) or, for ``/configure``,
  when no recovery configures at its step; and one fault can give several events (a drained
  node's ranks dying, a lost node found again by a recovery that started over).
- steps lost: the ``lost_steps`` of every ``recovered`` event, apart for those that restored
  (``cause: restore``) from peer memory (``source: peer_memory``), from storage, and the rest
  (a replica group survived: in-place shrink, refill from spares, a drain's pause). Beside
  it, as a check on the events, the steps redone after restores counted from the ``step``
  events themselves (applied, rewound, applied again).
- goodput: the time inside the steps that count (``step_time_s``, the slowest rank's, of each
  step's last application; a step a restore rewound is redone, and only the redo counts) over
  the wall time from the ``start`` event (before any actor starts) to ``done``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from bench.support.recovery_timing import completions_by_attempt

GOODPUT_GOAL = 0.8
# The kinds Ray Train V2 meets as meshpilot's schedule gives them (a worker's process killed or
# raising at a step, the node of a worker removed): it restarts the group from a checkpoint.
REFERENCE_KINDS = ("kill", "raise", "node")
NOT_APPLIED_WHY = {
    "configure": "lands while meshpilot configures a recovered mesh; Ray Train restarts the whole group "
    "instead, so there is no such moment to hit",
    "hang": "not reproduced in the reference (a worker stuck inside a step); not measured",
    "sigterm": "not reproduced in the reference (SIGTERM to one worker process); not measured",
    "drain": "not reproduced in the reference (a Ray drain notice for a worker's node); not measured",
    "s3_outage": "the reference checkpoints to local disk (Ray Train's storage_path): no S3 to lose",
}


def of_kind(events: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == kind]


# ------------------------------------------------------------------ meshpilot
def counted_steps(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``step`` events that count, in step order: each step's last application; the steps a
    ``restored`` event rewound are dropped (their redo counts)."""
    counted: dict[int, dict[str, Any]] = {}
    for event in events:
        if event.get("event") == "restored":
            for step in [step for step in counted if step > event["step"]]:
                del counted[step]
        elif event.get("event") == "step":
            counted[event["step"]] = event
    return [counted[step] for step in sorted(counted)]


def goodput(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Time inside the steps that count over the wall time from ``start`` to ``done``."""
    steps = counted_steps(events)
    useful_s = sum(event.get("step_time_s") or 0.0 for event in steps)
    starts, dones = of_kind(events, "start"), of_kind(events, "done")
    wall_s = (dones[-1]["time"] - starts[0]["time"]) if starts and dones else None
    return {
        "goodput": None if not wall_s else round(useful_s / wall_s, 4),
        "useful_s": round(useful_s, 3),
        "wall_s": None if wall_s is None else round(wall_s, 3),
        "steps_counted": len(steps),
        "step_events": len(of_kind(events, "step")),
    }


# Events that mark a gap between two steps as a pause for a fault (or its recovery).
PAUSE_EVENTS = ("failure", "drain", "recovered", "restored", "grow")


def time_breakdown(events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Where the wall time went, on the ranks' clock (each step event's ``completed_at`` and
    ``step_time_s``), in parts that add up to ``wall_s``:

    - ``useful_s``: the steps that count (goodput's numerator); ``redone_s``: the steps a restore
      rewound, which ran twice;
    - ``start_s``: ``start`` to the first step's beginning (Ray, actors, configuration); ``end_s``:
      the last step to ``done`` (the final checkpoint, shutdown);
    - the gaps between one step's end and the next one's beginning: ``hang_wait_s`` up to the
      ``failure`` event of a hang inside the gap (the wait for ``elastic.hang_timeout_s`` no
      detector can shorten), ``recovery_s`` for the rest of each gap holding a failure, drain,
      recovery, restore or grow event, ``between_steps_s`` for gaps holding none (the commit
      vote, reports, checkpoint stalls; slightly negative when the rank that finished last
      was not the one with the longest step, since a step's end is the last rank's and its
      time the slowest rank's).

    None when the events hold no step with ``completed_at``.
    """
    starts, dones = of_kind(events, "start"), of_kind(events, "done")
    steps = sorted((e for e in of_kind(events, "step") if e.get("completed_at") is not None), key=_completed_at)
    if not starts or not dones or not steps:
        return None
    counted = {id(event) for event in counted_steps(events)}
    pauses = [e for e in events if e.get("event") in PAUSE_EVENTS and e.get("time") is not None]
    parts = dict.fromkeys(("useful_s", "redone_s", "hang_wait_s", "recovery_s", "between_steps_s"), 0.0)
    for event in steps:
        parts["useful_s" if id(event) in counted else "redone_s"] += event["step_time_s"]
    for before, after in zip(steps, steps[1:], strict=False):
        ended, began = _completed_at(before), _completed_at(after) - after["step_time_s"]
        inside = [e for e in pauses if ended <= e["time"] <= began]
        hangs = [e["time"] for e in inside if e["event"] == "failure" and "hang" in str(e.get("kind"))]
        waited = min(hangs) - ended if hangs else 0.0
        parts["hang_wait_s"] += waited
        parts["recovery_s" if inside else "between_steps_s"] += began - ended - waited
    first_began = _completed_at(steps[0]) - steps[0]["step_time_s"]
    wall_s = dones[-1]["time"] - starts[0]["time"]
    return {
        "wall_s": round(wall_s, 3),
        "start_s": round(first_began - starts[0]["time"], 3),
        "end_s": round(dones[-1]["time"] - _completed_at(steps[-1]), 3),
        **{name: round(value, 3) for name, value in parts.items()},
    }


def _completed_at(event: dict[str, Any]) -> float:
    return float(event["completed_at"])


def _restored_from_memory(event: dict[str, Any]) -> bool:
    return event.get("source") == "peer_memory"


def steps_lost(events: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Steps lost by the recoveries, apart for restores from peer memory, from storage and the rest."""
    recovered = of_kind(events, "recovered")
    from_memory = [e for e in recovered if e.get("cause") == "restore" and _restored_from_memory(e)]
    from_storage = [e for e in recovered if e.get("cause") == "restore" and not _restored_from_memory(e)]
    in_place = [e for e in recovered if e.get("cause") != "restore"]
    return {
        "replica_survived": sum(e["lost_steps"] for e in in_place),
        "from_peer_memory": sum(e["lost_steps"] for e in from_memory),
        "from_storage": sum(e["lost_steps"] for e in from_storage),
        "total": sum(e["lost_steps"] for e in recovered),
        # Step events a restore rewound (exact while no step is applied twice without one: the
        # invariant report's ``steps`` check).
        "redone_after_restores": len(of_kind(events, "step")) - len(counted_steps(events)),
        "recoveries_replica_survived": len(in_place),
        "recoveries_from_peer_memory": len(from_memory),
        "recoveries_from_storage": len(from_storage),
    }


def faults_landed(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``failure`` plus ``drain`` events (see the module docstring), with what they were."""
    failures, drains = of_kind(events, "failure"), of_kind(events, "drain")
    by_kind: dict[str, int] = {}
    for event in failures:
        by_kind[str(event["kind"])] = by_kind.get(str(event["kind"]), 0) + 1
    for event in drains:
        key = f"drain ({event.get('reason')})"
        by_kind[key] = by_kind.get(key, 0) + 1
    saves_failed = [e for e in of_kind(events, "checkpoint_failed") if e.get("reason") == "storage"]
    return {
        "total": len(failures) + len(drains),
        "failure_events": len(failures),
        "drain_events": len(drains),
        "by_kind": dict(sorted(by_kind.items())),
        "saves_failed_on_storage": len(saves_failed),
    }


def slowest_recovery(events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    recovered = of_kind(events, "recovered")
    if not recovered:
        return None
    slowest = max(recovered, key=lambda e: e["mttr_s"])
    return {"mttr_s": slowest["mttr_s"], "cause": slowest.get("cause")}


def chaos_figures(
    events: Sequence[dict[str, Any]], *, scheduled: int, survived: bool, uninterrupted: Sequence[dict[str, Any]] | None
) -> dict[str, Any]:
    """Every figure of the chaos run; ``survived``: it finished and every invariant held."""
    landed = faults_landed(events)
    ours = goodput(events)
    reference = goodput(uninterrupted) if uninterrupted else None
    ratio = (
        round(ours["goodput"] / reference["goodput"], 4)
        if reference and ours["goodput"] is not None and reference["goodput"]
        else None
    )
    return {
        "faults_scheduled": scheduled,
        "faults_landed": landed,
        "faults_survived": landed["total"] if survived else None,
        "steps_lost": steps_lost(events),
        "restores_from_storage": len([e for e in of_kind(events, "restored") if not _restored_from_memory(e)]),
        "restores_from_peer_memory": len([e for e in of_kind(events, "restored") if _restored_from_memory(e)]),
        "goodput": ours,
        "uninterrupted_goodput": reference,
        "goodput_ratio_vs_uninterrupted": ratio,
        "slowest_recovery": slowest_recovery(events),
        "time_breakdown": time_breakdown(events),
        "uninterrupted_time_breakdown": time_breakdown(uninterrupted) if uninterrupted else None,
    }


def goals(figures: dict[str, Any], *, survived: bool) -> dict[str, bool | None]:
    """The three goal lines, judged from ``chaos_figures``."""
    value = figures["goodput"]["goodput"]
    return {
        "every_fault_survived": survived,
        "0_steps_lost_where_a_replica_survived": figures["steps_lost"]["replica_survived"] == 0,
        f"goodput>={GOODPUT_GOAL:.0%}": None if value is None else value >= GOODPUT_GOAL,
    }


# ------------------------------------------------------------------ Ray Train
def split_for_reference(schedule: Sequence[Any]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The schedule's faults Ray Train meets as given (``[{"kind", "step", "rank"}]``), and the
    others, each with why not (``{"hang@31:2": why}``). ``schedule``: ``FaultSpec`` values."""
    applied, not_applied = [], {}
    for fault in schedule:
        kind = str(fault.kind)
        if str(fault.phase) == "configure":
            not_applied[fault.describe()] = NOT_APPLIED_WHY["configure"]
        elif kind in REFERENCE_KINDS:
            applied.append({"kind": kind, "step": fault.step, "rank": fault.rank})
        else:
            not_applied[fault.describe()] = NOT_APPLIED_WHY.get(kind, "not reproduced in the reference")
    return applied, not_applied


def describe_fault(fault: dict[str, Any]) -> str:
    return f"{fault['kind']}@{fault['step']}:{fault['rank']}"


def attempt_at(records: Sequence[dict[str, Any]], at: float) -> int:
    """The reference's attempt running at wall time ``at``: the latest one started by then."""
    return max((r["attempt"] for r in records if r["kind"] == "start" and r["time"] <= at), default=1)


def reference_restarts(
    records: Sequence[dict[str, Any]], fired: Sequence[tuple[dict[str, Any], float]], *, world_size: int
) -> list[dict[str, Any]]:
    """Per fault that fired (the fault, its wall time): the restart of the group it caused.

    ``lost_steps``: steps every worker completed before the fault that the next attempt redid
    (it resumed from an earlier checkpoint); ``restart_s``: from the fault to the first step the
    next attempt completed (None when it completed none before the next fault).
    """
    attempts = completions_by_attempt(records, world_size)
    restarts = []
    for fault, at in sorted(fired, key=lambda pair: pair[1]):
        attempt = attempt_at(records, at)
        starts = [r for r in records if r["kind"] == "start" and r["attempt"] == attempt]
        resumed_before = min((r["resumed_from"] for r in starts), default=0)
        done_before = [step for step, done_at in attempts.get(attempt, {}).items() if done_at <= at]
        last_before = max(done_before, default=resumed_before)
        next_starts = [r for r in records if r["kind"] == "start" and r["attempt"] == attempt + 1]
        resumed_from = min((r["resumed_from"] for r in next_starts), default=None)
        after = attempts.get(attempt + 1, {})
        restarts.append(
            {
                "fault": describe_fault(fault),
                "restart_s": round(after[min(after)] - at, 3) if after else None,
                "lost_steps": None if resumed_from is None else max(0, last_before - resumed_from),
                "resumed_from": resumed_from,
            }
        )
    return restarts


def reference_goodput(records: Sequence[dict[str, Any]], *, wall_s: float, world_size: int) -> dict[str, Any]:
    """Time inside the steps that count (each step's last whole completion, its slowest worker's
    ``step_time_s``) over the wall time of ``TorchTrainer.fit()``."""
    step_times: dict[tuple[int, int], list[float]] = {}
    for record in records:
        if record["kind"] == "step" and record.get("step_time_s") is not None:
            step_times.setdefault((record["attempt"], record["step"]), []).append(record["step_time_s"])
    last: dict[int, float] = {}
    for (_, step), times in sorted(step_times.items()):
        if len(times) == world_size:
            last[step] = max(times)
    useful_s = sum(last.values())
    return {
        "goodput": round(useful_s / wall_s, 4) if wall_s else None,
        "useful_s": round(useful_s, 3),
        "wall_s": round(wall_s, 3),
        "steps_counted": len(last),
    }
