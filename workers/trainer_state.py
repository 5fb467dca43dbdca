"""A trainer's state by name: what checkpoints save, what a rank keeps across generations,
and how a replica group receives its state from another.

With LoRA (``TrainSpec.lora``) the state is what trains: the adapters and their optimizer state.
The frozen base is not in checkpoints, snapshots or replica syncs (each rank reads it from its
source: ``workers.pretrained.fill_from_source``); only the slices a rank keeps across a generation
change hold it too, so a survivor reads nothing again.

Runs on every rank, in the loop thread; ``Trainer`` inherits these methods. Each says whether
it is collective (only ``sync_from_first_replica`` is, over the replica dimension).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from checkpointing.staging import copy_to_host
from elastic.spec import MeshSpec
from workers import parallelize as par
from workers.local_updates import new_adamw_state
from workers.models import StageModel
from workers.spec import TrainSpec
from workers.spec.lora import is_adapter
from workers.tensor_groups import flat_chunks, scatter_back

# Largest single broadcast of ``sync_from_first_replica``: bounds the staging buffer it
# allocates next to the live state (a whole stage's state at once would not fit beside it).
SYNC_CHUNK_BYTES = 64 * 2**20


class TrainerState:
    """The state half of ``Trainer`` (see there for the attributes it reads)."""

    spec: TrainSpec
    modules: list[StageModel]
    optimizer: torch.optim.Optimizer
    mesh: MeshSpec
    world_mesh: DeviceMesh
    device: torch.device

    def named_state(self, *, with_base: bool = False) -> dict[str, torch.Tensor]:
        """Parameters and optimizer state by global name (DTensors where sharded).

        Optimizer entries are ``optim.{param}.{exp_avg|exp_avg_sq|step}``. Call
        ``ensure_optimizer_state`` first on a trainer that has not stepped yet. With LoRA, the
        adapters alone unless ``with_base`` (the frozen base weights too).
        """
        adapters_only = self.spec.lora is not None and not with_base
        state: dict[str, torch.Tensor] = {}
        for module in self.modules:
            for name, param in module.named_parameters():
                if adapters_only and not is_adapter(name):
                    continue
                state[name] = param
                for key, value in self.optimizer.state.get(param, {}).items():
                    state[f"optim.{name}.{key}"] = value
        return state

    @torch.no_grad()
    def ensure_optimizer_state(self) -> None:
        """Allocate AdamW's state as a first step would, so it can be loaded into (none for a
        parameter no gradient trains, such as a routing bias, as a step leaves it)."""
        for module in self.modules:
            for param in module.parameters():
                if not param.requires_grad:
                    continue
                state = self.optimizer.state[param]
                if not state:
                    state.update(new_adamw_state(param))

    @torch.no_grad()
    def state_digest(self) -> str:
        """A fingerprint of this rank's slices (parameters and optimizer state).

        Ranks holding the same slices in different replica groups must have equal digests:
        replicas are bitwise identical, after a refill from a peer too. One device sync.
        """
        names, sums = [], []
        for name, value in sorted(self.named_state().items()):
            local = par.local_slice(value).detach().double()
            names.append(name)
            sums.append(torch.stack([local.sum(), local.abs().sum(), local.pow(2).sum()]).to("cpu"))
        digest = hashlib.sha256("\n".join(names).encode())
        if sums:
            digest.update(torch.stack(sums).numpy().tobytes())
        return digest.hexdigest()[:16]

    def checkpoint_state(self, *, with_base: bool = False) -> dict[str, torch.Tensor]:
        """``named_state`` with every FSDP module resharded, so each entry is this rank's shard.

        Safe after a step failed half-way: modules left gathered by an interrupted forward are
        resharded (local, no collective); their sharded values were never modified.
        """
        self.reshard()
        return self.named_state(with_base=with_base)

    def reshard(self) -> None:
        """Free every FSDP module's gathered parameters (local, no collective)."""
        for module in self.modules:
            for submodule in module.modules():
                if isinstance(submodule, FSDPModule):
                    submodule.reshard()

    @torch.no_grad()
    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's slices of the whole training state, as host copies (no mesh attached).

        Runs on one rank, no collective (the rank leaving a generation keeps its state). The
        copies share no storage with this trainer, so once it is closed its device memory can
        be freed before the next generation's trainer allocates its own. They are views of one
        host buffer (``checkpointing.staging.copy_to_host``), page-locked when the state is on a
        GPU so that the copies back to it are plain DMA: in chunks when it is large, as the
        checkpoint and snapshot buffers are, so that the rank keeps answering the driver. A LoRA
        run's frozen base is kept too: a survivor rebinds it instead of reading it from its source again.
        """
        slices = {
            name: par.local_slice(value).detach() for name, value in self.checkpoint_state(with_base=True).items()
        }
        return copy_to_host(slices, pin_memory=self.device.type == "cuda")

    @torch.no_grad()
    def load_local_shards(self, shards: dict[str, torch.Tensor]) -> None:
        """Rebind slices taken from a trainer of a mesh where this rank held the same slices."""
        self.ensure_optimizer_state()
        for name, value in self.named_state(with_base=True).items():
            target = par.local_slice(value)
            source = shards[name]
            if target.shape != source.shape:
                raise ValueError(f"{name}: kept slice {tuple(source.shape)} does not fit {tuple(target.shape)}")
            target.copy_(source)

    @torch.no_grad()
    def sync_from_first_replica(self) -> None:
        """Collective over the replica dimension: copy replica group 0's state to every other.

        How a grown or refilled replica gets its shards: peer to peer from the matching rank
        of a healthy replica, no storage round trip. Tensors of one dtype are packed into
        buffers of at most ``SYNC_CHUNK_BYTES`` (a large tensor spans several), so the cost is
        a few large messages, not one per tensor, and the extra memory stays bounded.
        """
        if self.mesh.dp_replicate == 1:
            return
        self.ensure_optimizer_state()
        group = self.world_mesh["dp_replicate"].get_group()
        source = dist.get_global_rank(group, 0)
        receiving = dist.get_rank(group) != 0
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, value in sorted(self.named_state().items()):
            local = par.local_slice(value)
            by_dtype.setdefault(local.dtype, []).append(local)
        for dtype, tensors in by_dtype.items():
            max_elements = max(1, SYNC_CHUNK_BYTES // dtype.itemsize)
            for pieces in flat_chunks(tensors, max_elements):
                size = sum(stop - start for _, start, stop in pieces)
                if receiving:
                    flat = torch.empty(size, dtype=dtype, device=self.device)
                else:  # a step counter may live on the CPU (a cpu_offload run); NCCL sends device memory
                    flat = torch.cat([t.reshape(-1)[start:stop] for t, start, stop in pieces]).to(self.device)
                dist.broadcast(flat, src=source, group=group)
                if receiving:
                    scatter_back(flat, pieces)
