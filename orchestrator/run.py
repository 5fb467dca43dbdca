"""Running one training job end to end on the driver: run directory, Ray, controller, events.

``run_training`` is what ``meshpilot train`` calls, and what tests call in-process (with the
session's Ray cluster already up, which it then reuses and leaves running).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import ray

from orchestrator import cluster
from orchestrator.config import JobConfig
from orchestrator.controller import Controller
from orchestrator.events import EventLog


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    status: str
    exit_code: int
    reason: str | None = None


def default_run_dir(config: JobConfig) -> Path:
    return Path("runs") / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_run_dir(config: JobConfig, run_dir: Path | None) -> Path:
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
    return run_dir


def run_training(config: JobConfig, run_dir: Path | None = None, *, subscribers: list | None = None) -> RunResult:
    """Train ``config`` to a terminal state; every event goes to RUN_DIR/events.jsonl."""
    run_dir = prepare_run_dir(config, run_dir)
    events = EventLog(run_dir / "events.jsonl", subscribers)
    started_here = False
    try:
        started_here = cluster.connect(config)
        controller = Controller(config, events)
        final = controller.run()
    finally:
        events.close()
        if started_here:
            ray.shutdown()
    return RunResult(run_dir=run_dir, status=final.status, exit_code=final.exit_code, reason=final.reason)
