"""Turn the model into this rank's pipeline stages, tensor-parallel and fully sharded.

Runs on every rank, inside ``Trainer`` construction. The order is fixed and the per-step
functions are thin: split into pipeline stages, then tensor parallel (DTensor plans with
sequence parallelism), then expert parallel (the MoE experts sharded over the ``ep`` mesh),
then activation checkpointing, then FSDP2 (``fully_shard``), then
materialise (``workers.initial_values`` initialises). Every function here is collective-free except where it says so.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import tensor as dtensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import checkpoint

from checkpointing.torch_compat import (
    clear_dtensor_caches,
    clear_thread_dtensor_caches,
    flatten_mesh,
    unflatten_mesh_dim,
)
from elastic.spec import DIM_ORDER, CpMethod, MeshSpec
from workers.context_parallel import SequenceShard
from workers.models import ModelFamily, StageModel
from workers.models.moe.grouped_experts import EXPERT_WEIGHTS, GroupedExperts
from workers.spec import ModelSpec
from workers.spec.pipeline import stage_ids
from workers.spec.train import ReshardAfterForward


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage held by this rank: its global index and the layers it owns."""

    stage_index: int
    num_stages: int
    layer_ids: range

    @property
    def first(self) -> bool:
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def stage_plans(
    model: ModelSpec, *, pp: int, pp_rank: int, stages_per_rank: int, schedule: str = "1f1b"
) -> list[StagePlan]:
    """The stages of pipeline rank ``pp_rank``, balanced by layer count, in ascending order.

    With several stages per rank, the schedule's placement says which (``stage_ids``): the
    interleaved schedules' "loop" (rank ``r`` holds ``r, r + pp, ...``) or the V of zbv and
    dualpipev (rank ``r`` holds ``r`` and ``2 pp - 1 - r``).
    """
    num_stages = pp * stages_per_rank
    per_stage = model.n_layers // num_stages
    return [
        StagePlan(stage, num_stages, range(stage * per_stage, (stage + 1) * per_stage))
        for stage in stage_ids(schedule, pp=pp, pp_rank=pp_rank, stages_per_rank=stages_per_rank)
    ]


def build_world_mesh(mesh: MeshSpec, device_type: str) -> DeviceMesh:
    """Collective: every rank of the default process group calls it (it creates sub-groups)."""
    mesh.check_world_size(torch.distributed.get_world_size())
    return init_device_mesh(device_type, mesh.shape, mesh_dim_names=DIM_ORDER)


@dataclass(frozen=True)
class ExpertMeshes:
    """Where the routed experts live under expert parallelism (``parallelism.ep > 1``).

    ``dp_shard`` reshaped into (dp_shard / ep, ep) over the same ranks: ``ep`` holds the ranks
    that exchange tokens and split the experts between them (each rank ``n_experts / ep``),
    ``fsdp`` the rest of the data-parallel ranks (with dp_replicate, HSDP), and the cp and tp
    ranks, which hold other tokens of the same samples, over which FSDP2 shards each rank's
    experts further.
    """

    ep: DeviceMesh
    fsdp: DeviceMesh


def expert_meshes(world_mesh: DeviceMesh, mesh: MeshSpec, ep: int) -> ExpertMeshes:
    """Collective: every rank of the world mesh calls it (it creates the sub-groups)."""
    if mesh.dp_shard % ep:
        # The config check refuses this; a mesh chosen later (a resize) must keep dp_shard a multiple.
        raise ValueError(f"parallelism.ep={ep} does not divide this mesh's dp_shard={mesh.dp_shard}")
    split = unflatten_mesh_dim(world_mesh, "dp_shard", (mesh.dp_shard // ep, ep), ("dp_shard_mod_ep", "ep"))
    # The cp and tp ranks hold other tokens of the same samples: the experts' FSDP spans them
    # (``apply_whole_weight_fsdp`` says how their gradients combine).
    dims = ("dp_shard_mod_ep", *_token_dims(mesh))
    return ExpertMeshes(ep=split["ep"], fsdp=_shard_mesh(world_mesh, split, dims, mesh))


def _token_dims(mesh: MeshSpec) -> tuple[str, ...]:
    """The mesh dimensions over which a sample's tokens are split (cp, and tp's sequence parallelism)."""
    return tuple(name for name in ("cp", "tp") if getattr(mesh, name) > 1)


def whole_weight_mesh(world_mesh: DeviceMesh, mesh: MeshSpec) -> DeviceMesh:
    """The mesh FSDP2 shards the weights of modules that tensor parallelism leaves whole (a
    mixture of experts' router and experts) over: dp_shard, cp and tp flattened (with
    dp_replicate, HSDP). Collective the first time (flattening creates groups)."""
    return _shard_mesh(world_mesh, world_mesh, ("dp_shard", *_token_dims(mesh)), mesh)


def _shard_mesh(world_mesh: DeviceMesh, source: DeviceMesh, dims: tuple[str, ...], mesh: MeshSpec) -> DeviceMesh:
    """FSDP2's mesh over ``dims`` of ``source`` (the world mesh or a reshaping of it), several
    flattened into one dimension named by joining theirs, with dp_replicate in front for HSDP.

    A flattened dimension is registered on the root mesh: HSDP needs the two dimensions in one
    mesh, sliced from the root, the only way torch 2.13 has. Collective the first time it
    flattens (that creates groups).
    """
    if len(dims) == 1:
        return source["dp_replicate", dims[0]] if mesh.dp_replicate > 1 else source[dims[0]]
    name = "_".join(dims)
    shard = flatten_mesh(source[dims], name)
    return world_mesh["dp_replicate", name] if mesh.dp_replicate > 1 else shard


def apply_expert_parallel(module: StageModel, ep_mesh: DeviceMesh) -> None:
    """Shard every ``GroupedExperts``' stacked weights ``Shard(0)`` over ``ep_mesh`` (on the meta
    device: shapes only), and hand it the ep group its token exchange runs on."""
    for experts in module.modules():
        if not isinstance(experts, GroupedExperts):
            continue
        for name in EXPERT_WEIGHTS:
            sharded = dtensor.distribute_tensor(getattr(experts, name), ep_mesh, [dtensor.Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded))
        experts.ep_group = ep_mesh.get_group()


def data_parallel_mesh(world_mesh: DeviceMesh, mesh: MeshSpec) -> DeviceMesh:
    """The mesh FSDP2 shards over: HSDP (replicate x shard) when there are replica groups.

    With cp > 1 the shard dimension is ``dp_shard`` and ``cp`` flattened (``dp_shard_cp``): the
    cp ranks hold different tokens of the same samples, so their gradients are averaged like
    those of data-parallel ranks. Collective the first time with cp > 1 (flattening creates groups).
    """
    return _shard_mesh(world_mesh, world_mesh, ("dp_shard", "cp") if mesh.cp > 1 else ("dp_shard",), mesh)


def sequence_shard(
    world_mesh: DeviceMesh, mesh: MeshSpec, cp_rank: int, method: CpMethod = CpMethod.ALLGATHER
) -> SequenceShard:
    """This rank's part of every sequence; collective-free (the cp group exists with the mesh)."""
    if mesh.cp == 1:
        return SequenceShard()
    return SequenceShard(cp=mesh.cp, cp_rank=cp_rank, group=world_mesh["cp"].get_group(), method=method)


def apply_context_parallel(module: StageModel, shard: SequenceShard) -> None:
    """Hand ``shard`` to every attention layer of the stage (modules with a ``sequence_shard``).

    A family whose attention has none cannot split sequences: refused here rather than
    training each rank's part of a sequence as if it were the whole.
    """
    attention = [sub for sub in module.modules() if hasattr(sub, "sequence_shard")]
    if module.layers and not attention:
        raise ValueError(
            f"{type(module).__name__} has no context-parallel attention (a sequence_shard attribute); "
            "set parallelism.cp=1"
        )
    for sub in attention:
        setattr(sub, "sequence_shard", shard)  # noqa: B010 - any family's attention, not one class


def build_stage_module(family: ModelFamily, model: ModelSpec, plan: StagePlan) -> StageModel:
    """The stage's module on the meta device: shapes only, no memory, no initialisation yet."""
    with torch.device("meta"):
        module = family.build(model)
    return module.keep_only(plan.layer_ids, first=plan.first, last=plan.last)


def apply_tensor_parallel(module: StageModel, family: ModelFamily, model: ModelSpec, tp_mesh: DeviceMesh) -> None:
    """The family's tensor-parallel plan, for the parts of it this stage holds."""
    plan = family.tensor_parallel_plan(model)
    top = {name: style for name, style in plan.top.items() if _holds(module, name)}
    if top:
        parallelize_module(module, tp_mesh, top)
    for layer in module.layers.values():
        parallelize_module(layer, tp_mesh, {name: style for name, style in plan.layer.items() if _holds(layer, name)})
    # Modules that run their rank's sequence-parallel tokens through whole weights (a mixture of
    # experts) count routed tokens over the tp group.
    for sub in module.modules():
        if hasattr(sub, "tensor_parallel_group"):
            setattr(sub, "tensor_parallel_group", tp_mesh.get_group())  # noqa: B010 - any family's module


def _holds(module: nn.Module, name: str) -> bool:
    """Whether ``module`` has the submodule ``name`` (dotted; a stage's dropped parts are None)."""
    found: Any = module
    for part in name.split("."):
        found = getattr(found, part, None)
        if found is None:
            return False
    return True


def apply_activation_checkpointing(module: StageModel) -> None:
    """Recompute each layer's activations in the backward pass instead of keeping them.

    The layer's ``forward`` is wrapped on the instance, so parameter names do not change
    (a wrapper module would add a level to every name, and checkpoints would not match).
    """
    for layer in module.layers.values():
        layer.forward = _checkpointed(layer.forward)


def _checkpointed(forward: Any) -> Any:
    def run(*args: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False)
        return forward(*args)

    return run


def apply_fsdp(
    module: StageModel,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    pipelined: bool,
    reshard: ReshardAfterForward = ReshardAfterForward.AUTO,
    cpu_offload: bool = False,
) -> None:
    """FSDP2 per transformer block, then the stage root.

    ``reshard`` AUTO: with pipelining, parameters stay gathered between the microbatches of a
    step (re-gathering them for every microbatch would multiply the all-gather traffic by the
    microbatch count); without, each block frees its gathered parameters after its forward.
    ALWAYS frees them (ZeRO-3's memory), NEVER keeps them (ZeRO-2's: gradients and optimizer
    state sharded, whole parameters held from forward to backward). ``cpu_offload`` keeps the
    sharded parameters, their gradients and so the optimizer state in host memory (FSDP2 copies
    each block's shard to the device for the all-gather and the gradient back after the reduce).
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if reshard == ReshardAfterForward.AUTO:
        reshard_after_forward = not pipelined
    else:
        reshard_after_forward = reshard == ReshardAfterForward.ALWAYS
    options: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": policy, "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        # Pinned host memory needs an accelerator; on a CPU-only rank the policy moves nothing.
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in module.layers.values():
        fully_shard(block, **options)
    fully_shard(module, **options)


def apply_expert_fsdp(
    module: StageModel, experts: ExpertMeshes, *, data_parallel: int, param_dtype: torch.dtype, pipelined: bool
) -> None:
    """FSDP2 over ``experts.fsdp`` for each block's expert-parallel experts; before ``apply_fsdp``,
    so that each block's own FSDP group leaves them to theirs (the same policy and resharding).

    An expert's gradient already sums the gradients of the tokens of every rank in its ep group
    (the exchange brought them), and of the tp ranks', so it is divided by the data-parallel
    degree (dp_replicate x dp_shard x cp), not by the size of ``experts.fsdp``: the mean over
    the global batch, as for every other parameter.
    """
    for grouped in module.modules():
        if isinstance(grouped, GroupedExperts):
            _shard_summed(
                grouped, experts.fsdp, data_parallel=data_parallel, param_dtype=param_dtype, pipelined=pipelined
            )


def apply_whole_weight_fsdp(
    module: StageModel, mesh: DeviceMesh, *, data_parallel: int, param_dtype: torch.dtype, pipelined: bool
) -> None:
    """FSDP2 over ``mesh`` (``whole_weight_mesh``) for each module tensor parallelism leaves whole
    (those with a ``tensor_parallel_group``); after ``apply_expert_fsdp``, before ``apply_fsdp``.

    Each tp rank runs its own tokens through the whole weights, so its gradient covers those
    tokens only: the tp ranks' gradients are summed, the data-parallel ranks' averaged (divided
    by ``data_parallel``, not by the mesh's size).
    """
    for sub in module.modules():
        if hasattr(sub, "tensor_parallel_group"):
            _shard_summed(sub, mesh, data_parallel=data_parallel, param_dtype=param_dtype, pipelined=pipelined)


def _shard_summed(
    module: nn.Module, mesh: DeviceMesh, *, data_parallel: int, param_dtype: torch.dtype, pipelined: bool
) -> None:
    """``fully_shard`` with gradients summed over ``mesh`` then divided by ``data_parallel``."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    sharded = fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=not pipelined)
    sharded.set_gradient_divide_factor(float(data_parallel))
    if mesh.device_type == "cpu":
        # A divide factor other than the group's size is NCCL's pre-multiplied sum, which gloo
        # lacks: divide the gradients before a plain sum instead.
        sharded.set_force_sum_reduction_for_comms(True)


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate the (sharded) parameters on the device; values are garbage until initialised."""
    module.to_empty(device=device)


def local_slice(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for ``param`` (its DTensor shard, or the plain tensor)."""
    return param.to_local() if isinstance(param, DTensor) else param.data


def forget_old_meshes() -> None:
    """Drop DTensor's caches that remember meshes of an earlier generation.

    Runs on every rank, at the start of every generation, on the thread that joins it (before
    it runs DTensor ops): clears the process-wide caches and this thread's own. Other threads
    that run DTensor ops clear theirs through ``ensure_fresh_caches`` (hooks that
    ``register_fresh_cache_hooks`` installs).
    A DeviceMesh compares equal to one of an earlier generation with the same layout (names,
    shape, thread), so a sharding-propagation cache would hand back output specs that hold
    the old mesh object, whose process-group names no longer resolve ("Could not resolve the
    process group registered under the name 8") once a shrink, a drain or a grow brings the
    same layout back. The Python cache and the C++ dispatch fast path's (which answers first)
    are per thread; missing the second made a drained run fail steps after it resumed. The
    redistribute planners, transform plans and topology infos are keyed by mesh too.
    """
    clear_dtensor_caches()


# Which cache generation each thread's per-thread DTensor caches were last cleared for.
_thread_caches = threading.local()
_cache_generations = itertools.count(1)


def new_cache_generation() -> int:
    """A stamp no earlier call returned: one per set of meshes (one per Trainer)."""
    return next(_cache_generations)


def ensure_fresh_caches(generation: int) -> None:
    """Clear the calling thread's DTensor caches the first time it runs in ``generation``.

    Runs on any thread of a rank that runs DTensor ops (the loop thread in forward, autograd's
    device thread in a CUDA backward, which no code of ours starts); costs one thread-local
    compare once the thread is fresh.
    """
    if getattr(_thread_caches, "generation", None) != generation:
        clear_thread_dtensor_caches()
        _thread_caches.generation = generation


def register_fresh_cache_hooks(module: nn.Module, generation: int) -> None:
    """Make every thread that runs ``module``'s forward or backward clear its stale caches.

    Runs on every rank, at Trainer construction. A forward-pre-hook covers the thread that
    calls forward; a hook on the output's gradient runs on the thread autograd's engine picks
    for the backward (on CUDA its long-lived device thread), before any of the module's own
    backward ops (activation-checkpoint recomputation included).
    """

    def before_forward(_module: nn.Module, _args: Any) -> None:
        ensure_fresh_caches(generation)

    def before_backward(grad: torch.Tensor) -> None:
        ensure_fresh_caches(generation)

    def after_forward(_module: nn.Module, _args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(before_backward)

    module.register_forward_pre_hook(before_forward, prepend=True)
    module.register_forward_hook(after_forward)
