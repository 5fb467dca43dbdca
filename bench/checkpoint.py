"""Checkpoint benchmark: loop stall, upload throughput and resharding restore, all in one run.

    python bench/checkpoint.py            # ~250 MB of model + optimizer state over 2 ranks
    python bench/checkpoint.py --quick    # ~60 MB, for a smoke run

Two ranks (spawned processes, gloo) hold a meshpilot Transformer sharded with FSDP2
(dp_shard=2) plus its AdamW state; a local SeaweedFS serves S3 with auth. Measured here,
each against a reference in the same run (medians of several rounds, rounds interleaved):

(a) loop stall of ``CheckpointWriter.save`` vs a plain ``clone()`` of the same local shards, and
    vs ``torch.distributed.checkpoint.async_save`` of the same state (to local disk);
(b) upload throughput of our writer vs boto3's own multipart ``upload_fileobj`` (TransferConfig
    with the same part size and concurrency) of the same bytes to the same server, both ranks
    uploading at once;
(c) restore time (slowest rank) into different meshes (tp=2, pp=2) vs into the same mesh (dp_shard=2).

The last stdout line is one JSON object with our figures, the references and the ratios.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit  # noqa: E402

PART_SIZE = 8 << 20
CONCURRENCY = 4


def model_spec(quick: bool):
    from workers.spec import ModelSpec

    if quick:
        return ModelSpec(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=4096, ffn_dim=768)
    return ModelSpec(dim=384, n_layers=8, n_heads=6, n_kv_heads=6, vocab_size=8192, ffn_dim=1024)


def build_state(spec, mesh_spec, rank: int) -> dict[str, torch.Tensor]:
    """Model parameters (DTensors) and AdamW state as the trainer names them."""
    from workers import parallelize as par
    from workers.initial_values import init_weights
    from workers.models import resolve_family

    family = resolve_family(spec.family)
    world_mesh = par.build_world_mesh(mesh_spec, "cpu")
    plan = par.stage_plans(spec, pp=mesh_spec.pp, pp_rank=mesh_spec.coords(rank).pp, stages_per_rank=1)[0]
    module = par.build_stage_module(family, spec, plan)
    if mesh_spec.tp > 1:
        par.apply_tensor_parallel(module, family, spec, world_mesh["tp"])
    par.apply_fsdp(module, par.data_parallel_mesh(world_mesh, mesh_spec), param_dtype=torch.float32, pipelined=False)
    par.materialize(module, torch.device("cpu"))
    init_weights(module, family, spec, seed=0)
    state: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        state[name] = param.detach()
        state[f"optim.{name}.exp_avg"] = param.detach() * 0.1
        state[f"optim.{name}.exp_avg_sq"] = param.detach() ** 2
        state[f"optim.{name}.step"] = torch.tensor(3.0)
    return state


def local_bytes(state) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in state.values())


def rank_main(rank: int, args: dict, results) -> None:
    try:
        results.put(("result", rank, _rank_main(rank, args, results)))
    except BaseException:  # noqa: BLE001 - reported to the parent process, whatever it was
        import traceback

        results.put(("error", rank, traceback.format_exc()))


def _rank_main(rank: int, args: dict, results) -> dict:
    import boto3
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    from torch.distributed.tensor import DTensor

    from checkpointing.spec import FailureReport, ShardReport
    from checkpointing.writer import CheckpointWriter
    from elastic.spec import MeshSpec
    from workers.checkpoints import rank_storage
    from workers.spec.train import CheckpointTarget

    torch.set_num_threads(1)
    os.environ.update(args["env"])
    dist.init_process_group("gloo", init_method=f"file://{args['init_file']}", rank=rank, world_size=2)
    # Built (and warmed) before the state, as a rank builds it while it configures.
    checkpoint_target = CheckpointTarget(
        uri=args["uri"], endpoint_url=args["endpoint_url"], part_size_bytes=PART_SIZE, upload_concurrency=CONCURRENCY
    )
    storage = rank_storage(checkpoint_target)
    spec = model_spec(args["quick"])
    state = build_state(spec, MeshSpec(dp_shard=2), rank)
    figures: dict[str, list[float]] = {
        k: []
        for k in (
            "clone",
            "ours",
            "dcp",
            "ours_upload_s",
            "boto3_upload_s",
            "restore_same",
            "restore_tp2",
            "restore_pp2",
        )
    }

    def deliver(report: ShardReport | FailureReport) -> None:
        """Runs on the writer's upload thread: the report goes to the parent's commit coordinator."""
        results.put(("report", rank, report))
        # The reports' upload_s comes back through the driver's queue; keep our own copy too.
        figures["ours_upload_s"].append(report.upload_s if isinstance(report, ShardReport) else 0.0)

    writer = CheckpointWriter(storage, rank=rank, report=deliver)
    client = boto3.client(
        "s3",
        endpoint_url=args["endpoint_url"],
        config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 5}),
    )
    transfer = TransferConfig(multipart_threshold=PART_SIZE, multipart_chunksize=PART_SIZE, max_concurrency=CONCURRENCY)
    bucket = args["uri"].split("/")[2]
    owns_plain = rank == 0
    first_stall = writer.save(0, state, extra={}, owns_plain_tensors=owns_plain)  # allocates the host buffer
    writer.wait()
    dcp_dir = tempfile.mkdtemp(prefix="bench-dcp-")
    rounds = 2 if args["quick"] else 5
    for round_number in range(1, rounds + 1):
        dist.barrier()
        started = time.perf_counter()
        clones = {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}
        figures["clone"].append(time.perf_counter() - started)
        del clones
        dist.barrier()
        figures["ours"].append(
            writer.save(round_number, state, extra={"round": round_number}, owns_plain_tensors=owns_plain)
        )
        writer.wait()
        dist.barrier()
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=os.path.join(dcp_dir, str(round_number)))
        figures["dcp"].append(time.perf_counter() - started)
        # Without an async_stager, DCP stages synchronously and hands back the upload's Future.
        assert isinstance(future, Future)
        future.result()
        dist.barrier()
        # (b) the same bytes our writer just uploaded, through boto3's own managed transfer.
        body = io.BytesIO(bytes(writer._free[0].memoryview()))
        started = time.perf_counter()
        client.upload_fileobj(body, bucket, f"run/boto3/rank{rank}-{round_number}", Config=transfer)
        figures["boto3_upload_s"].append(time.perf_counter() - started)
    writer.close()
    first_upload_s = figures["ours_upload_s"][0]
    figures["ours_upload_s"] = figures["ours_upload_s"][1:]  # the first save is reported on its own
    dist.barrier()
    _time_restores(storage, spec, state, rank=rank, rounds=rounds, figures=figures)
    dist.barrier()
    storage.close()
    dist.destroy_process_group()
    return {
        "figures": figures,
        "first_stall": first_stall,
        "first_upload_s": first_upload_s,
        "local_bytes": local_bytes(state),
        "shard_bytes": len(bytes(writer._free[0].memoryview())),
    }


def _time_restores(storage, spec, state, *, rank: int, rounds: int, figures: dict[str, list[float]]) -> None:
    """(c) Restore the last save (step ``rounds``) into the saving mesh (dp_shard=2), tp=2 and pp=2, interleaved.

    Both ranks call it; a barrier starts each timed restore.
    """
    import torch.distributed as dist

    from checkpointing.reader import load_manifest, restore
    from elastic.spec import MeshSpec

    manifest = load_manifest(storage, rounds)
    targets = {
        "restore_same": state,
        "restore_tp2": build_state(spec, MeshSpec(tp=2), rank),
        "restore_pp2": build_state(spec, MeshSpec(pp=2), rank),
    }
    for target in targets.values():  # warm-up: DCP's planner imports and caches on first use
        restore(storage, manifest, target)
    for _ in range(min(rounds, 3)):  # interleaved, so that noise from other processes hits all alike
        for name, target in targets.items():
            dist.barrier()
            started = time.perf_counter()
            restore(storage, manifest, target)
            figures[name].append(time.perf_counter() - started)


def run(quick: bool) -> dict:
    from checkpointing.commit import CommitCoordinator
    from checkpointing.local_s3 import LocalS3Server
    from checkpointing.storage import open_storage

    with LocalS3Server() as server, tempfile.TemporaryDirectory() as work:
        server.create_bucket("bench")
        os.environ.update(server.env())
        args: dict[str, Any] = {
            "quick": quick,
            "uri": "s3://bench/run",
            "endpoint_url": server.endpoint_url,
            "env": server.env(),
            "init_file": os.path.join(work, "init"),
        }
        storage = open_storage(args["uri"], endpoint_url=server.endpoint_url)
        coordinator = CommitCoordinator(
            storage, world_size=2, mesh={"dp_shard": 2}, config_hash=None, model={}, keep_last=2
        )
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        ranks = [context.Process(target=rank_main, args=(rank, args, results), daemon=True) for rank in range(2)]
        for process in ranks:
            process.start()
        outcomes: dict[int, dict[str, Any]] = {}
        try:
            while len(outcomes) < 2:
                kind, rank, payload = results.get(timeout=600)
                if kind == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{payload}")
                if kind == "report":
                    coordinator.on_report(payload)
                else:
                    outcomes[rank] = payload
        finally:
            for process in ranks:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
        storage.close()
    return summarize(outcomes, coordinator, quick)


def summarize(outcomes: dict, coordinator, quick: bool) -> dict:
    def slowest(name: str) -> float:
        """Per round, the slowest rank (the loop waits for it); median over rounds."""
        rounds = zip(*(outcomes[rank]["figures"][name] for rank in outcomes))
        return statistics.median(max(values) for values in rounds)

    shard_bytes = sum(o["shard_bytes"] for o in outcomes.values())
    stall, clone, dcp_stall = slowest("ours"), slowest("clone"), slowest("dcp")
    ours_upload, boto3_upload = slowest("ours_upload_s"), slowest("boto3_upload_s")
    same, tp2, pp2 = slowest("restore_same"), slowest("restore_tp2"), slowest("restore_pp2")
    figures = {
        "quick": quick,
        "ranks": 2,
        "state_mb": round(sum(o["local_bytes"] for o in outcomes.values()) / 1e6, 1),
        "committed_steps": coordinator.committed_steps,
        "stall_s": {
            "ours": round(stall, 4),
            "clone": round(clone, 4),
            "dcp_async_save": round(dcp_stall, 4),
            "ours_first_save": round(max(o["first_stall"] for o in outcomes.values()), 4),
        },
        "stall_ratio_vs_clone": round(stall / clone, 2),
        "stall_ratio_vs_dcp_async_save": round(stall / dcp_stall, 3),
        "upload_mb_s": {
            "ours": round(shard_bytes / ours_upload / 1e6, 1),
            "boto3_upload_fileobj": round(shard_bytes / boto3_upload / 1e6, 1),
        },
        "upload_ratio_vs_boto3": round(boto3_upload / ours_upload, 2),
        # A rank's first save (new storage client, warmed while the state was built) vs later ones.
        "first_upload_s": round(max(o["first_upload_s"] for o in outcomes.values()), 4),
        "first_upload_ratio_vs_later": round(max(o["first_upload_s"] for o in outcomes.values()) / ours_upload, 2),
        "restore_s": {
            "same_mesh_dp_shard2": round(same, 3),
            "other_mesh_tp2": round(tp2, 3),
            "other_mesh_pp2": round(pp2, 3),
        },
        "restore_ratio_tp2_vs_same": round(tp2 / same, 2),
        "restore_ratio_pp2_vs_same": round(pp2 / same, 2),
        # Every round (slowest rank) of the noisiest figures, to show the spread on a shared machine.
        "rounds": {
            name: [round(max(v), 4) for v in zip(*(outcomes[r]["figures"][name] for r in outcomes))]
            for name in (
                "ours",
                "clone",
                "dcp",
                "ours_upload_s",
                "boto3_upload_s",
                "restore_same",
                "restore_tp2",
                "restore_pp2",
            )
        },
    }
    figures["goals_met"] = {
        "stall_vs_clone<=2x": figures["stall_ratio_vs_clone"] <= 2.0,
        "stall_vs_dcp<=0.2x": figures["stall_ratio_vs_dcp_async_save"] <= 0.2,
        "upload_vs_boto3>=0.9x": figures["upload_ratio_vs_boto3"] >= 0.9,
        "first_upload_vs_later<=1.2x": figures["first_upload_ratio_vs_later"] <= 1.2,
        "restore_tp2_vs_same<=1.3x": figures["restore_ratio_tp2_vs_same"] <= 1.3,
        "restore_pp2_vs_same<=1.3x": figures["restore_ratio_pp2_vs_same"] <= 1.3,
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller state, fewer rounds")
    figures = run(parser.parse_args().quick)
    for key, value in figures.items():
        if key != "goals_met":
            print(f"{key:>32}: {value}", file=sys.stderr)
    emit(figures)


if __name__ == "__main__":
    main()
