"""The step's gradient norm, clip and AdamW update, run on each rank's local shards.

Runs on every rank, in the loop thread, called by the trainer once per step. The gradients,
parameters and optimizer state stay DTensors (checkpoints, the replica sync and the peer
snapshots read their meshes and placements); only the arithmetic runs on their local tensors.

Why: a foreach or fused op on DTensors makes DTensor work out every element's sharding first.
That is cached per mesh, so it costs nothing in a steady run, but every new mesh pays it again:
on a 4-rank dp_replicate=2 x dp_shard=2 mesh, 0.45 s of a 0.87 s first step after a
generation change went to the clip's multiply (0.25 s), the fused AdamW (0.19 s) and the norm
(cProfile of one rank). Every recovery, drain and grow starts with such a step, and so does
every run. Each op here is elementwise on every shard (the update, the clip), or a local sum
completed by an all-reduce over the mesh dimensions a gradient is split on (the norm), so the
local results are those DTensor computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.adam import adam

from workers.parallelize import local_slice

# Gradients whose squares add up alike: their mesh (None for plain tensors) and the mesh
# dimensions they are split on.
_Reduction = tuple[DeviceMesh | None, tuple[int, ...]]


@torch.no_grad()
def grad_norm(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Collective over the gradients' meshes: the 2-norm of all of them, as a plain float32
    scalar on ``device`` (every rank of those meshes calls it, with its gradients in the same
    order; plain tensors count as whole on every rank).

    Gradients split over the same mesh dimensions are summed locally first, so there is one
    small all-reduce per such set and split dimension (the data-parallel one alone for pure
    FSDP), not one per gradient. One dimension at a time, also because a DTensor norm reduces
    over a flattened mesh, which torch cannot build from dimensions not adjacent in the root
    mesh (the experts' mesh under context or tensor parallelism is one).
    """
    squares: dict[_Reduction, list[torch.Tensor]] = {}
    for grad in grads:
        grad = _without_partial(grad) if isinstance(grad, DTensor) else grad
        squares.setdefault(_reduction(grad), []).append(grad)
    total = torch.zeros((), device=device, dtype=torch.float32)
    for (mesh, split), same in squares.items():
        local = [local_slice(grad) for grad in same]
        squared = torch.nn.utils.get_total_norm(local, norm_type=2.0, foreach=True).to(torch.float32).pow(2)
        for dim in split:
            assert mesh is not None  # only a DTensor has split dimensions
            dist.all_reduce(squared, group=mesh.get_group(dim))
        total = total + squared
    return total.sqrt()


def _reduction(grad: torch.Tensor) -> _Reduction:
    if not isinstance(grad, DTensor):
        return None, ()
    mesh = grad.device_mesh
    # Not ``is_shard()``: FSDP's strided shard of a tensor-parallel shard answers False to it.
    # A dimension of one rank (dp_shard=1 under HSDP) has nothing to add.
    split = tuple(
        dim for dim, placement in enumerate(grad.placements) if not placement.is_replicate() and mesh.size(dim) > 1
    )
    return mesh, split


def _without_partial(grad: DTensor) -> DTensor:
    """``grad`` with its pending sums reduced (a square of partial sums is not a partial sum of
    squares). FSDP hands over reduced gradients, so this is a fallback that costs nothing then."""
    if not any(placement.is_partial() for placement in grad.placements):
        return grad
    placements = [Replicate() if placement.is_partial() else placement for placement in grad.placements]
    return grad.redistribute(grad.device_mesh, placements)


@torch.no_grad()
def clip_to_norm(grads: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient (its local shard, in place) by ``max_norm / norm`` where the norm
    is larger. Local to this rank, no collective.

    torch's ``clip_grads_with_norm_`` arithmetic, which takes parameters and so would scale
    their DTensor gradients: the same coefficient, clamped at 1 and multiplied in even then, so
    that no device sync decides whether to clip.
    """
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    on_device: dict[torch.device, torch.Tensor] = {}
    for grad in grads:
        local = local_slice(grad)
        if local.device not in on_device:  # offloaded gradients live in host memory
            on_device[local.device] = coefficient.to(local.device)
        local.mul_(on_device[local.device])


def new_adamw_state(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state of one parameter before its first update, as torch's fused AdamW allocates
    it: a float32 step counter on the parameter's device, zero moments shaped (and sharded) as
    the parameter."""
    return {
        "step": torch.zeros((), dtype=torch.float32, device=param.device),
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }


class LocalAdamW(torch.optim.AdamW):
    """Fused AdamW (one kernel per device and dtype) whose update runs on the local shards of
    DTensor parameters, gradients and moments. The state keeps torch's layout (``step``,
    ``exp_avg``, ``exp_avg_sq`` per parameter), so ``state`` and ``param_groups`` read and
    load as those of ``torch.optim.AdamW``. Only what the trainer uses is supported: no
    amsgrad, no maximize, no closure.
    """

    def __init__(self, params, *, lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)

    @torch.no_grad()
    def step(self, closure=None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("LocalAdamW.step takes no closure")
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            if not params:
                continue
            for param in params:
                if not self.state[param]:  # its first update
                    self.state[param].update(new_adamw_state(param))
            states = [self.state[param] for param in params]
            beta1, beta2 = group["betas"]
            adam(
                [local_slice(param) for param in params],
                [local_slice(param.grad) for param in params],
                [local_slice(state["exp_avg"]) for state in states],
                [local_slice(state["exp_avg_sq"]) for state in states],
                [],
                [state["step"] for state in states],
                fused=True,
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
