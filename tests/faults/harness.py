"""The fault-injection harness: real jobs on the session's Ray cluster, faults keyed by (rank, step).

Every scenario runs the demo model on a small elastic layout and compares with the same job
run without faults: the run must reach its target step, every step must appear exactly once,
and per-step losses must match the uninterrupted run (same global batch, so the same math
whatever mesh carried each step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import load_config
from orchestrator.driver.run import RunResult, run_training
from orchestrator.observe.events import read_events
from tests.fixtures.worker_nodes import NODE_RESOURCE
from tests.jobs import DEMO_CONFIG, FIXED_SNAPSHOTS, REPO, losses
from workers.faults import FaultSpec

# Two replica groups of two ranks: one can be lost and the job goes on in place.
ELASTIC_LAYOUT = (
    "parallelism.dp_replicate=2",
    "parallelism.dp_shard=2",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "training.seq_len=64",
    "elastic.hang_timeout_s=8",
    "elastic.heartbeat_timeout_s=10",
)


# Ranks that need this custom resource run only on the worker nodes the node tests add.
# One replica group of 4 ranks: a lost rank's state can only come back from peer memory or storage.
ONE_REPLICA = (
    "parallelism.dp_replicate=1",
    "parallelism.dp_shard=4",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "training.seq_len=32",
    "elastic.hang_timeout_s=8",
)
ON_WORKER_NODES = f"runtime.resources_per_rank={{{NODE_RESOURCE}: 1}}"


def run_job(
    run_dir: Path,
    *overrides: str,
    faults: tuple[str, ...] = (),
    node_fault=None,
    network_fault=None,
    on_event=None,
    chaos_seed: int | None = None,
) -> tuple[RunResult, list[dict[str, Any]]]:
    """Train the demo model with ``overrides``; ``on_event(event)`` sees every event as it happens."""
    config = load_config(DEMO_CONFIG, [f"data.path={REPO / 'data' / 'sample.txt'}", FIXED_SNAPSHOTS, *overrides])
    subscribers = [_Callback(on_event)] if on_event else []
    result = run_training(
        config,
        run_dir,
        faults=tuple(FaultSpec.parse(f) for f in faults),
        node_fault=node_fault,
        network_fault=network_fault,
        subscribers=subscribers,
        chaos_seed=chaos_seed,
    )
    return result, read_events(run_dir / "events.jsonl")


class _Callback:
    def __init__(self, function) -> None:
        self.on_event = function


def of_kind(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def before_grow(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The events of ``kind`` before the mesh first grew back: a shrunk job whose lost rank's
    actor restarts in time grows back before its end, and that grow restores (and reports
    ``restored``) as well."""
    grows = [i for i, e in enumerate(events) if e["event"] == "grow"]
    return of_kind(events[: grows[0]] if grows else events, kind)


def assert_completed_like(
    events: list[dict[str, Any]], reference: dict[int, float], steps: int, rel: float = 1e-4
) -> None:
    """Every step once, in order, with the uninterrupted run's loss: nothing skipped or repeated."""
    step_events = of_kind(events, "step")
    assert [e["step"] for e in step_events] == list(range(1, steps + 1))
    got = losses(events)
    partial = {e["step"] for e in step_events if e.get("loss_partial")}
    for step in range(1, steps + 1):
        if step not in partial:  # a rank that died before reporting took its slice's loss along
            assert got[step] == pytest.approx(reference[step], rel=rel), f"step {step}"
    done = events[-1]
    assert done["event"] == "done" and done["status"] == "finished" and done["steps"] == steps
