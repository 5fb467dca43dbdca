"""Driver-loss benchmark: a killed driver's live ranks adopted (``runtime.survive_driver_loss``)
against today's restart from the newest checkpoint.

    python bench/adoption.py            # 40 steps, the driver SIGKILLed after step 10 (~1.5 min on 2 cores)
    python bench/adoption.py --quick    # 16 steps, killed after step 4

A Ray cluster for the option (``ray.cluster_utils.Cluster``, which outlives every driver, as a
KubeRay head does) and one job: the demo model (debug preset) on the sample text, 2 ranks as dp_shard=2,
seq_len 32, a checkpoint every 4 steps on local disk. Each side runs ``meshpilot train`` as a
process killed by ``--inject driver@K``, then a second ``meshpilot train --resume-run RUN_DIR``:

1. meshpilot with the option: the second driver adopts the ranks the first left.
2. The reference, without it, as ``meshpilot train`` runs today (its embedded cluster, which dies
   with the driver): the ranks die with the driver; the second starts a cluster and resumes from
   the newest checkpoint.

For each: from the second process's launch to the completion of the first step it trains
(``completed_at`` of the first step after the ``adopted`` or ``restored`` event), and the steps
lost (applied twice in the record). The last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, emit

CHECKPOINT_EVERY = 4


def _train(run_dir: Path, steps: int, surviving: bool, checkpoints: Path, *extra: str) -> list[str]:
    overrides = [
        f"data.path={REPO / 'data' / 'sample.txt'}",
        "parallelism.dp_replicate=1",
        "parallelism.dp_shard=2",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "training.seq_len=32",
        f"training.steps={steps}",
        f"checkpoint.uri={checkpoints}",
        f"checkpoint.interval_steps={CHECKPOINT_EVERY}",
        f"runtime.survive_driver_loss={'true' if surviving else 'false'}",
    ]
    config = REPO / "configs" / "tiny-3d.yaml"
    return (
        [sys.executable, "-m", "orchestrator.cli", "train", str(config), "--plain", "--run-dir", str(run_dir)]
        + [f"--set={override}" for override in overrides]
        + list(extra)
    )


def _side(work: Path, name: str, *, steps: int, kill_at: int, surviving: bool, env: dict[str, str]) -> dict[str, Any]:
    run_dir, checkpoints = work / name, work / f"{name}-checkpoints"
    first = subprocess.run(
        _train(run_dir, steps, surviving, checkpoints, "--inject", f"driver@{kill_at}"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if first.returncode != -9:
        raise SystemExit(f"{name}: the first driver was not killed: {first.stdout[-2000:]}{first.stderr[-2000:]}")
    launched = time.time()
    second = subprocess.run(
        _train(run_dir, steps, surviving, checkpoints, "--resume-run", str(run_dir)),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if second.returncode != 0:
        raise SystemExit(f"{name}: the second driver failed: {second.stdout[-2000:]}{second.stderr[-2000:]}")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    resumed = next(e for e in events if e["event"] in ("adopted", "restored"))
    first_step = next(
        e for e in events[events.index(resumed) :] if e["event"] == "step" and e["step"] > resumed["step"]
    )
    applied = [e["step"] for e in events if e["event"] == "step"]
    return {
        "resumed_by": resumed["event"],
        "resumed_at_step": resumed["step"],
        "first_step_s": round(first_step["completed_at"] - launched, 2),
        "lost_steps": len(applied) - len(set(applied)),
        "every_step": sorted(set(applied)) == list(range(1, steps + 1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 steps, the driver killed after step 4")
    args = parser.parse_args()
    steps, kill_at = (16, 4) if args.quick else (40, 10)

    import ray
    from ray.cluster_utils import Cluster

    sys.path.insert(0, str(REPO))
    from orchestrator.driver.cluster import worker_pythonpath

    os.environ["PYTHONPATH"] = worker_pythonpath()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "include_dashboard": False})
    work = Path(tempfile.mkdtemp(prefix="meshpilot-adoption-"))
    try:
        env = {**os.environ, "RAY_ADDRESS": cluster.address}
        # Today's behaviour: ``meshpilot train`` on the embedded cluster it starts, which dies with
        # the driver.
        embedded = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
        ours = _side(work, "adopt", steps=steps, kill_at=kill_at, surviving=True, env=env)
        print(f"meshpilot, ranks adopted: {ours}", flush=True)
        reference = _side(work, "restart", steps=steps, kill_at=kill_at, surviving=False, env=embedded)
        print(f"reference, restart from the checkpoint: {reference}", flush=True)
        ray.init(address=cluster.address, logging_level=logging.WARNING)
        left = ray.util.list_named_actors(all_namespaces=True)
        ray.shutdown()
    finally:
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    emit(
        {
            "benchmark": "adoption",
            "steps": steps,
            "driver_killed_after_step": kill_at,
            "meshpilot": ours,
            "reference": reference,
            "first_step_ratio": round(ours["first_step_s"] / reference["first_step_s"], 3),
            "named_actors_left": len(left),
        }
    )


if __name__ == "__main__":
    main()
