"""Orchestration overhead: meshpilot train vs plain torchrun, same model, mesh, data, machine.

    python bench/overhead.py [--quick] [--config configs/tiny-3d.yaml]

Measures, in one run, (1) steady-state step time — the median wall-clock gap between
consecutive step completions after warm-up — and (2) the time from the command to the first
completed step, for `meshpilot train` (embedded Ray cluster, rank actors, reporting, commit
vote) and for `torchrun bench/torchrun_reference.py` (the same Trainer, nothing else).
Rounds alternate the order (torchrun first, then meshpilot first, ...) and the medians over
rounds are reported, because a shared 2-core machine drifts by more than the effect.
Goals: step-time ratio <= 1.05; start-up at most 5 s more than torchrun.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, emit, run_command, steady_step_time  # noqa: E402
from orchestrator.config import load_config  # noqa: E402
from orchestrator.observe.events import read_events  # noqa: E402


def median_phases(steps: list[dict], warmup: int) -> dict[str, float]:
    """Per phase of the step (slowest rank), the median over the steps after warm-up."""
    steady = [s["phases_s"] for s in steps[warmup:] if s.get("phases_s")]
    return {phase: round(statistics.median(p[phase] for p in steady), 4) for phase in (steady[0] if steady else {})}


def measure_torchrun(config: Path, steps: int, world: int, workdir: Path) -> tuple[float, list[dict]]:
    out = workdir / "torchrun.json"
    launched, _ = run_command(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={world}",
            "bench/torchrun_reference.py",
            str(config),
            "--steps",
            str(steps),
            "--out",
            str(out),
        ],
        timeout=1800,
    )
    records = json.loads(out.read_text())["steps"]
    return records[0]["completed_at"] - launched, records


def measure_meshpilot(config: Path, steps: int, workdir: Path) -> tuple[float, list[dict]]:
    run_dir = workdir / "meshpilot-run"
    launched, _ = run_command(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "train",
            str(config),
            "--run-dir",
            str(run_dir),
            "--set",
            f"training.steps={steps}",
            "--set",
            "metrics.enabled=false",
            "--plain",
        ],
        timeout=1800,
    )
    records = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "step"]
    return records[0]["completed_at"] - launched, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny-3d.yaml"))
    parser.add_argument("--quick", action="store_true", help="one short round (noisy)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds, alternating the order (default 2)")
    args = parser.parse_args()
    steps, warmup = (12, 3) if args.quick else (40, 5)
    rounds = args.rounds or (1 if args.quick else 2)
    config = Path(args.config)
    world = load_config(config).mesh.world_size
    ours_steps: list[float] = []
    reference_steps: list[float] = []
    ours_starts: list[float] = []
    reference_starts: list[float] = []
    phases: dict[str, list[dict[str, float]]] = {"meshpilot": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(rounds):
            workdir = Path(tmp) / f"round-{round_index}"
            workdir.mkdir()
            order = ("torchrun", "meshpilot") if round_index % 2 == 0 else ("meshpilot", "torchrun")
            for which in order:
                if which == "torchrun":
                    start, records = measure_torchrun(config, steps, world, workdir)
                    starts, step_times = reference_starts, reference_steps
                else:
                    start, records = measure_meshpilot(config, steps, workdir)
                    starts, step_times = ours_starts, ours_steps
                starts.append(start)
                step_times.append(steady_step_time([r["completed_at"] for r in records], warmup))
                phases[which].append(median_phases(records, warmup))
            print(
                f"round {round_index + 1}: step {ours_steps[-1]:.3f} s vs {reference_steps[-1]:.3f} s; "
                f"first step {ours_starts[-1]:.1f} s vs {reference_starts[-1]:.1f} s",
                flush=True,
            )
    ours, reference = statistics.median(ours_steps), statistics.median(reference_steps)
    ours_start, torchrun_start = statistics.median(ours_starts), statistics.median(reference_starts)
    result = {
        "benchmark": "overhead",
        "config": str(config.relative_to(REPO)) if config.is_relative_to(REPO) else str(config),
        "world_size": world,
        "steps": steps,
        "rounds": rounds,
        "meshpilot_step_s": round(ours, 4),
        "torchrun_step_s": round(reference, 4),
        "step_time_ratio": round(ours / reference, 3),
        "meshpilot_first_step_s": round(ours_start, 2),
        "torchrun_first_step_s": round(torchrun_start, 2),
        "first_step_extra_s": round(ours_start - torchrun_start, 2),
        # Where the step's time goes (slowest rank, medians): sync_s is the gradient clip plus,
        # for meshpilot, the commit vote.
        "phases_s": {
            which: {phase: round(statistics.median(r[phase] for r in rounds_), 4) for phase in rounds_[0]}
            for which, rounds_ in phases.items()
            if rounds_ and rounds_[0]
        },
        "per_round": {
            "meshpilot_step_s": ours_steps,
            "torchrun_step_s": reference_steps,
            "meshpilot_first_step_s": ours_starts,
            "torchrun_first_step_s": reference_starts,
        },
    }
    print(
        f"steady step: meshpilot {ours:.3f} s vs torchrun {reference:.3f} s (x{ours / reference:.3f}); "
        f"command to first step: {ours_start:.1f} s vs {torchrun_start:.1f} s"
    )
    emit(result)


if __name__ == "__main__":
    main()
