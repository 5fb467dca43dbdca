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
from orchestrator.events import read_events  # noqa: E402


def measure_torchrun(config: Path, steps: int, world: int, workdir: Path) -> tuple[float, list[float]]:
    out = workdir / "torchrun.json"
    launched, _ = run_command(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
         "bench/torchrun_reference.py", str(config), "--steps", str(steps), "--out", str(out)],
        timeout=1800)
    completions = [s["completed_at"] for s in json.loads(out.read_text())["steps"]]
    return completions[0] - launched, completions


def measure_meshpilot(config: Path, steps: int, workdir: Path) -> tuple[float, list[float]]:
    run_dir = workdir / "meshpilot-run"
    launched, _ = run_command(
        [sys.executable, "-m", "orchestrator.cli", "train", str(config), "--run-dir", str(run_dir),
         "--set", f"training.steps={steps}", "--set", "metrics.enabled=false", "--plain"],
        timeout=1800)
    completions = [e["completed_at"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "step"]
    return completions[0] - launched, completions


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
    ours_steps, reference_steps, ours_starts, reference_starts = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(rounds):
            workdir = Path(tmp) / f"round-{round_index}"
            workdir.mkdir()
            order = ("torchrun", "meshpilot") if round_index % 2 == 0 else ("meshpilot", "torchrun")
            for which in order:
                if which == "torchrun":
                    start, completions = measure_torchrun(config, steps, world, workdir)
                    reference_starts.append(start)
                    reference_steps.append(steady_step_time(completions, warmup))
                else:
                    start, completions = measure_meshpilot(config, steps, workdir)
                    ours_starts.append(start)
                    ours_steps.append(steady_step_time(completions, warmup))
            print(f"round {round_index + 1}: step {ours_steps[-1]:.3f} s vs {reference_steps[-1]:.3f} s; "
                  f"first step {ours_starts[-1]:.1f} s vs {reference_starts[-1]:.1f} s", flush=True)
    ours, reference = statistics.median(ours_steps), statistics.median(reference_steps)
    ours_start, torchrun_start = statistics.median(ours_starts), statistics.median(reference_starts)
    result = {
        "benchmark": "overhead", "config": str(config.relative_to(REPO)) if config.is_relative_to(REPO) else str(config),
        "world_size": world, "steps": steps, "rounds": rounds,
        "meshpilot_step_s": round(ours, 4), "torchrun_step_s": round(reference, 4),
        "step_time_ratio": round(ours / reference, 3),
        "meshpilot_first_step_s": round(ours_start, 2), "torchrun_first_step_s": round(torchrun_start, 2),
        "first_step_extra_s": round(ours_start - torchrun_start, 2),
        "per_round": {"meshpilot_step_s": ours_steps, "torchrun_step_s": reference_steps,
                      "meshpilot_first_step_s": ours_starts, "torchrun_first_step_s": reference_starts},
    }
    print(f"steady step: meshpilot {ours:.3f} s vs torchrun {reference:.3f} s (x{ours / reference:.3f}); "
          f"command to first step: {ours_start:.1f} s vs {torchrun_start:.1f} s")
    emit(result)


if __name__ == "__main__":
    main()
