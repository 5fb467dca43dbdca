"""Plain torchrun training of the same model on the same mesh: the reference meshpilot is measured against.

    torchrun --nproc-per-node 8 bench/torchrun_reference.py configs/tiny-3d.yaml --steps 20 --out losses.json
    torchrun --nproc-per-node 8 bench/torchrun_reference.py configs/tiny-3d.yaml --quick   # 5 steps
    torchrun --nproc-per-node 2 bench/torchrun_reference.py configs/tiny-3d.yaml --quick \
        --set runtime.gpus_per_rank=1 --set parallelism.pp=1 --set parallelism.tp=1   # on 2 GPUs, NCCL

No Ray, no controller, no reporting: ``torch.distributed`` started by torchrun, then this
repository's Trainer (the same model, parallelisation and step as the rank actors run).
The backend and dtype are the job's, resolved as the driver resolves them (nccl and
bfloat16 with ``runtime.gpus_per_rank=1``, gloo and float32 without); with NCCL each
process drives the GPU of its ``LOCAL_RANK``, as TorchTitan's launcher sets it.
Rank 0 writes per-step losses and step times to ``--out`` as JSON (bench/overhead.py reads
them), and prints a summary as one JSON object, its last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import emit  # noqa: E402
from orchestrator.config import load_config  # noqa: E402
from orchestrator.driver.train_spec import data_bytes, train_spec  # noqa: E402
from workers.runtime import make_source  # noqa: E402
from workers.trainer import Trainer  # noqa: E402

QUICK_STEPS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=None, help="steps to train (default: the config's)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps unless --steps says otherwise")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    steps = args.steps or (QUICK_STEPS if args.quick else None)
    overrides = list(args.overrides) + ([f"training.steps={steps}"] if steps else [])
    config = load_config(args.config, overrides)
    spec = train_spec(config)
    torch.set_num_threads(1)
    device = rank_device(spec.backend, os.environ)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        spec.backend,
        timeout=timedelta(seconds=spec.collective_timeout_s),
        # Bound to its GPU, NCCL creates the communicator now rather than at the first collective.
        device_id=device if device.type == "cuda" else None,
    )
    rank = dist.get_rank()
    source = make_source(spec, data_bytes(config))
    trainer = Trainer(spec, config.mesh, rank, device=device, source=source)
    trainer.init_weights()
    records = []
    for step in range(1, spec.steps + 1):
        result = trainer.train_step(step)
        records.append(
            {
                "step": step,
                "loss": result.loss,
                "step_time_s": result.step_time_s,
                "dp_rank": trainer.dp_rank,
                "completed_at": time.time(),
                "phases": result.phases,
            }
        )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if rank == 0:
        # cast: all_gather_object has filled every slot with a rank's records, which mypy cannot see.
        steps = summarize_steps(cast(list[list[dict]], gathered))
        if args.out:
            Path(args.out).write_text(json.dumps({"steps": steps}))
        step_times = [step["step_time_s"] for step in steps]
        emit(
            {
                "benchmark": "torchrun_reference",
                "quick": args.quick,
                "world_size": dist.get_world_size(),
                "steps": len(steps),
                "median_step_time_s": round(statistics.median(step_times), 4) if step_times else None,
                "final_loss": steps[-1]["loss"] if steps else None,
            }
        )
    trainer.close()
    source.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    # Straight out, as the rank processes of the tests do: a process group's native threads met
    # in interpreter teardown once aborted a rank ("terminate called without an active
    # exception") after its work was done, failing the whole torchrun.
    os._exit(0)


def rank_device(backend: str, environ: Mapping[str, str]) -> torch.device:
    """This process's device (every rank, before the process group): with NCCL, the GPU of
    torchrun's ``LOCAL_RANK`` (torchrun leaves every GPU of the node visible, unlike Ray, which
    gives each rank actor its own as device 0); with gloo, the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank)


def summarize_steps(gathered: list[list[dict]]) -> list[dict]:
    """Per step, over every rank's records: the mean reported loss and the slowest rank's times."""
    losses: dict[int, list[float]] = {}
    for rank_records in gathered:
        for record in rank_records:
            if record["loss"] is not None:
                losses.setdefault(record["step"], []).append(record["loss"])
    rank_phases = gathered[0][0]["phases"] if gathered and gathered[0] else {}
    return [
        {
            "step": step,
            "loss": sum(values) / len(values),
            "step_time_s": max(r["step_time_s"] for rr in gathered for r in rr if r["step"] == step),
            "completed_at": max(r["completed_at"] for rr in gathered for r in rr if r["step"] == step),
            "phases_s": {
                phase: max(r["phases"][phase] for rr in gathered for r in rr if r["step"] == step)
                for phase in rank_phases
            },
        }
        for step, values in sorted(losses.items())
    ]


if __name__ == "__main__":
    main()
