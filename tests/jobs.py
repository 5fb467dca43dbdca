"""Running real jobs from tests: the demo config with overrides, events read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.config import load_config
from orchestrator.events import read_events
from orchestrator.run import RunResult, run_training

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "configs" / "tiny-3d.yaml"


def train(run_dir: Path, *overrides: str, config: Path = DEMO_CONFIG) -> tuple[RunResult, list[dict[str, Any]]]:
    job = load_config(config, [f"data.path={REPO / 'data' / 'sample.txt'}", *overrides])
    result = run_training(job, run_dir)
    return result, read_events(run_dir / "events.jsonl")


def losses(events: list[dict[str, Any]]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def single_rank(*overrides: str) -> tuple[str, ...]:
    return ("parallelism.dp_replicate=1", "parallelism.dp_shard=1", "parallelism.tp=1", "parallelism.pp=1",
            "parallelism.pp_schedule=1f1b", "parallelism.stages_per_rank=null", *overrides)
