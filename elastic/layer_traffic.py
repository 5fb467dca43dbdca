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
from elastic.spec import CpMethod, MeshSpec

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
    """Context-parallel time one layer and microbatch waits for, and the step's cp traffic (None
    with cp = 1), by ``layout.cp_method``; ``tokens`` is this rank's share of the sequence.

    ``allgather``: each cp rank receives the other ranks' keys and values (an all-gather forward,
    again when recomputing) and sends their gradients back (a reduce-scatter backward), all on the
    critical path. ``ring``: the same blocks forward, and backward the blocks again plus their
    dK/dV, which travel a full turn back to their owner; each transfer overlaps the attention of
    the block held (``cp - 1`` of ``cp`` blocks' compute to hide behind), so only what exceeds it
    waits. ``ulysses``: an all-to-all of the queries, keys and values before attention and of the
    output after (``(cp - 1) / cp`` of each leaves the rank), the same backward, on the critical path.
    """
    mesh = layout.mesh
    if mesh.cp == 1:
        return 0.0, None
    cp_link, cp_bw = link(mesh, "cp", cluster, assumptions)
    cp, recompute = mesh.cp, 1 if layout.activation_checkpointing else 0
    kv_bytes = _kv_bytes(workload, mesh, tokens)
    if layout.cp_method is CpMethod.RING:
        forward_bytes, backward_bytes = (cp - 1) * kv_bytes, (2 * cp - 1) * kv_bytes
        layer_bytes = (1 + recompute) * forward_bytes + backward_bytes
        attention_s = _attention_seconds(workload, cluster, layout, assumptions, tokens) * (cp - 1) / cp
        forward_wait = max(0.0, forward_bytes / cp_bw - attention_s / 3)  # the forward: 1/3 of the FLOPs
        backward_wait = max(0.0, backward_bytes / cp_bw - attention_s * 2 / 3)
        layer_s = (1 + recompute) * forward_wait + backward_wait
    elif layout.cp_method is CpMethod.ULYSSES:
        exchanged = 2 * _q_bytes(workload, mesh, tokens) + ulysses_kv_sent_bytes(workload, mesh, tokens)
        layer_bytes = (2 + recompute) * (cp - 1) / cp * exchanged
        layer_s = layer_bytes / cp_bw
    else:
        layer_bytes = (2 + recompute) * (cp - 1) * kv_bytes
        layer_s = layer_bytes / cp_bw
    step_layers = layers_on_rank * layout.microbatches
    return layer_s, CommCost(
        layer_bytes * step_layers, cp_link, layer_bytes / cp_bw * step_layers, layer_s * step_layers
    )


def cp_attention_bytes(workload: Workload, layout: Layout, tokens: int) -> tuple[float, float]:
    """Context parallel's key/value bytes on a rank beyond its own tokens' activations, per layer:
    (kept for the backward, held only while the layer runs). ``allgather`` keeps the gathered
    sequence's keys and values (attention saves its inputs) and its [seq / cp, seq] causal mask
    unless recomputed; ``ring`` keeps its
    own block and holds one more in flight (two at most); ``ulysses`` keeps its heads / cp heads
    of the whole sequence, the bytes of its own tokens' heads, but a key/value head repeated for
    cp ranks counts once per rank; the exchange's buffers are held while it runs."""
    mesh = layout.mesh
    if mesh.cp == 1:
        return 0.0, 0.0
    cp, kv_bytes = mesh.cp, _kv_bytes(workload, mesh, tokens)
    if layout.cp_method is CpMethod.RING:
        return 0.0, kv_bytes
    if layout.cp_method is CpMethod.ULYSSES:
        repeated = ulysses_kv_sent_bytes(workload, mesh, tokens) - kv_bytes
        buffers = 2 * _q_bytes(workload, mesh, tokens) + ulysses_kv_sent_bytes(workload, mesh, tokens)
        return (0.0 if layout.activation_checkpointing else repeated), buffers
    # Its causal mask (this rank's queries against every position) is built per layer and kept
    # by attention for the backward, in the activations' dtype: one per microbatch, shared by its
    # sequences (measured: bench/long_context.py).
    mask = ACTIVATION_BYTES * workload.seq_len / cp * workload.seq_len
    gathered = (cp - 1) * kv_bytes + mask
    return (0.0 if layout.activation_checkpointing else gathered), gathered


def ulysses_kv_sent_bytes(workload: Workload, mesh: MeshSpec, tokens: int) -> float:
    """Keys and values a rank hands to Ulysses' all-to-all: its own, or with fewer key/value heads
    per tp rank than cp, each repeated for the cp ranks whose queries use it."""
    kv_heads = workload.model.n_kv_heads // mesh.tp
    return _kv_bytes(workload, mesh, tokens) * max(kv_heads, mesh.cp) / kv_heads


def _kv_bytes(workload: Workload, mesh: MeshSpec, tokens: int) -> float:
    """Keys and values of ``tokens`` tokens on one tp rank."""
    model = workload.model
    return 2 * ACTIVATION_BYTES * tokens * model.n_kv_heads * model.head_dim / mesh.tp


def _q_bytes(workload: Workload, mesh: MeshSpec, tokens: int) -> float:
    """Queries (or attention outputs) of ``tokens`` tokens on one tp rank."""
    model = workload.model
    return ACTIVATION_BYTES * tokens * model.n_heads * model.head_dim / mesh.tp


def _attention_seconds(
    workload: Workload, cluster: Cluster, layout: Layout, assumptions: Assumptions, tokens: int
) -> float:
    """Forward + backward attention compute (scores and weighted sum) of one layer and microbatch."""
    model = workload.model
    flops = 12.0 * model.n_heads * model.head_dim * workload.seq_len * tokens / layout.mesh.tp
    return flops / (cluster.gpu.peak_flops * assumptions.compute_efficiency)


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
