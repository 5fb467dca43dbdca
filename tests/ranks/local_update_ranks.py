"""Two spawned gloo ranks for tests/ranks/test_local_updates.py: the local-shard norm, clip and
AdamW (``workers/local_updates.py``) against torch's own on the same DTensors.

Each rank holds gradients of every kind a stage has: split over the mesh on either dimension,
whole on every rank (DTensor ``Replicate``), a pending sum (``Partial``) and a plain tensor. It
sends back numpy arrays (plain pickles) and the facts the test compares.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from workers.local_updates import LocalAdamW, clip_to_norm, grad_norm
from workers.parallelize import local_slice

MAX_NORM = 0.5
STEPS = 3


def tensors(seed: int) -> list[torch.Tensor]:
    """The same full values on every rank: two matrices, a vector and a second matrix."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in ((8, 6), (6, 8), (6,), (4, 4))]


def as_parameters(mesh) -> list[torch.Tensor]:
    """Parameters as a stage holds them: split by rows, by columns, replicated, and plain."""
    rows, columns, vector, plain = tensors(seed=0)
    return [
        torch.nn.Parameter(distribute_tensor(rows, mesh, [Shard(0)])),
        torch.nn.Parameter(distribute_tensor(columns, mesh, [Shard(1)])),
        torch.nn.Parameter(distribute_tensor(vector, mesh, [Replicate()])),
        torch.nn.Parameter(plain.clone()),
    ]


def gradients(mesh, step: int) -> list[torch.Tensor]:
    """Step ``step``'s gradients, laid out as the parameters."""
    rows, columns, vector, plain = (value * (step + 1) for value in tensors(seed=100 + step))
    return [
        distribute_tensor(rows, mesh, [Shard(0)]),
        distribute_tensor(columns, mesh, [Shard(1)]),
        distribute_tensor(vector, mesh, [Replicate()]),
        plain,
    ]


def whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def host(values: list[torch.Tensor]) -> list[Any]:
    return [local_slice(value).detach().numpy().copy() for value in values]


def described(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, str, Any]]:
    """One parameter's optimizer state: each entry's type, dtype and local values."""
    return {key: (type(value).__name__, str(value.dtype), host([value])[0]) for key, value in state.items()}


def run_rank(rank: int, store_path: str, results) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    grads = gradients(mesh, step=0)
    expected_norm = torch.linalg.vector_norm(torch.cat([whole(grad).flatten() for grad in grads]))
    norm = grad_norm(grads, torch.device("cpu"))
    # The column-split gradient as a pending sum instead: each rank holds half of all of it.
    pending = DTensor.from_local(whole(grads[1]) / 2, mesh, [Partial()])
    norm_with_pending_sum = grad_norm([grads[0], pending, grads[2], grads[3]], torch.device("cpu"))

    clipped = [grad.detach().clone() for grad in grads]
    clip_to_norm(clipped, MAX_NORM, norm)
    # torch's clip scales the gradients of the parameters it is given.
    holders = as_parameters(mesh)
    for holder, grad in zip(holders, grads, strict=True):
        holder.grad = grad.detach().clone()
    for same_mesh in (holders[:3], holders[3:]):  # torch's foreach clip takes one mesh at a time
        torch.nn.utils.clip_grads_with_norm_(same_mesh, MAX_NORM, norm, foreach=True)
    torch_clipped = [cast(torch.Tensor, holder.grad) for holder in holders]  # each was given one above

    ours, theirs = as_parameters(mesh), as_parameters(mesh)
    local_adamw = LocalAdamW(ours, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    # torch's fused AdamW takes DTensors or plain tensors in one kernel, not both.
    torch_adamws = [
        torch.optim.AdamW(same_kind, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        for same_kind in (theirs[:3], theirs[3:])
    ]
    for step in range(STEPS):
        for params in (ours, theirs):
            for param, grad in zip(params, gradients(mesh, step), strict=True):
                param.grad = grad
        local_adamw.step()
        for torch_adamw in torch_adamws:
            torch_adamw.step()
    states = [local_adamw.state[param] for param in ours]
    torch_states = [torch_adamws[index // 3].state[param] for index, param in enumerate(theirs)]
    results.put(
        (
            rank,
            float(norm),
            float(expected_norm),
            float(norm_with_pending_sum),
            host(clipped),
            host(torch_clipped),
            host(grads),
            host(ours),
            host(theirs),
            [described(state) for state in states],
            [described(state) for state in torch_states],
        )
    )
    dist.destroy_process_group()
