"""What every GPU test shares: the runtime overrides that put one rank on each GPU, and the
layouts that fit the GPUs present (a machine with 4 or more GPUs also gets a TP or FSDP dimension).

Runs in the pytest process (the driver side); the jobs run on the session's Ray cluster, which
finds the machine's GPUs itself.
"""

from __future__ import annotations

import torch

# One GPU per rank, NCCL and (unless a test sets training.dtype) bfloat16 are then resolved
# as for any GPU job; a rank actor needs a CPU of its own to feed its GPU.
ON_GPUS = ("runtime.gpus_per_rank=1", "runtime.cpus_per_rank=1")


def gpu_count() -> int:
    return torch.cuda.device_count()


def data_parallel_layout() -> tuple[str, ...]:
    """FSDP over every GPU there is, up to two (one rank on a one-GPU machine)."""
    width = min(2, gpu_count())
    return ("parallelism.dp_replicate=1", f"parallelism.dp_shard={width}", "parallelism.tp=1", "parallelism.pp=1")


def two_gpus_or_skip_reason() -> str:
    """Why a test that needs a replica group on a GPU of its own cannot run here ('' if it can)."""
    found = gpu_count()
    return "" if found >= 2 else f"needs >= 2 CUDA GPUs (one rank per GPU, two replica groups); found {found}"


def replica_size() -> int:
    """Ranks per replica group of ``replicated_layout``: 1 on a 2- or 3-GPU machine, else 2."""
    return 2 if gpu_count() >= 4 else 1


def replicated_layout(*, inner: str) -> tuple[str, ...]:
    """Two replica groups of ``replica_size()`` ranks along ``inner`` ("dp_shard" or "tp")."""
    width = replica_size()
    other = "tp" if inner == "dp_shard" else "dp_shard"
    return (
        "parallelism.dp_replicate=2",
        f"parallelism.{inner}={width}",
        f"parallelism.{other}=1",
        "parallelism.pp=1",
        "training.seq_len=64",
        "elastic.hang_timeout_s=30",
        "elastic.heartbeat_timeout_s=30",
    )
