"""Save under pp=2 x dp_shard=2 x tp=2 (FSDP2 + DTensor TP, gloo), restore under other meshes;
save under cp=2 x tp=2 (FSDP2 over dp_shard x cp flattened, as the trainer shards), restore
under cp=1 and another dp.

Each group of ranks is real: spawned processes, a gloo process group, ``init_device_mesh``,
``parallelize_module`` (TP) then ``fully_shard`` (FSDP2, HSDP with dp_replicate > 1), pipeline
stages that keep only their layers, an Adam step so optimizer state exists. Shards go to the
real S3 server; the driver side (``CommitCoordinator``) runs in the test process and receives the
reports over a queue. Every restored tensor, gathered whole, must be bitwise equal to what was
saved.
"""

from __future__ import annotations

import math
import os
import queue
import time
import traceback

import pytest
import torch
from torch import nn

from checkpointing.commit import CommitCoordinator
from checkpointing.reader import latest_committed
from checkpointing.storage import open_storage
from tests.ranks.spawned_ranks import rank_context

DIMS = ("dp_replicate", "pp", "dp_shard", "cp", "tp")
MODEL = {"vocab": 40, "dim": 16, "hidden": 24, "layers": 4}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(MODEL["dim"])
        self.up = nn.Linear(MODEL["dim"], MODEL["hidden"], bias=False)
        self.down = nn.Linear(MODEL["hidden"], MODEL["dim"], bias=False)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # None on the pipeline stages that do not hold them (build_state drops them there).
        self.embed: nn.Embedding | None = nn.Embedding(MODEL["vocab"], MODEL["dim"])
        self.layers = nn.ModuleDict({str(i): Block() for i in range(MODEL["layers"])})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(MODEL["dim"])
        self.head: nn.Linear | None = nn.Linear(MODEL["dim"], MODEL["vocab"], bias=False)


def build_state(mesh_shape: dict[str, int], seed: int) -> tuple[dict[str, torch.Tensor], bool, object]:
    """This rank's model + optimizer state under ``mesh_shape`` (world size 1: plain tensors)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model = Net()
    owns_plain = True
    mesh = None
    if math.prod(mesh_shape.values()) > 1:
        mesh = init_device_mesh("cpu", tuple(mesh_shape.get(d, 1) for d in DIMS), mesh_dim_names=DIMS)
        coordinate = mesh.get_coordinate()
        assert coordinate is not None, "every rank of the world is in the mesh it built"
        coords = dict(zip(DIMS, coordinate))
        keep_stage(model, stage=coords["pp"], stages=mesh_shape["pp"])
        if mesh_shape["tp"] > 1:
            tensor_parallel(model, mesh["tp"])
        shard(model, mesh, mesh_shape)
        owns_plain = coords["dp_replicate"] == 0 and coords["dp_shard"] == 0 and coords["cp"] == 0 and coords["tp"] == 0
    return trained_state(model), owns_plain, mesh


def keep_stage(model: Net, *, stage: int, stages: int) -> None:
    """Drop what pipeline ``stage`` of ``stages`` does not hold: other stages' layers (names unchanged),
    the embedding off the first stage, the norm and head off the last."""
    per_stage = MODEL["layers"] // stages
    for index in list(model.layers):
        if not stage * per_stage <= int(index) < (stage + 1) * per_stage:
            del model.layers[index]
    if stage != 0:
        model.embed = None
    if stage != stages - 1:
        model.norm = model.head = None


def tensor_parallel(model: Net, tp_mesh) -> None:
    """Column-then-row parallel blocks; the embedding row-parallel, the head column-parallel (DTensor TP)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if model.embed is not None:
        parallelize_module(model, tp_mesh, {"embed": RowwiseParallel(input_layouts=Replicate())})
    if model.head is not None:
        parallelize_module(model, tp_mesh, {"head": ColwiseParallel(output_layouts=Replicate())})


def shard(model: Net, mesh, mesh_shape: dict[str, int]) -> None:
    """FSDP2 over dp_shard (flattened with cp into dp_shard_cp as the trainer does), HSDP when dp_replicate > 1."""
    from torch.distributed.fsdp import fully_shard

    shard_dim = "dp_shard"
    if mesh_shape.get("cp", 1) > 1:  # the trainer's dp_shard_cp (workers/parallelize.py)
        from checkpointing.torch_compat import flatten_mesh

        shard_dim = "dp_shard_cp"
        flatten_mesh(mesh["dp_shard", "cp"], shard_dim)
    dp_dims = ("dp_replicate", shard_dim) if mesh_shape["dp_replicate"] > 1 else (shard_dim,)
    dp_mesh = mesh[dp_dims]
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state and its Adam state after one step with fixed gradients, as the trainer names them."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for parameter in model.parameters():
        parameter.grad = parameter.detach() * 0.5 + 0.25  # same per element whatever the mesh
    optimizer.step()
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    names: dict[torch.Tensor, str] = {parameter: name for name, parameter in model.named_parameters()}
    for optimized, values in optimizer.state.items():  # keyed by the parameters, typed as plain tensors
        for key, value in values.items():
            state[f"optim.{names[optimized]}.{key}"] = value
    return state


def full_values(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).clone() for name, t in sorted(state.items())}


def rank_main(rank: int, world_size: int, task: dict, results) -> None:
    torch.set_num_threads(1)
    try:
        if world_size > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"file://{task['init_file']}", rank=rank, world_size=world_size)
        storage = open_storage(task["uri"], endpoint_url=task["endpoint_url"])
        if task["mode"] == "save":
            _save(rank, task, storage, results)
        else:
            _restore(rank, task, storage, results)
        storage.close()
        results.put(("done", rank, None))
    except BaseException:  # noqa: BLE001 - reported to the test process, whatever it was
        results.put(("error", rank, traceback.format_exc()))


def _save(rank: int, task: dict, storage, results) -> None:
    from safetensors.torch import save_file

    from checkpointing.writer import CheckpointWriter

    state, owns_plain, mesh = build_state(task["mesh"], seed=0)
    writer = CheckpointWriter(
        storage,
        rank=rank,
        report=lambda report: results.put(("report", rank, report)),
        mesh=mesh if task.get("writer_knows_mesh", True) else None,
    )
    writer.save(task["step"], state, extra={"data_cursor": 123, "rank": rank}, owns_plain_tensors=owns_plain)
    reference = full_values(state)  # collectives run while the upload goes on in the background
    writer.close()
    if owns_plain:
        save_file(reference, os.path.join(task["reference_dir"], f"rank{rank}.safetensors"))


def _restore(rank: int, task: dict, storage, results) -> None:
    from safetensors.torch import load_file

    from checkpointing.reader import load_manifest, restore

    reference = {}
    for name in sorted(os.listdir(task["reference_dir"])):
        reference.update(load_file(os.path.join(task["reference_dir"], name)))
    manifest = load_manifest(storage)
    for mesh_name in task["meshes"]:  # several meshes of the same world size, one after the other
        state, _, _ = build_state(MESHES[mesh_name], seed=1)
        restore(storage, manifest, state)
        restored = full_values(state)
        unequal = sorted(name for name, value in restored.items() if not torch.equal(value, reference[name]))
        results.put(("checked", rank, {"mesh": mesh_name, "names": sorted(restored), "unequal": unequal}))


def run_ranks(world_size: int, task: dict, *, on_report=None, timeout_s: float = 240.0) -> list[tuple]:
    """Start ``world_size`` spawned ranks on ``task``; return their messages (reports go to ``on_report``)."""
    context = rank_context()
    results = context.Queue()
    task = dict(task, init_file=os.path.join(task["work_dir"], f"init-{task['mode']}-{time.monotonic_ns()}"))
    processes = [
        context.Process(target=rank_main, args=(rank, world_size, task, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    messages, finished = [], 0
    deadline = time.monotonic() + timeout_s
    try:
        while finished < world_size:
            try:
                kind, rank, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"ranks did not finish within {timeout_s} s") from None
            if kind == "error":
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            if kind == "report" and on_report is not None:
                on_report(payload)
            finished += kind == "done"
            messages.append((kind, rank, payload))
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return messages


MESHES = {
    "world size 1 (plain tensors)": {"dp_replicate": 1, "pp": 1, "dp_shard": 1, "tp": 1},
    "dp_shard=3 (uneven shards)": {"dp_replicate": 1, "pp": 1, "dp_shard": 3, "tp": 1},
    "dp_replicate=2 x tp=2 (HSDP)": {"dp_replicate": 2, "pp": 1, "dp_shard": 1, "tp": 2},
    "pp=4": {"dp_replicate": 1, "pp": 4, "dp_shard": 1, "tp": 1},
    "tp=4": {"dp_replicate": 1, "pp": 1, "dp_shard": 1, "tp": 4},
}


@pytest.fixture(scope="module")
def saved_3d(tmp_path_factory, s3_server):
    """One checkpoint saved by 8 ranks (pp=2 x dp_shard=2 x tp=2) to real S3, committed by the coordinator."""
    yield from _saved(tmp_path_factory, s3_server, {"dp_replicate": 1, "pp": 2, "dp_shard": 2, "tp": 2})


@pytest.fixture(scope="module")
def saved_cp(tmp_path_factory, s3_server):
    """One checkpoint saved by 4 ranks with sequences split over cp=2 (x tp=2)."""
    yield from _saved(tmp_path_factory, s3_server, CP_SAVE_MESH)


CP_SAVE_MESH = {"dp_replicate": 1, "pp": 1, "dp_shard": 1, "cp": 2, "tp": 2}
CP_RESTORE_MESHES = ("world size 1 (plain tensors)", "dp_shard=3 (uneven shards)", "dp_replicate=2 x tp=2 (HSDP)")


def _saved(tmp_path_factory, s3_server, mesh: dict[str, int]):
    work = tmp_path_factory.mktemp("reshard")
    reference_dir = work / "reference"
    reference_dir.mkdir()
    bucket = f"reshard-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    s3_server.create_bucket(bucket)
    env = s3_server.env()
    saved_env = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    task = {
        "uri": f"s3://{bucket}/run",
        "endpoint_url": s3_server.endpoint_url,
        "work_dir": str(work),
        "reference_dir": str(reference_dir),
        "step": 7,
    }
    storage = open_storage(task["uri"], endpoint_url=s3_server.endpoint_url)
    world = world_of(mesh)
    coordinator = CommitCoordinator(storage, world_size=world, mesh=mesh, config_hash="cfg", model=MODEL, keep_last=2)
    committed = []
    run_ranks(
        world,
        dict(task, mode="save", mesh=mesh),
        on_report=lambda report: committed.append(coordinator.on_report(report)),
    )
    try:
        yield task, storage, [m for m in committed if m is not None], coordinator
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        storage.close()


def test_3d_save_commits_once_with_every_rank(saved_3d):
    task, storage, committed, coordinator = saved_3d
    assert coordinator.failed_steps == {}
    assert [m.step for m in committed] == [7]
    manifest = committed[0]
    assert latest_committed(storage) == 7
    assert manifest.mesh == {"dp_replicate": 1, "pp": 2, "dp_shard": 2, "tp": 2}
    assert manifest.extra == {"data_cursor": 123, "rank": 0}
    # Replicated slices are written once: 8 ranks, but only the distinct shards hold bytes.
    assert sorted({f.rank for f in manifest.files}) == list(range(8))
    expected = {f"layers.{i}.{p}" for i in range(4) for p in ("norm.weight", "up.weight", "down.weight")}
    expected |= {"embed.weight", "norm.weight", "head.weight"}
    assert expected <= set(manifest.tensors)
    assert {f"optim.{name}.{key}" for name in expected for key in ("exp_avg", "exp_avg_sq", "step")} <= set(
        manifest.tensors
    )


def world_of(mesh: dict[str, int]) -> int:
    return mesh["dp_replicate"] * mesh["pp"] * mesh["dp_shard"] * mesh.get("cp", 1) * mesh["tp"]


@pytest.fixture(scope="module")
def restored(saved_3d) -> dict[str, list[dict]]:
    """Restore the 3D checkpoint under every mesh of MESHES: one group of ranks per world size."""
    return _restore_under(saved_3d, list(MESHES))


@pytest.fixture(scope="module")
def restored_from_cp(saved_cp) -> dict[str, list[dict]]:
    """Restore the cp=2 checkpoint under cp=1 meshes (one rank, other dp)."""
    return _restore_under(saved_cp, list(CP_RESTORE_MESHES))


def _restore_under(saved, mesh_names: list[str]) -> dict[str, list[dict]]:
    task, _, _, _ = saved
    by_world: dict[int, list[str]] = {}
    for name in mesh_names:
        mesh = MESHES[name]
        by_world.setdefault(world_of(mesh), []).append(name)
    checked: dict[str, list[dict]] = {name: [] for name in mesh_names}
    for world, names in sorted(by_world.items()):
        for kind, _, payload in run_ranks(world, dict(task, mode="restore", meshes=names)):
            if kind == "checked":
                checked[payload["mesh"]].append(payload)
    return checked


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_restore_into_another_mesh_is_bitwise_equal(restored, mesh_name):
    _check_restored(restored, mesh_name)


def test_cp_save_commits_with_the_cp_mesh(saved_cp):
    _, _, committed, coordinator = saved_cp
    assert coordinator.failed_steps == {}
    assert [m.step for m in committed] == [7]
    assert committed[0].mesh == CP_SAVE_MESH


@pytest.mark.parametrize("mesh_name", CP_RESTORE_MESHES)
def test_restore_from_cp_into_cp_1_is_bitwise_equal(restored_from_cp, mesh_name):
    _check_restored(restored_from_cp, mesh_name)


def _check_restored(restored: dict[str, list[dict]], mesh_name: str) -> None:
    results = restored[mesh_name]
    assert len(results) == world_of(MESHES[mesh_name])  # every rank restored and checked its share
    names = set()
    for payload in results:
        assert payload["unequal"] == []
        names.update(payload["names"])
    every_parameter = {"embed.weight", "norm.weight", "head.weight"} | {
        f"layers.{i}.{p}" for i in range(4) for p in ("norm.weight", "up.weight", "down.weight")
    }
    assert names == every_parameter | {
        f"optim.{n}.{k}" for n in every_parameter for k in ("exp_avg", "exp_avg_sq", "step")
    }
