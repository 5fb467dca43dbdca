"""Plain torchrun training of the same model on the same mesh: the reference meshpilot is measured against.

    torchrun --nproc-per-node 8 bench/torchrun_reference.py configs/tiny-3d.yaml --steps 20 --out losses.json

No Ray, no controller, no reporting: ``torch.distributed`` started by torchrun, then this
repository's Trainer (the same model, parallelisation and step as the rank actors run).
Rank 0 writes per-step losses and step times to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from orchestrator.config import load_config  # noqa: E402
from orchestrator.driver.train_spec import data_bytes, train_spec  # noqa: E402
from workers.runtime import make_source, pick_device  # noqa: E402
from workers.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    overrides = list(args.overrides) + ([f"training.steps={args.steps}"] if args.steps else [])
    config = load_config(args.config, overrides)
    spec = train_spec(config, backend="gloo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.collective_timeout_s))
    rank = dist.get_rank()
    device = pick_device(spec.backend)
    source = make_source(spec, data_bytes(config))
    trainer = Trainer(spec, config.mesh, rank, device=device, source=source)
    trainer.init_weights()
    records = []
    for step in range(1, spec.steps + 1):
        result = trainer.train_step(step)
        records.append({"step": step, "loss": result.loss, "step_time_s": result.step_time_s,
                        "dp_rank": trainer.dp_rank, "completed_at": time.time(), "phases": result.phases})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if rank == 0 and args.out:
        losses = {}
        for rank_records in gathered:
            for record in rank_records:
                if record["loss"] is not None:
                    losses.setdefault(record["step"], []).append(record["loss"])
        rank_phases = records[0]["phases"] if records else {}
        steps = [
            {"step": step, "loss": sum(values) / len(values),
             "step_time_s": max(r["step_time_s"] for rr in gathered for r in rr if r["step"] == step),
             "completed_at": max(r["completed_at"] for rr in gathered for r in rr if r["step"] == step),
             "phases_s": {phase: max(r["phases"][phase] for rr in gathered for r in rr if r["step"] == step)
                          for phase in rank_phases}}
            for step, values in sorted(losses.items())
        ]
        Path(args.out).write_text(json.dumps({
            "steps": steps,
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
