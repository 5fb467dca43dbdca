"""From a validated job config to what the ranks are sent: the TrainSpec and the data bytes.

Runs on the driver (and in the torchrun reference script). No torch here.
"""

from __future__ import annotations

from orchestrator.config import JobConfig, resolve_data_path
from workers.spec import CheckpointTarget, TrainSpec


def resolve_backend(config: JobConfig) -> str:
    if config.runtime.backend != "auto":
        return config.runtime.backend
    return "nccl" if config.runtime.gpus_per_rank > 0 else "gloo"


def resolve_dtype(config: JobConfig, backend: str) -> str:
    if config.training.dtype != "auto":
        return config.training.dtype
    return "bfloat16" if backend == "nccl" else "float32"


def train_spec(config: JobConfig, *, backend: str | None = None) -> TrainSpec:
    """The rank-side view of the job; the microbatch size is fixed by the configured mesh."""
    backend = backend or resolve_backend(config)
    par, train = config.parallelism, config.training
    mesh = config.mesh
    return TrainSpec(
        model=config.model_spec,
        steps=train.steps,
        global_batch=train.global_batch,
        seq_len=train.seq_len,
        microbatch_size=train.global_batch // (mesh.dp * par.microbatches),
        microbatches=par.microbatches,
        pp_schedule=par.pp_schedule,
        stages_per_rank=par.virtual_stages,
        activation_checkpointing=par.activation_checkpointing,
        lr=train.lr,
        min_lr_ratio=train.min_lr_ratio,
        warmup_steps=train.warmup_steps,
        weight_decay=train.weight_decay,
        beta1=train.beta1,
        beta2=train.beta2,
        grad_clip=train.grad_clip,
        seed=train.seed,
        dtype=resolve_dtype(config, backend),
        data_source=config.data.source,
        backend=backend,
        collective_timeout_s=config.elastic.collective_timeout_s,
        checkpoint=checkpoint_target(config),
        instance_action_url=config.elastic.instance_action_url,
        instance_action_poll_s=config.elastic.instance_action_poll_s,
    )


def checkpoint_target(config: JobConfig) -> CheckpointTarget | None:
    ckpt = config.checkpoint
    if ckpt.uri is None:
        return None
    return CheckpointTarget(
        uri=ckpt.uri, endpoint_url=ckpt.endpoint_url, region=ckpt.region,
        interval_steps=ckpt.interval_steps, async_save=ckpt.async_,
        part_size_bytes=ckpt.part_size_mb << 20, upload_concurrency=ckpt.upload_concurrency,
        max_in_flight=ckpt.max_in_flight,
    )


def data_bytes(config: JobConfig) -> bytes | None:
    """The text the ranks train on (shipped to them through Ray's object store), or None."""
    if config.data.source != "text":
        return None
    path = resolve_data_path(config)
    return path.read_bytes() if path is not None else None
