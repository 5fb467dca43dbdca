"""Two gloo ranks that initialise the debug model under one layout, for
tests/ranks/test_init_on_two_ranks.py. Each spawned rank builds a Trainer with small initialisation
tiles, counts every value its ``init_weights`` draws, and sends back its slices with their
offsets in the full parameters.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from checkpointing.torch_compat import local_shape_and_offset
from elastic.spec import MeshSpec
from workers import initial_values
from workers import parallelize as par
from workers.data import SyntheticSource
from workers.runtime import init_generation
from workers.spec import PRESETS, TrainSpec
from workers.trainer import Trainer

# Small tiles (16 x 16 for a matrix), so the debug model's parameters span many of them.
TILE_BITS = 8
SPEC = TrainSpec(model=PRESETS["debug"], steps=1, global_batch=4, seq_len=8, microbatch_size=1, microbatches=2)


def counting_draws(counts: list[int]) -> Any:
    """``Tensor.normal_`` that also records how many values it draws (meta tensors hold none)."""
    normal = torch.Tensor.normal_

    def draw(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not tensor.is_meta:
            counts.append(tensor.numel())
        return normal(tensor, *args, **kwargs)

    return draw


def offset_of(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(local_shape_and_offset(param)[1]) if isinstance(param, DTensor) else (0,) * param.dim()


def run_rank(mesh: MeshSpec, rank: int, store_path: str, results: Any) -> None:
    init_generation(
        store=dist.FileStore(store_path, 2), generation=0, rank=rank, world_size=2, backend="gloo", timeout_s=60
    )
    initial_values.INIT_TILE_BITS = TILE_BITS
    source = SyntheticSource(vocab_size=SPEC.model.vocab_size, seq_len=SPEC.seq_len, seed=0)
    trainer = Trainer(SPEC, mesh, rank, device=torch.device("cpu"), source=source)
    draws: list[int] = []
    torch.Tensor.normal_ = counting_draws(draws)  # type: ignore[method-assign]
    trainer.init_weights()
    slices = {
        fqn: (offset_of(param), par.local_slice(param).detach().numpy().copy())
        for module in trainer.modules
        for fqn, param in module.named_parameters()
    }
    results.put((rank, slices, sum(draws)))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)
