"""Process-level set-up of a rank: device, data source, process group for one generation.

Runs on every rank (actor or torchrun script).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from checkpointing.torch_compat import set_group_name_base
from workers.data import SampleSource, SyntheticSource, TextSource
from workers.spec import TrainSpec

# Process-group names one generation may use (a mesh creates a few per dimension).
GROUP_NAMES_PER_GENERATION = 100_000


def pick_device(backend: str) -> torch.device:
    if backend == "nccl":
        # Ray gives each GPU rank its own CUDA_VISIBLE_DEVICES, so the device is always index 0.
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def make_source(spec: TrainSpec, data: bytes | None) -> SampleSource:
    if spec.data_source == "text":
        if data is None:
            raise ValueError("data.source=text but no text was sent to the rank")
        return TextSource(data, seq_len=spec.seq_len, seed=spec.seed)
    return SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=spec.seed)


def init_generation(
    *, store: dist.Store, generation: int, rank: int, world_size: int, backend: str, timeout_s: float
) -> None:
    """Collective over the new world: join generation ``generation``'s default process group.

    Every generation gets a fresh key prefix on the long-lived store, so keys of an aborted
    generation can never be mistaken for this one's.
    """
    prefixed = dist.PrefixStore(f"gen{generation}/pg/", store)
    # Destroying the world resets torch's counter of process-group names to 0, so the next
    # generation's groups would reuse the names of the last one's: a stale mesh that escaped
    # every cache would then run its collective on whichever new group took its name.
    # Numbering each generation's groups from its own base makes a stale name fail loudly
    # instead. Every rank of a generation sets the same base, so the names still agree.
    set_group_name_base(generation * GROUP_NAMES_PER_GENERATION)
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
