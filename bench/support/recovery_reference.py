"""The reference for ``bench/recovery.py``: Ray Train V2's ``TorchTrainer`` training the same job.

Runs on the benchmark's driver (``run_reference``), and in Ray Train's worker processes
(``train_loop_per_worker``: every world rank runs it). The workers run this repository's own
``Trainer`` — the same model, FSDP2 layout (dp_replicate=2 x dp_shard=2, i.e. HSDP), data,
global batch and step as meshpilot's rank actors — inside the process group Ray Train sets
up (gloo, CPU), so the two sides differ only in what happens when something fails.

As Ray Train users do: ``ray.train.report`` after every step, a checkpoint every
``checkpoint_every`` steps (each rank writes its own shards; Ray Train merges them into one
directory under ``storage_path``), ``FailureConfig(max_failures=...)`` (1 by default), and on
(re)start the workers resume from ``ray.train.get_checkpoint()``. Every rank appends one JSON
line per event to ``records_dir/rank{R}.jsonl`` (local disk): ``start`` (attempt,
resumed_from), ``step`` (attempt, step, completed_at, step_time_s, loss), and ``kill`` or
``raise`` (the time it fired fault number ``fault`` of the run's list on itself).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHECKPOINT_FILE = "rank{rank}.safetensors"


# ---------------------------------------------------------------- worker side
def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Every Ray Train worker: resume from the last registered checkpoint, train, report each step."""
    import ray.train
    import torch
    from safetensors.torch import load_file, save_file

    from elastic.spec import MeshSpec
    from workers.data import TextSource
    from workers.trainer import Trainer

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank = context.get_world_rank()
    records = _Records(Path(config["records_dir"]) / f"rank{rank}.jsonl")
    spec, mesh = config["spec"], MeshSpec(**config["mesh"])
    source = TextSource(config["data"], seq_len=spec.seq_len, seed=spec.seed)
    trainer = Trainer(spec, mesh, rank, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    resumed_from = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            trainer.load_local_shards(load_file(os.path.join(directory, CHECKPOINT_FILE.format(rank=rank))))
            resumed_from = json.loads(Path(directory, "step.json").read_text())["step"]
    records.write("start", resumed_from=resumed_from, node=ray.get_runtime_context().get_node_id(), pid=os.getpid())
    faults = config.get("faults") or []
    for step in range(resumed_from + 1, spec.steps + 1):
        _fire_faults_due(faults, records, step)
        result = trainer.train_step(step)
        records.write("step", step=step, completed_at=time.time(), step_time_s=result.step_time_s, loss=result.loss)
        metrics = {"step": step, "loss": result.loss}
        if step % config["checkpoint_every"] == 0:
            with tempfile.TemporaryDirectory() as directory:
                save_file(trainer.local_shards(), os.path.join(directory, CHECKPOINT_FILE.format(rank=rank)))
                if rank == 0:
                    Path(directory, "step.json").write_text(json.dumps({"step": step}))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
        else:
            ray.train.report(metrics)


def _fire_faults_due(faults: list[dict[str, Any]], records: _Records, step: int) -> None:
    """At the start of ``step``: fire this rank's faults of that step not fired in an earlier attempt.

    ``faults``: ``[{"kind": "kill" | "raise", "step": S, "rank": R}, ...]``; ``kill`` SIGKILLs
    this process, ``raise`` raises in the training function. Each is recorded before it fires,
    so a restarted group that redoes step S does not fire it again.
    """
    for index, fault in enumerate(faults):
        if fault["rank"] != records.rank or fault["step"] != step or index in records.fired:
            continue
        records.write(fault["kind"], fault=index, time=time.time())
        if fault["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault {fault['kind']}@{step}:{records.rank}")


class _Records:
    """This rank's record file; the attempt number counts this rank's earlier starts, and
    ``fired`` holds the faults (their index in the run's list) this rank fired before."""

    def __init__(self, path: Path) -> None:
        self.path = path
        previous = read_records(path) if path.exists() else []
        self.attempt = 1 + sum(1 for r in previous if r["kind"] == "start")
        self.fired = {r["fault"] for r in previous if "fault" in r}
        self.rank = int(path.stem.removeprefix("rank"))

    def write(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "rank": self.rank, "attempt": self.attempt, "time": time.time(), **fields}
        with open(self.path, "a", encoding="utf-8") as handle:  # one write per line: a kill never tears one
            handle.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def all_records(records_dir: Path) -> list[dict[str, Any]]:
    return [r for path in sorted(Path(records_dir).glob("rank*.jsonl")) for r in read_records(path)]


# ---------------------------------------------------------------- driver side
def run_reference(
    *,
    spec,
    mesh: dict[str, int],
    data: bytes,
    workdir: Path,
    checkpoint_every: int,
    faults: list[dict[str, Any]] | None = None,
    max_failures: int = 1,
    resources_per_worker: dict[str, float],
    on_step: Callable[[list[dict[str, Any]]], None] | None = None,
    poll_s: float = 0.02,
) -> list[dict[str, Any]]:
    """Driver: one ``TorchTrainer.fit()`` on the connected Ray cluster; returns every rank's records.

    ``faults`` (see ``_fire_faults_due``) fire in the workers, each once; ``max_failures`` is
    Ray Train's failure budget (``FailureConfig``).
    ``on_step(records)`` is called from a watcher thread whenever new records appear, so the
    caller can inject a driver-side fault (remove a node) at a known step.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    records_dir = workdir / "records"
    records_dir.mkdir(parents=True, exist_ok=True)
    world_size = 1
    for degree in mesh.values():
        world_size *= degree
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "spec": spec,
            "mesh": mesh,
            "data": data,
            "records_dir": str(records_dir),
            "checkpoint_every": checkpoint_every,
            "faults": faults or [],
        },
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=world_size, use_gpu=False, resources_per_worker=resources_per_worker),
        run_config=RunConfig(
            name="reference",
            storage_path=str(workdir / "storage"),
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    stop = threading.Event()
    watcher = (
        threading.Thread(target=_watch, args=(records_dir, on_step, stop, poll_s), daemon=True) if on_step else None
    )
    if watcher:
        watcher.start()
    try:
        trainer.fit()
    finally:
        stop.set()
        if watcher:
            watcher.join()
    return all_records(records_dir)


def _watch(records_dir: Path, on_step, stop: threading.Event, poll_s: float) -> None:
    sizes: dict[Path, int] = {}
    while not stop.is_set():
        changed = False
        for path in records_dir.glob("rank*.jsonl"):
            size = path.stat().st_size
            if sizes.get(path) != size:
                sizes[path], changed = size, True
        if changed:
            on_step(all_records(records_dir))
        time.sleep(poll_s)
