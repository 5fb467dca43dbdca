"""Resume: save at step 2 under dp_shard=2, restore under the same mesh and under tp=2, train on.

The losses of steps 3 and 4 must match an uninterrupted dp_shard=2 run (data and learning rate
are functions of the step; model and AdamW state come from the checkpoint on real S3): exactly on
the same mesh, within float tolerance on the other (different reduction order).
"""

from __future__ import annotations

import os
import queue
import time
import traceback

import pytest

from checkpointing.commit import CommitCoordinator
from checkpointing.storage import open_storage
from tests.ranks.spawned_ranks import rank_context

SAVE_AT, LAST = 2, 4


def train_spec():
    from workers.spec import PRESETS, TrainSpec

    return TrainSpec(
        model=PRESETS["debug"],
        steps=LAST,
        global_batch=4,
        seq_len=32,
        microbatch_size=1,
        lr=1e-3,
        warmup_steps=1,
        seed=0,
        data_source="synthetic",
    )


def rank_main(rank: int, task: dict, results) -> None:
    import torch
    import torch.distributed as dist

    from checkpointing.catalog import latest_committed
    from checkpointing.reader import load_manifest, restore
    from checkpointing.writer import CheckpointWriter
    from elastic.spec import MeshSpec
    from workers.data import SyntheticSource
    from workers.trainer import Trainer

    try:
        torch.set_num_threads(1)
        os.environ.update(task["env"])
        dist.init_process_group("gloo", init_method=f"file://{task['init_file']}", rank=rank, world_size=2)
        spec = train_spec()
        source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
        storage = open_storage(task["uri"], endpoint_url=task["endpoint_url"])

        def trainer(mesh: MeshSpec) -> Trainer:
            return Trainer(spec, mesh, rank, device=torch.device("cpu"), source=source)

        uninterrupted = trainer(MeshSpec(dp_shard=2))
        uninterrupted.init_weights()
        for step in range(1, LAST + 1):
            results.put(("loss", rank, ("uninterrupted", step, uninterrupted.train_step(step).loss)))
        uninterrupted.close()

        first = trainer(MeshSpec(dp_shard=2))
        first.init_weights()
        for step in range(1, SAVE_AT + 1):
            first.train_step(step)
        writer = CheckpointWriter(
            storage, rank=rank, report=lambda r: results.put(("report", rank, r)), mesh=first.world_mesh
        )
        writer.save(
            SAVE_AT,
            {k: v.detach() for k, v in first.named_state().items()},
            extra={"step": SAVE_AT},
            owns_plain_tensors=rank == 0,
        )
        writer.close()
        first.close()
        deadline = time.monotonic() + 60
        while latest_committed(storage) != SAVE_AT:  # the driver (test process) commits
            assert time.monotonic() < deadline, "step 2 was never committed"
            time.sleep(0.05)

        manifest = load_manifest(storage, SAVE_AT)
        for name, mesh in (("same", MeshSpec(dp_shard=2)), ("resumed", MeshSpec(tp=2))):
            resumed = trainer(mesh)
            resumed.ensure_optimizer_state()
            restore(storage, manifest, resumed.named_state(), model=task["model"])
            for step in range(manifest.extra["step"] + 1, LAST + 1):
                results.put(("loss", rank, (name, step, resumed.train_step(step).loss)))
            resumed.close()
        storage.close()
        dist.destroy_process_group()
        results.put(("done", rank, None))
    except BaseException:  # noqa: BLE001 - reported to the test process, whatever it was
        results.put(("error", rank, traceback.format_exc()))


def test_resume_under_another_mesh_matches_uninterrupted_losses(s3_bucket, tmp_path):
    model = train_spec().model.to_dict()
    storage = open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url)
    coordinator = CommitCoordinator(
        storage, world_size=2, mesh={"dp_shard": 2}, config_hash=None, model=model, keep_last=2
    )
    task = {
        "uri": s3_bucket.uri,
        "endpoint_url": s3_bucket.endpoint_url,
        "env": s3_bucket.server.env(),
        "init_file": str(tmp_path / "init"),
        "model": model,
    }
    context = rank_context()
    results = context.Queue()
    ranks = [context.Process(target=rank_main, args=(rank, task, results), daemon=True) for rank in range(2)]
    for process in ranks:
        process.start()
    losses: dict[tuple[str, int], list[float]] = {}  # each data-parallel slice reports its mean
    done = 0
    try:
        while done < 2:
            try:
                kind, rank, payload = results.get(timeout=300)
            except queue.Empty:
                pytest.fail("ranks did not finish within 300 s")
            if kind == "error":
                pytest.fail(f"rank {rank} failed:\n{payload}")
            if kind == "report":
                coordinator.on_report(payload)
            elif kind == "loss" and payload[2] is not None:
                losses.setdefault(payload[:2], []).append(payload[2])
            done += kind == "done"
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert coordinator.committed_steps == [SAVE_AT]
    mean = {key: sum(values) / len(values) for key, values in losses.items()}
    for step in range(SAVE_AT + 1, LAST + 1):
        assert mean[("same", step)] == pytest.approx(mean[("uninterrupted", step)], rel=1e-6), step
        assert mean[("resumed", step)] == pytest.approx(mean[("uninterrupted", step)], rel=1e-4), step
    storage.close()
