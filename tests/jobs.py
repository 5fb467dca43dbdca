"""Running real jobs from tests: the demo config with overrides, events read back."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from orchestrator.config import load_config
from orchestrator.driver.run import RunResult, run_training
from orchestrator.observe.events import read_events

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "configs" / "tiny-3d.yaml"
# Snapshots exactly every elastic.snapshot_interval_steps: faults land at fixed steps, so which
# snapshot a restore takes must not depend on how fast this machine copies (the adaptive
# cadence has its own tests).
FIXED_SNAPSHOTS = "elastic.snapshot_overhead_limit=0"


def train(run_dir: Path, *overrides: str, config: Path = DEMO_CONFIG) -> tuple[RunResult, list[dict[str, Any]]]:
    job = load_config(config, [f"data.path={REPO / 'data' / 'sample.txt'}", FIXED_SNAPSHOTS, *overrides])
    result = run_training(job, run_dir)
    return result, read_events(run_dir / "events.jsonl")


def losses(events: list[dict[str, Any]]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def single_rank(*overrides: str) -> tuple[str, ...]:
    return (
        "parallelism.dp_replicate=1",
        "parallelism.dp_shard=1",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "parallelism.pp_schedule=1f1b",
        "parallelism.stages_per_rank=null",
        *overrides,
    )


def signal_after_step(
    process: subprocess.Popen, run_dir: Path, signum: int, *, step: int = 1, wait_s: float = 180, exit_s: float = 90
) -> str:
    """Send ``signum`` to a ``meshpilot train`` process once ``step`` is in its events, wait for
    it to exit and return its output; the process is killed if it outlives the test."""
    try:
        deadline = time.monotonic() + wait_s
        path = run_dir / "events.jsonl"
        while not (path.exists() and any(e["event"] == "step" and e["step"] >= step for e in read_events(path))):
            assert time.monotonic() < deadline, f"no step {step} within {wait_s:g} s"
            time.sleep(0.2)
        process.send_signal(signum)
        output, _ = process.communicate(timeout=exit_s)
        return output
    finally:
        if process.poll() is None:
            process.kill()
