"""The one module that touches private torch internals; checked against torch 2.13.x at import.

Runs on the ranks (and in tests); the driver never imports it. It lives in ``checkpointing/``,
the lowest of our packages that imports torch, so that both ``checkpointing/`` (DCP's chunk
list) and ``workers/`` (process groups, DTensor caches, error classification) use the same
module while imports still flow one way (workers -> checkpointing). Every other module calls
the functions below and never names a private symbol itself.

At import, ``check_torch_internals()`` resolves every private symbol listed in
``PRIVATE_SYMBOLS``; if one is missing (a torch upgrade moved it) it raises one clear line
naming the torch version we support and the one found, instead of an ``AttributeError`` deep
in a generation change. ``pyproject.toml`` pins ``torch<2.14`` for the same reason.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

SUPPORTED_TORCH = "2.13"

# Logger of DTensor's redistribution, which warns on every implicit redistribute of a step.
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"

# Every private symbol used below, as "module:attribute.path".
PRIVATE_SYMBOLS: tuple[str, ...] = (
    "torch.distributed.distributed_c10d:_world.group_count",
    "torch.distributed.distributed_c10d:_abort_process_group",
    "torch.distributed.checkpoint.planner_helpers:_create_chunk_list",
    "torch.distributed.tensor:DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear",
    "torch.distributed.tensor:DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear",
    "torch:_C._clear_DTensor_sharding_propagator_cache",
    "torch.distributed.tensor._redistribute:clear_redistribute_planner_cache",
    "torch.distributed.tensor._redistribute:_gen_transform_infos.cache_clear",
    "torch.distributed.tensor._collective_utils:MeshTopoInfo.build_from_mesh.cache_clear",
    "torch.distributed.tensor._utils:compute_local_shape_and_global_offset",
    "torch.distributed.device_mesh:DeviceMesh._flatten",
    "torch.distributed.device_mesh:DeviceMesh._unflatten",
    "torch.distributed.tensor:DTensor._local_tensor",
    "torch._dynamo.utils:counters",
    "torch.distributed._functional_collectives:AsyncCollectiveTensor",
    "torch.distributed.distributed_c10d:_resolve_process_group",
    "torch:ops.aten._scaled_dot_product_flash_attention_for_cpu",
    "torch:ops.aten._scaled_dot_product_flash_attention_for_cpu_backward",
)


class TorchVersionError(ImportError):
    """The installed torch lacks a private symbol meshpilot relies on."""


def _resolve(symbol: str) -> Any:
    module_name, _, path = symbol.partition(":")
    value: Any = importlib.import_module(module_name)
    for name in path.split("."):
        value = getattr(value, name)
    return value


def check_torch_internals(symbols: tuple[str, ...] = PRIVATE_SYMBOLS) -> None:
    """Raise one ``TorchVersionError`` line if any private symbol we use is missing."""
    missing = []
    for symbol in symbols:
        try:
            _resolve(symbol)
        except (ImportError, AttributeError):
            missing.append(symbol.replace(":", "."))
    if missing:
        raise TorchVersionError(
            f"meshpilot supports torch {SUPPORTED_TORCH}.x, found torch {torch.__version__}: "
            f"missing {', '.join(missing)}; install torch>={SUPPORTED_TORCH},<2.14"
        )


check_torch_internals()

# Imported once the check passed, so a missing one fails with the line above, not here.
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor._collective_utils import MeshTopoInfo  # noqa: E402
from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402


# --------------------------------------------------------------------- attention kernels
def cpu_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention on CPU (the flash kernel ``scaled_dot_product_attention`` runs) returning
    the output and the float32 log-sum-exp per query row that the public function keeps to
    itself; ``q``, ``k``, ``v`` with equal heads, ``mask`` additive in ``q``'s dtype. A row that
    ``mask`` hides entirely comes back with output 0 and log-sum-exp 0 (not -inf)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    output, log_sum_exp = op(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
    return output, log_sum_exp


def cpu_attention_backward(
    grad_output: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    output: torch.Tensor,
    log_sum_exp: torch.Tensor,
    *,
    is_causal: bool,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused CPU kernel's backward: dQ, dK, dV given the output and log-sum-exp of the rows
    (which may be those of attention over more keys than ``k``: ring attention's blocks)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    grad_q, grad_k, grad_v = op(grad_output, q, k, v, output, log_sum_exp, 0.0, is_causal, attn_mask=mask, scale=scale)
    return grad_q, grad_k, grad_v


# --------------------------------------------------------------------- process groups
def set_group_name_base(base: int) -> None:
    """Number the next process groups from ``base`` (torch names groups by a global counter).

    Every rank of a generation calls it with the same base before ``init_process_group``.
    """
    dist.distributed_c10d._world.group_count = base


def process_group_named(name: str) -> Any:
    """The process group of ``name`` (``ProcessGroup.group_name``): how a custom operator, which
    takes no group object, finds its group (as torch's functional collectives do)."""
    return dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]  # a NewType of str


def abort_process_groups() -> None:
    """Abort every process group of this process (no-op errors are the caller's to log)."""
    dist.distributed_c10d._abort_process_group()


def unflatten_mesh_dim(mesh: Any, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """``mesh`` with dimension ``dim`` reshaped into ``names`` of ``sizes`` over the same ranks
    (row-major: the last name varies fastest). Collective: every rank of ``mesh`` calls it (it
    creates the new dimensions' process groups)."""
    return mesh._unflatten(dim, sizes, names)


def around_shape_inference(stage: Any, enter: Callable[[], None], leave: Callable[[], None]) -> None:
    """Call ``enter`` before and ``leave`` after pipeline ``stage``'s shape inference.

    torch 2.13's ``PipelineStage`` infers its inputs' and outputs' shapes by running its module
    once before the first step, with grad enabled, on the first microbatch (first stage) or on
    uninitialised placeholders (the others): a forward that is not part of any step.
    """
    inference = stage._forward_metadata_inference

    @functools.wraps(inference)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        enter()
        try:
            return inference(*args, **kwargs)
        finally:
            leave()

    stage._forward_metadata_inference = wrapped


# --------------------------------------------------------------------- DTensor
def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh`` (a DeviceMesh slice of adjacent dimensions) as one dimension called ``name`` of
    its root mesh, as TorchTitan flattens ``dp_shard`` and ``cp`` into ``dp_shard_cp``.

    Collective over the ranks of the root mesh the first time (it creates sub-groups).
    """
    return mesh._flatten(name)


def local_shape_and_offset(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's slice of DTensor ``tensor``."""
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


def local_tensor_shape(tensor: Any) -> tuple[int, ...]:
    """The shape of this rank's local part of DTensor ``tensor``, read from the tensor it wraps
    (``to_local()`` gives the same shape through an autograd call, per tensor on every save)."""
    return tuple(tensor._local_tensor.shape)


def chunk_list(tensor: torch.Tensor) -> list[Any]:
    """torch.distributed.checkpoint's own chunks (``offsets``, ``sizes``) of this rank's part of ``tensor``."""
    return _create_chunk_list(tensor)


def clear_thread_dtensor_caches() -> None:
    """Clear the DTensor caches keyed by mesh that belong to the CALLING thread only.

    In torch 2.13 two caches are per thread: the Python sharding-propagation LRU
    (``ShardingPropagator.propagate_op_sharding`` is a ``LocalLRUCache``, a ``threading.local``)
    and the C++ dispatch fast path's (a ``thread_local`` in ``python_variable.cpp``;
    ``_clear_DTensor_sharding_propagator_cache`` resets only the calling thread's). Another
    thread that ran DTensor ops (autograd's device thread in a CUDA backward) keeps its own.
    """
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def clear_shared_dtensor_caches() -> None:
    """Clear the process-wide DTensor caches keyed by mesh (one call clears them for every
    thread): tensor-meta propagation, redistribute planners and transform plans (which hold
    flattened meshes), mesh topology infos."""
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    clear_redistribute_planner_cache()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


def clear_dtensor_caches() -> None:
    """Clear every DTensor cache keyed by mesh: the shared ones and the calling thread's."""
    clear_shared_dtensor_caches()
    clear_thread_dtensor_caches()


# --------------------------------------------------------------------- compilation
# Inductor's counters of its FX-graph cache: a miss is a graph compiled here, a hit one loaded
# from the cache directory (torch._dynamo.utils.counters, a process-wide defaultdict of Counters).
_FX_GRAPH_CACHE_MISS = "fxgraph_cache_miss"
_FX_GRAPH_CACHE_HIT = "fxgraph_cache_hit"


def settled(tensor: Any) -> Any:
    """``tensor`` itself, unless it is the lazily waited result of a functional collective
    (DTensor's redistributions return one): then a plain copy of it, on the autograd graph.

    A compiled region given such a tensor as input hands back no gradient through it (measured on
    torch 2.13: under sequence parallelism the embedding got none from the first compiled block).
    The copy waits for the collective and is an ordinary autograd op, whose backward passes the
    gradient on.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.clone() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def inductor_graph_counts() -> tuple[int, int]:
    """(graphs compiled, graphs loaded from the cache) by inductor in this process so far."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return inductor[_FX_GRAPH_CACHE_MISS], inductor[_FX_GRAPH_CACHE_HIT]


# --------------------------------------------------------------------- errors
# gloo raises a plain RuntimeError (not a DistError) from its transport, and only its text says
# what happened. Measured on torch 2.13 CPU/gloo: a peer process dying mid all_reduce gives
# "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [addr]:port ..."; a peer that
# never joins gives "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for
# recv operation to complete". These texts are the only place the project reads an error message.
_GLOO_TRANSPORT = "gloo/transport"
_GLOO_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_GLOO_TIMED_OUT = "Timed out waiting"
# NCCL (not measured here: CPU only) reports a communicator aborted after a peer's error as a
# DistBackendError with one of these texts.
_NCCL_PEER_ABORT = ("NCCL communicator was aborted", "ncclRemoteError")


class CollectiveFailure(StrEnum):
    """What a torch distributed error says happened; the values are ``FailureKind`` values
    (``workers/spec/messages.py``), which ``checkpointing/`` cannot import."""

    PEER = "peer_failure"  # the connection to another rank closed or reset: that rank failed
    TIMEOUT = "timeout"  # this rank's own wait (a collective, a store wait) ran past its timeout


def collective_failure(error: BaseException) -> CollectiveFailure | None:
    """What torch says about a failed collective or store call, told by exception type first;
    ``None`` when it is not a torch distributed failure this module recognises."""
    if isinstance(error, dist.DistNetworkError):
        return CollectiveFailure.PEER  # a store or peer socket closed under us
    if isinstance(error, dist.DistStoreError):
        return CollectiveFailure.TIMEOUT  # a store wait (get, wait) ran past the store's timeout
    if isinstance(error, dist.DistBackendError):
        text = str(error)
        if any(marker in text for marker in _NCCL_PEER_ABORT):
            return CollectiveFailure.PEER
        return CollectiveFailure.TIMEOUT if "timeout" in text.lower() else None
    if type(error) is RuntimeError and _GLOO_TRANSPORT in str(error):
        text = str(error)
        if any(marker in text for marker in _GLOO_PEER_GONE):
            return CollectiveFailure.PEER
        if _GLOO_TIMED_OUT in text:
            return CollectiveFailure.TIMEOUT
    return None
