"""From a validated job config to what the ranks are sent: the TrainSpec and the data bytes.

Runs on the driver (and in the torchrun reference script). No torch here. This is the one
place the job config becomes rank-side values: fields whose names match are copied by
``dataclasses.fields`` (every optimizer setting, since TrainingConfig and TrainSpec both extend
OptimizerSpec); only what is renamed, converted or resolved is written out below.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from elastic.cost_model import Cluster, Layout, Workload
from elastic.hardware import gpu_spec
from elastic.planner import pick_cp_method
from elastic.spec import CpMethod
from orchestrator.config import JobConfig
from orchestrator.config_checks import resolve_data_path
from orchestrator.model_source import locate, lora_base
from orchestrator.token_corpus import token_corpus_source
from workers.spec.train import (
    BatchPlan,
    CheckpointTarget,
    EvalSpec,
    OptimizerSpec,
    PretrainedSource,
    ReshardAfterForward,
    TrainSpec,
)


def resolve_backend(config: JobConfig) -> str:
    if config.runtime.backend != "auto":
        return config.runtime.backend
    return "nccl" if config.runtime.gpus_per_rank > 0 else "gloo"


def resolve_dtype(config: JobConfig, backend: str) -> str:
    if config.training.dtype != "auto":
        return config.training.dtype
    return "bfloat16" if backend == "nccl" else "float32"


def resolve_cp_method(config: JobConfig, backend: str) -> CpMethod:
    """``parallelism.cp_method``, with ``auto`` resolved: the planner's pick for the configured
    layout (``elastic.planner.pick_cp_method``) on GPUs (nccl), priced as H100s with 8 to a node,
    the planner's default hardware; ``allgather`` on CPU ranks (gloo), which the planner does not
    price, and with cp = 1, where no method runs."""
    par = config.parallelism
    if par.cp_method != "auto":
        return CpMethod(par.cp_method)
    if par.cp == 1 or backend != "nccl":
        return CpMethod.ALLGATHER
    mesh = config.mesh
    workload = Workload(config.model_spec, config.training.seq_len, config.training.global_batch)
    cluster = Cluster(mesh.world_size, min(8, mesh.world_size), gpu_spec())
    return pick_cp_method(workload, cluster, configured_layout(config))


def configured_layout(config: JobConfig, cp_method: CpMethod = CpMethod.ALLGATHER) -> Layout:
    """The planner's view of the job's configured mesh and how it runs (driver, and ``meshpilot plan``)."""
    par = config.parallelism
    return Layout(
        config.mesh,
        par.pp_schedule if par.pp > 1 else "none",
        par.virtual_stages,
        par.microbatches,
        par.activation_checkpointing,
        reshard_after_forward=par.reshard_after_forward,
        cpu_offload=par.cpu_offload,
        ep=par.ep,
        cp_method=cp_method,
    )


def train_spec(config: JobConfig, *, backend: str | None = None) -> TrainSpec:
    """The rank-side view of the job; the microbatch size is fixed by the configured mesh."""
    backend = backend or resolve_backend(config)
    par, train = config.parallelism, config.training
    batch = BatchPlan.for_mesh(train.global_batch, dp=config.mesh.dp, microbatches=par.microbatches)
    return TrainSpec(
        **same_named(train, OptimizerSpec),
        model=config.model_spec,
        steps=train.steps,
        global_batch=batch.global_batch,
        seq_len=train.seq_len,
        microbatch_size=batch.microbatch_size,
        microbatches=batch.microbatches,
        pp_schedule=par.pp_schedule,
        stages_per_rank=par.virtual_stages,
        reshard_after_forward=ReshardAfterForward(par.reshard_after_forward),
        cpu_offload=par.cpu_offload,
        activation_checkpointing=par.activation_checkpointing,
        cp_method=resolve_cp_method(config, backend),
        compile=train.compile,
        compile_cache_dir=compile_cache_dir(config) if train.compile else "",
        float8=train.float8,
        ep=par.ep,
        seed=train.seed,
        dtype=resolve_dtype(config, backend),
        data_source=config.data.source,
        tokens=token_corpus_source(config),
        record_samples=config.data.record_samples,
        backend=backend,
        collective_timeout_s=config.elastic.collective_timeout_s,
        checkpoint=checkpoint_target(config),
        init_from=pretrained_source(config),
        lora=None if config.model.lora is None else config.model.lora.spec(),
        lora_base=None if config.model.lora is None else lora_base(config),
        instance_action_url=config.elastic.instance_action_url,
        instance_action_poll_s=config.elastic.instance_action_poll_s,
        eval=EvalSpec(**same_named(config.eval, EvalSpec)),
        driver_lease_s=config.runtime.driver_lease_s if config.runtime.survive_driver_loss else None,
    )


def compile_cache_dir(config: JobConfig) -> str:
    """Each node's directory of the job's compile caches: ``runtime.compile_cache_dir``, or one
    under the node's temporary directory named by the job (the same config finds it again)."""
    if config.runtime.compile_cache_dir is not None:
        return config.runtime.compile_cache_dir
    return str(Path(tempfile.gettempdir()) / "meshpilot-compile" / f"{config.name}-{config.config_hash()}")


def pretrained_source(config: JobConfig) -> PretrainedSource | None:
    """Where the ranks read released weights from; a local path made absolute (ranks share the disk)."""
    if config.model.init_from is None:
        return None
    location = locate(config.model.init_from, config.source_dir)
    return PretrainedSource(location.uri, config.checkpoint.endpoint_url, config.checkpoint.region)


def checkpoint_target(config: JobConfig) -> CheckpointTarget | None:
    ckpt = config.checkpoint
    if ckpt.uri is None:
        return None
    return CheckpointTarget(
        **same_named(ckpt, CheckpointTarget, skip=("async_save", "part_size_bytes")),
        async_save=ckpt.async_,
        part_size_bytes=ckpt.part_size_mb << 20,
    )


def same_named(source: Any, target: type, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``source``'s values for every field of the dataclass ``target`` (all must exist on ``source``)."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(target) if f.name not in skip}


def data_bytes(config: JobConfig) -> bytes | None:
    """The text the ranks train on (shipped to them through Ray's object store), or None.

    Only ``data.source: text`` ships bytes; a token corpus is read by the ranks themselves."""
    if config.data.source != "text":
        return None
    path = resolve_data_path(config)
    return path.read_bytes() if path is not None else None
