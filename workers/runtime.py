"""Process-level set-up of a rank: device, data source, process group for one generation.

Runs on every rank (actor or torchrun script).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from checkpointing.torch_compat import set_group_name_base
from elastic.spec import MeshSpec
from workers.data import SampleSource, SyntheticSource, TextSource
from workers.device import RankDevice
from workers.spec import TrainSpec

# Process-group names one generation may use (a mesh creates a few per dimension).
GROUP_NAMES_PER_GENERATION = 100_000
# Where names by layout start (``group_name_base``), far above any generation's.
LAYOUT_NAMES_FROM = 10**15

# ProcessGroupNCCL's environment, as (every name torch reads for the variable, our value).
# torch reads these when it builds a process group, so they must be set before the first one.
NCCL_ENVIRONMENT: tuple[tuple[tuple[str, ...], str], ...] = (
    # The driver owns timeouts and aborts the generation's groups itself; torch's default (3)
    # would tear a healthy survivor down on the first NCCL error or timeout it sees, and
    # torch's own abort of a process group asks for 0 in its docstring.
    (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"), "0"),
    # A CUDA error seen by the watchdog after an abort must not be rethrown into the process.
    (("TORCH_NCCL_RETHROW_CUDA_ERRORS",), "0"),
    # NVLink SHARP: NVIDIA's in-process restart guide turns it off (its buffers do not
    # survive an abort), and its AllGather/ReduceScatter misorder when rank and GPU order differ.
    (("NCCL_NVLS_ENABLE",), "0"),
    # The flight recorder: the last collectives of every group, dumped when one times out,
    # so a hang can be traced to the collective and the rank that never joined it.
    (("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"), "2000"),
    (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),
)


def pick_device(backend: str) -> RankDevice:
    """Rank side, once per generation: the device this rank trains on (CUDA for nccl)."""
    if backend == "nccl":
        # Ray gives each GPU rank its own CUDA_VISIBLE_DEVICES, so the device is always index 0.
        torch.cuda.set_device(0)
        return RankDevice(torch.device("cuda", 0))
    return RankDevice(torch.device("cpu"))


def process_group_environment(backend: str, environ: Mapping[str, str]) -> dict[str, str]:
    """Rank side, before any process group: the variables to set for ``backend`` (none for gloo).

    A variable the user set explicitly (under any of the names torch reads for it, e.g.
    ``NCCL_ASYNC_ERROR_HANDLING`` for ``TORCH_NCCL_ASYNC_ERROR_HANDLING``) is never
    overridden: it is left out of the result.
    """
    if backend != "nccl":
        return {}
    return {names[0]: value for names, value in NCCL_ENVIRONMENT if not any(name in environ for name in names)}


def process_group_options(backend: str, device: RankDevice | None) -> dict[str, Any]:
    """Rank side: the keyword arguments of ``init_process_group`` that depend on the backend.

    For nccl, ``device_id`` binds the group to this rank's GPU, so torch creates the NCCL
    communicators eagerly inside ``init_process_group`` (and splits sub-groups from them)
    instead of lazily at the first collective, where a peer dying during the
    initialisation would leave survivors hung out of reach of an abort. gloo needs nothing.
    """
    if backend != "nccl":
        return {}
    index = device.torch_device.index if device is not None else None
    return {"device_id": torch.device("cuda", index if index is not None else 0)}


def make_source(spec: TrainSpec, data: bytes | None) -> SampleSource:
    """Rank side, once per generation: the job's sample source (the caller closes it when the
    rank leaves the generation). A token corpus is opened here, on the rank: its manifest is read
    and its windows are read as they are needed; the driver never reads it."""
    if spec.data_source == "tokens":
        from workers.token_source import TokenSource  # numpy, storage clients: only for this source

        if spec.tokens is None:
            raise ValueError("data.source=tokens but no corpus location was sent to the rank")
        return TokenSource(spec.tokens, seq_len=spec.seq_len, seed=spec.seed)
    if spec.data_source == "text":
        if data is None:
            raise ValueError("data.source=text but no text was sent to the rank")
        return TextSource(data, seq_len=spec.seq_len, seed=spec.seed)
    return SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=spec.seed)


def group_name_base(generation: int, layout: MeshSpec | None = None) -> int:
    """Where this generation's process-group names are numbered from (every rank alike).

    Destroying the world resets torch's counter of process-group names to 0, so the next
    generation's groups would reuse the names of the last one's: a stale mesh that escaped
    every cache would then run its collective on whichever new group took its name. Numbering
    each generation's groups from its own base makes a stale name fail loudly instead.

    A compiled tensor-parallel block holds its groups' names in its graph, so names that change
    with every generation make every generation compile anew. With ``layout`` (a compiling job)
    the base is the layout's: a layout seen before gets the names, and so the graphs, it had. A
    stale mesh of another layout still fails loudly; one of the same layout names groups of the
    same ranks (a rank that moved in the mesh is no member of its old groups: their names do
    not resolve for it).
    """
    if layout is None:
        return generation * GROUP_NAMES_PER_GENERATION
    digest = hashlib.sha256(layout.describe().encode()).digest()
    return LAYOUT_NAMES_FROM + int.from_bytes(digest[:4]) * GROUP_NAMES_PER_GENERATION


def init_generation(
    *,
    store: dist.Store,
    generation: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    device: RankDevice | None = None,
    layout: MeshSpec | None = None,
) -> None:
    """Collective over the new world: join generation ``generation``'s default process group.

    Every generation gets a fresh key prefix on the long-lived store, so keys of an aborted
    generation can never be mistaken for this one's. For nccl, the NCCL environment
    (``process_group_environment``) is set first and the group is bound to ``device``.
    ``layout``: name the groups by this mesh rather than by the generation (``group_name_base``).
    """
    os.environ.update(process_group_environment(backend, os.environ))
    prefixed = dist.PrefixStore(f"gen{generation}/pg/", store)
    set_group_name_base(group_name_base(generation, layout))
    dist.init_process_group(
        backend,
        store=prefixed,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **process_group_options(backend, device),
    )
