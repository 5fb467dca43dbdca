"""What the collectives of a layer cost, and which link each mesh group uses.

Pure arithmetic (no ray, no torch) for ``elastic.cost_model``: tensor parallel's gathers and
reduce-scatters, context parallel's key/value exchange and expert parallel's all-to-alls, each
per layer and microbatch (on the critical path), and ``link``, the NVLink-or-network rule every
dimension's traffic is priced with. The formulas are in ``cost_model``'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastic.memory_model import ACTIVATION_BYTES
from elastic.pipeline_cost import V_SCHEDULES
from elastic.spec import MeshSpec

if TYPE_CHECKING:  # cost_model imports this module; only its types are needed here
    from elastic.cost_model import Assumptions, Cluster, Layout, Workload


@dataclass(frozen=True)
class CommCost:
    """One mesh dimension's traffic per GPU per step and the time it adds to the step."""

    bytes_per_step: float
    link: str  # "nvlink", "network" or "-" when the dimension has degree 1
    busy_s: float
    exposed_s: float

    def as_dict(self) -> dict[str, object]:
        return {
            "gb_per_step": round(self.bytes_per_step / 1e9, 3),
            "link": self.link,
            "busy_s": round(self.busy_s, 4),
            "exposed_s": round(self.exposed_s, 4),
        }


def tp_per_layer(
    workload: Workload, cluster: Cluster, layout: Layout, assumptions: Assumptions, tokens: int
) -> tuple[str, float, float]:
    """Tensor-parallel traffic of one layer and microbatch: (link, bytes, seconds).

    Sequence parallelism gathers and scatters the activations around attention and the MLP; a
    family whose MLP tp leaves whole (``tp_split_ffn_dim`` None: a mixture of experts takes its
    rank's tokens as they are) around attention only.
    """
    tp = layout.mesh.tp
    tp_link, tp_bw = link(layout.mesh, "tp", cluster, assumptions)
    collectives = 8 + (4 if layout.activation_checkpointing else 0)
    if workload.model.tp_split_ffn_dim is None:
        collectives //= 2
    tp_bytes_layer = collectives * (tp - 1) / tp * ACTIVATION_BYTES * tokens * workload.model.dim
    return tp_link, tp_bytes_layer, tp_bytes_layer / tp_bw if tp > 1 else 0.0


def context_parallel(
    workload: Workload, cluster: Cluster, layout: Layout, assumptions: Assumptions, tokens: int, layers_on_rank: int
) -> tuple[float, CommCost | None]:
    """Context-parallel time of one layer and microbatch, and the step's cp traffic (None with cp = 1).

    Each cp rank receives the other ranks' keys and values (an all-gather forward, again when
    recomputing) and sends their gradients back (a reduce-scatter backward); ``tokens`` is this
    rank's share of the sequence. Counted on the critical path, like tensor parallel's.
    """
    mesh, model = layout.mesh, workload.model
    if mesh.cp == 1:
        return 0.0, None
    cp_link, cp_bw = link(mesh, "cp", cluster, assumptions)
    collectives = 2 + (1 if layout.activation_checkpointing else 0)
    kv_bytes = 2 * ACTIVATION_BYTES * tokens * model.n_kv_heads * model.head_dim / mesh.tp  # K and V
    layer_bytes = collectives * (mesh.cp - 1) * kv_bytes
    step_layers = layers_on_rank * layout.microbatches
    step_s = layer_bytes / cp_bw * step_layers
    return layer_bytes / cp_bw, CommCost(layer_bytes * step_layers, cp_link, step_s, step_s)


def expert_parallel(
    workload: Workload,
    cluster: Cluster,
    layout: Layout,
    assumptions: Assumptions,
    tokens: int,
    layers_on_rank: int,
    compute_layer_s: float,
) -> tuple[float, CommCost | None]:
    """Expert-parallel all-to-all time one layer and microbatch waits for, and the step's ep traffic
    (None without experts split over ranks). ``tokens`` is this rank's share of the microbatch;
    ``compute_layer_s`` the layer's compute, which a V schedule hides it behind when
    ``assumptions.overlap_expert_all_to_all``."""
    model, ep = workload.model, layout.ep
    if ep == 1:  # the only degree a model without routed experts runs (``ModelSpec.splits_experts``)
        return 0.0, None
    ep_link, ep_bw = link(layout.mesh, "ep", cluster, assumptions, degree=ep)
    collectives = 4 + (2 if layout.activation_checkpointing else 0)  # dispatch and combine, each way
    # One copy of each of this rank's tokens (1/tp of the cp rank's under sequence parallelism), every exchange.
    copies = collectives * ACTIVATION_BYTES * tokens / layout.mesh.tp * model.dim
    layer_bytes = (ep - 1) / ep * model.experts_per_token * copies
    layer_s = layer_bytes / ep_bw
    nodes = -(-layout.mesh.stride("dp_shard") * ep // cluster.gpus_per_node)
    if nodes > 1 and assumptions.expert_routing_nodes is not None:
        # Once per destination node over the network, then k copies over NVLink inside the nodes.
        remote = min(assumptions.expert_routing_nodes, nodes) * (nodes - 1) / nodes
        network_bytes = remote * copies
        nvlink_s = model.experts_per_token * copies / (cluster.gpu.nvlink_bytes_per_s * assumptions.link_efficiency)
        layer_bytes, layer_s = network_bytes, max(network_bytes / ep_bw, nvlink_s)
    step_layers = layers_on_rank * layout.microbatches
    busy_s = layer_s * step_layers
    if layout.schedule in V_SCHEDULES and assumptions.overlap_expert_all_to_all:
        layer_s = max(0.0, layer_s - compute_layer_s)  # hidden behind the paired chunk's compute
    return layer_s, CommCost(layer_bytes * step_layers, ep_link, busy_s, layer_s * step_layers)


def link(
    mesh: MeshSpec, dim: str, cluster: Cluster, assumptions: Assumptions, *, degree: int | None = None
) -> tuple[str, float]:
    """Which link a ``dim`` group uses and its effective bytes/s per GPU, one direction.

    ``dim="dp_shard"`` is FSDP's group: ``dp_shard x cp`` (adjacent in the rank order, one block).
    ``dim="ep"`` is the block of ``degree`` consecutive ranks of ``dp_shard`` (its inner part).
    """
    if dim == "ep":
        stride = mesh.stride("dp_shard")
    else:
        degree = mesh.fsdp_shards if dim == "dp_shard" else getattr(mesh, dim)
        stride = mesh.stride("cp" if dim == "dp_shard" else dim)
    assert degree is not None
    if degree == 1:
        return "-", math.inf
    within_node = stride * degree <= cluster.gpus_per_node
    if within_node:
        return "nvlink", cluster.gpu.nvlink_bytes_per_s * assumptions.link_efficiency
    return "network", cluster.gpu.network_bytes_per_s * assumptions.link_efficiency
