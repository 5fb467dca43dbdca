"""What one layout costs per GPU: memory, pipeline bubble, communication, step time and MFU.

Pure arithmetic (no ray, no torch): ``elastic.planner`` calls ``estimate`` for every candidate
layout, on the driver or on a laptop, in microseconds.

The model, and where each piece comes from:

* Model state follows the ZeRO paper (Rajbhandari et al. 2020, section 3/5): mixed-precision
  Adam keeps 2 bytes of bf16 parameters, 2 bytes of gradients and K = 12 bytes of optimizer
  state (fp32 master copy, momentum, variance) per parameter. ZeRO-1 shards the K bytes over
  the data-parallel group, ZeRO-2 also the gradients, ZeRO-3 also the parameters. FSDP2's full
  shard is ZeRO-3 (its fp32 sharded parameter + fp32 gradient + Adam's two moments are the same
  16 bytes); HSDP is ZeRO-3 inside ``dp_shard`` and a replica per ``dp_replicate`` slice.
* FSDP2 working buffers: without pipelining it gathers about two layers at a time (prefetch);
  with pipelining the parameters stay gathered across microbatches (torchtitan sets
  ``reshard_after_forward=False`` with PP) and the pipeline stage skips gradient sync until the
  last microbatch, so the stage's unsharded gradients accumulate in the fp32 reduce dtype.
* Activations: bytes per token per layer of a Llama block in bf16 with flash attention (no
  score matrix kept), derived in ``activation_bytes_per_token``; tensor parallel with sequence
  parallel divides all of it by ``tp`` (Korthikanti et al. 2022). Full activation checkpointing
  keeps only each layer's input (2·h bytes per token, sequence-sharded) and recomputes the
  forward (+1/3 of the layer FLOPs). Microbatches held in flight per schedule follow
  Narayanan et al. 2021 (1F1B warm-up, interleaved warm-up).
* Bubble: ``(p - 1) / (v·m + p - 1)`` for ``p`` stages, ``m`` microbatches, ``v`` virtual
  stages per rank (Narayanan et al. 2021: the bubble time shrinks by ``v``).
* Communication: ring collectives move ``(n - 1)/n`` of the tensor per GPU; TP (with sequence
  parallel) does 4 all-gathers/reduce-scatters of the layer activation per microbatch forward
  and 4 backward (+4 when recomputing), on the critical path; PP sends one activation and one
  gradient per chunk and microbatch; FSDP all-gathers bf16 parameters and reduce-scatters fp32
  gradients, hidden behind compute except what exceeds the compute it can overlap.
* Context parallel (``cp``): each rank holds ``seq_len / cp`` tokens of every sequence, so its
  activations, compute and TP/PP traffic are those of that many tokens (each still attends to
  the whole sequence: load-balanced causal chunks); every layer all-gathers the other ranks'
  keys and values forward (again when recomputing) and reduce-scatters their gradients
  backward, on the critical path, and attention keeps them and its causal mask of the rank's
  queries against the whole sequence; FSDP shards over ``dp_shard x cp``. ``Layout.cp_method``
  prices the other two ways (``layer_traffic.context_parallel``, ``cp_attention_bytes``): ring
  attention moves the blocks around the ring behind each block's attention and keeps no other
  rank's keys; Ulysses trades the sequence split for a head split with all-to-alls (exposed).
* LoRA (``Workload.lora``): the base is frozen, so it keeps only its fp32 shard (4 bytes a
  parameter, no gradient, no moments) while the adapters carry the full 16; its backward computes
  the activations' gradients but no weight gradients (4N instead of 6N FLOPs a token, Hu et al.
  2021), and FSDP reduce-scatters only the adapters' gradients (the gathers are unchanged).
* Expert parallel (``ep``, a mixture of experts): ``ep`` consecutive ranks of ``dp_shard`` each
  hold ``n_experts / ep`` of every layer's routed experts, FSDP-sharded over the other
  ``dp_shard / ep x cp`` ranks (so the state per GPU is the same; the gathers and their buffers
  are ``1 / ep`` of the experts). Every MoE layer sends each token's ``k`` copies to their
  experts and back (two all-to-alls forward, two backward, two more when recomputing), each
  moving ``(ep - 1)/ep`` of ``k·h`` values per token; on the critical path, unless the
  ``overlap_expert_all_to_all`` assumption holds for a V schedule: DeepSeek-V3's DualPipe runs a
  forward and a backward chunk of two microbatches together and hides one's all-to-all behind
  the other's compute (DeepSeek-V3 report, section 3.2.1), leaving only what exceeds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from elastic.hardware import GpuSpec
from elastic.layer_traffic import CommCost, context_parallel, cp_attention_bytes, expert_parallel, link, tp_per_layer
from elastic.memory_model import (
    ACTIVATION_BYTES,
    ADAM_BYTES,
    FROZEN_PARAM_BYTES,
    GRAD_BYTES,
    LOGIT_BYTES,
    PARAM_BYTES,
    REDUCE_BYTES,
    activation_bytes_per_token,
    fsdp_buffer_bytes,
)
from elastic.pipeline_cost import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, in_flight_chunk_microbatches, pipeline_bubble
from elastic.spec import BatchPlan, CpMethod, MeshSpec
from workers.spec import ModelSpec
from workers.spec.lora import LoraSpec

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")


@dataclass(frozen=True)
class Workload:
    """What is trained: the model, the sequence length and the global batch in sequences."""

    model: ModelSpec
    seq_len: int
    global_batch: int
    # LoRA adapters beside a frozen base (``model.lora``); None: every parameter trains.
    lora: LoraSpec | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch

    @property
    def adapter_params_per_layer(self) -> int:
        """Trainable parameters of one layer's adapters (0 without LoRA)."""
        if self.lora is None:
            return 0
        return self.model.adapter_params_per_layer(self.lora.target_modules, self.lora.rank)

    @property
    def trained_share(self) -> float:
        """The fraction of a layer's parameters that trains (and whose gradients FSDP reduces)."""
        if self.lora is None:
            return 1.0
        return self.adapter_params_per_layer / (self.model.params_per_layer + self.adapter_params_per_layer)

    def layer_flops_per_token(self) -> float:
        """Forward + backward FLOPs of one layer per token: the family's count, or with LoRA the base
        without its weight gradients (4 of the 6 FLOPs a parameter) plus the adapters' 6."""
        flops = self.model.layer_flops_per_token(self.seq_len)
        if self.lora is None:
            return flops
        return flops - 2.0 * self.model.active_params_per_layer + 6.0 * self.adapter_params_per_layer

    def flops_per_token(self) -> float:
        """Training FLOPs per token of the whole model (the output head trains only without LoRA)."""
        flops = self.model.flops_per_token(self.seq_len)
        if self.lora is None:
            return flops
        layers = self.model.n_layers
        frozen_head = 2.0 * self.model.head_params
        return (
            flops
            - layers * self.model.layer_flops_per_token(self.seq_len)
            + layers * self.layer_flops_per_token()
            - frozen_head
        )


@dataclass(frozen=True)
class Cluster:
    """Where it is trained: how many GPUs of which kind, and how many share a node (NVLink)."""

    gpus: int
    gpus_per_node: int
    gpu: GpuSpec


@dataclass(frozen=True)
class Assumptions:
    """The few efficiency figures the model cannot derive; all are flags of ``meshpilot plan``."""

    # Fraction of peak bf16 FLOP/s that the large GEMMs and flash attention reach.
    compute_efficiency: float = 0.7
    # Fraction of the line rate that NCCL collectives reach (bus bandwidth / link bandwidth).
    link_efficiency: float = 0.8
    # Fraction of GPU memory kept back for the CUDA context, NCCL buffers and fragmentation.
    memory_reserve: float = 0.1
    # Whether a V schedule (dualpipev, zbv) hides the experts' all-to-all behind the paired
    # chunk's compute, as DeepSeek-V3's DualPipe does. meshpilot's runtime runs the pair one
    # after the other (torch's schedule without an overlapping OVERLAP_F_B), hence off.
    overlap_expert_all_to_all: bool = False
    # Node-limited routing (DeepSeek-V3: each token to experts on at most 4 nodes, sent once per
    # node over the network and forwarded inside it over NVLink); None: a plain all-to-all,
    # every one of a token's k copies sent to its expert's rank, as meshpilot's runtime does.
    expert_routing_nodes: int | None = None


@dataclass(frozen=True)
class Layout:
    """One candidate: a mesh plus how the pipeline and activations are run."""

    mesh: MeshSpec
    schedule: str = "none"  # "none" when pp == 1
    virtual_stages: int = 1
    # Pipeline microbatches with pp > 1; gradient-accumulation microbatches without.
    microbatches: int = 1
    activation_checkpointing: bool = False
    # Expert parallelism (``parallelism.ep``): a gathered layer holds n_experts / ep of its experts.
    ep: int = 1
    # FSDP2's reshard_after_forward ("auto": keep gathered with pp > 1) and host offload of the state.
    reshard_after_forward: str = "auto"
    cpu_offload: bool = False
    # How attention spans the sequence split over cp > 1 ranks (``parallelism.cp_method``).
    cp_method: CpMethod = CpMethod.ALLGATHER

    @property
    def keeps_gathered(self) -> bool:
        """Whether gathered parameters stay between forward and backward (ZeRO-2's memory)."""
        if self.reshard_after_forward == "auto":
            return self.mesh.pp > 1
        return self.reshard_after_forward == "never"

    def describe(self) -> str:
        schedule = self.schedule if self.virtual_stages == 1 else f"{self.schedule} v={self.virtual_stages}"
        ac = "AC on" if self.activation_checkpointing else "AC off"
        zero = "" if self.reshard_after_forward == "auto" else f", reshard_after_forward {self.reshard_after_forward}"
        offload = ", CPU offload" if self.cpu_offload else ""
        experts = f" x ep={self.ep}" if self.ep > 1 else ""
        experts += f" ({self.cp_method} cp)" if self.mesh.cp > 1 else ""
        return f"{self.mesh.describe()}{experts}, {schedule}, {self.microbatches} microbatches, {ac}{zero}{offload}"


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes on the most loaded GPU, by kind."""

    params: float
    grads: float
    optimizer: float
    fsdp_buffers: float
    activations: float
    logits: float
    # Host bytes of the offloaded sharded state (parameters, gradients, optimizer); not in ``total``.
    host: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.fsdp_buffers + self.activations + self.logits

    def as_dict(self) -> dict[str, float]:
        names = ("params", "grads", "optimizer", "fsdp_buffers", "activations", "logits", "total")
        sizes = {f"{name}_gb": round(getattr(self, name) / 1e9, 3) for name in names}
        return sizes | ({"host_gb": round(self.host / 1e9, 3)} if self.host else {})


@dataclass(frozen=True)
class Estimate:
    """Everything the planner ranks and prints about one layout."""

    layout: Layout
    microbatch_size: int
    memory: MemoryEstimate
    usable_memory: float
    bubble: float
    stage_imbalance: float
    compute_s: float
    comm: dict[str, CommCost] = field(default_factory=dict)
    step_s: float = 0.0
    mfu: float = 0.0
    tokens_per_s_per_gpu: float = 0.0

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_memory


# ---------------------------------------------------------------------------- pieces
def layer_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Forward + backward FLOPs of one decoder layer per token (the family's count)."""
    return model.layer_flops_per_token(seq_len)


def chunk_layers(n_layers: int, chunks: int) -> int:
    """Layers in the largest pipeline chunk when ``n_layers`` are spread as evenly as possible."""
    return math.ceil(n_layers / chunks)


def _bottleneck_load(n_layers: int, chunks: int, output_layers: float) -> float:
    """Work of the slowest chunk, in layers, when the last chunk also runs the output projection.

    Layers are whole; the last chunk may take fewer of them to make room for the output (as
    Llama 3 did with its first and last stages).
    """
    if chunks == 1:
        return n_layers + output_layers
    base = math.ceil(n_layers / chunks)
    candidates = sorted(
        {float(k) for k in range(base, base + 2)} | {k + output_layers for k in range(base - 1, base + 1)}
    )
    for load in candidates:
        capacity = (chunks - 1) * math.floor(load) + max(0, math.floor(load - output_layers + 1e-9))
        if capacity >= n_layers:
            return load
    return base + output_layers


# ---------------------------------------------------------------------------- estimate
def estimate(
    workload: Workload, cluster: Cluster, layout: Layout, assumptions: Assumptions = Assumptions()
) -> Estimate:
    """Memory, bubble, communication, step time and MFU of one layout.

    The caller has checked that the layout divides the model and batch; this only prices it.
    """
    model, mesh = workload.model, layout.mesh
    tp, pp, v, m = mesh.tp, mesh.pp, layout.virtual_stages, layout.microbatches
    microbatch_size = BatchPlan.for_mesh(workload.global_batch, dp=mesh.dp, microbatches=m).microbatch_size
    tokens = microbatch_size * workload.seq_len // mesh.cp  # per microbatch and cp rank, before tp splits it
    chunks = pp * v
    layers_per_chunk = chunk_layers(model.n_layers, chunks)
    layers_on_rank = layers_per_chunk * v

    memory, params_on_rank = _memory(workload, layout, layers_per_chunk, layers_on_rank, tokens)
    usable = cluster.gpu.memory_bytes * (1.0 - assumptions.memory_reserve)

    layer_s, output_s = _layer_seconds(workload, cluster, layout, assumptions, tokens)
    tp_link, tp_bytes_layer, tp_layer_s = tp_per_layer(workload, cluster, layout, assumptions, tokens)
    cp_layer_s, cp_comm = context_parallel(workload, cluster, layout, assumptions, tokens, layers_on_rank)
    ep_layer_s, ep_comm = expert_parallel(workload, cluster, layout, assumptions, tokens, layers_on_rank, layer_s)

    pp_link, pp_bw = link(mesh, "pp", cluster, assumptions)
    p2p_bytes = 2 * ACTIVATION_BYTES * tokens * model.dim / tp  # one activation forward, one gradient back
    p2p_s = p2p_bytes / pp_bw if pp > 1 else 0.0

    output_layers = output_s / layer_s
    load = _bottleneck_load(model.n_layers, chunks, output_layers)
    imbalance = load * chunks / (model.n_layers + output_layers)
    layer_s += tp_layer_s + cp_layer_s + ep_layer_s  # the collectives inside a layer are on its critical path
    compute_s, rank_microbatch_s = _compute_seconds(layout, model.n_layers, load, layer_s, output_s, p2p_s)
    bubble = pipeline_bubble(pp, m, v, layout.schedule)
    fsdp_params = _fsdp_peer_params(layout, model, params_on_rank, layers_on_rank)
    dp_costs = _data_parallel(
        mesh,
        cluster,
        assumptions,
        layout,
        params_on_rank,
        fsdp_params,
        rank_microbatch_s,
        layers_on_rank,
        reduced_share=workload.trained_share,
    )
    tp_step_s = tp_layer_s * layers_on_rank * m
    comm = {
        "tp": CommCost(tp_bytes_layer * layers_on_rank * m if tp > 1 else 0.0, tp_link, tp_step_s, tp_step_s),
        "pp": CommCost(p2p_bytes * m * v if pp > 1 else 0.0, pp_link, p2p_s * m * v, p2p_s * m * v),
        **dp_costs,
        **({"cp": cp_comm} if cp_comm is not None else {}),
        **({"ep": ep_comm} if ep_comm is not None else {}),
    }
    step_s = compute_s + sum(cost.exposed_s for cost in dp_costs.values())
    model_flops = workload.flops_per_token() * workload.tokens_per_step
    return Estimate(
        layout=layout,
        microbatch_size=microbatch_size,
        memory=memory,
        usable_memory=usable,
        bubble=bubble,
        stage_imbalance=imbalance,
        compute_s=compute_s,
        comm=comm,
        step_s=step_s,
        mfu=model_flops / (cluster.gpus * cluster.gpu.peak_flops * step_s),
        tokens_per_s_per_gpu=workload.tokens_per_step / (step_s * cluster.gpus),
    )


def _compute_seconds(
    layout: Layout, n_layers: int, load: float, layer_s: float, output_s: float, p2p_s: float
) -> tuple[float, float]:
    """The step's compute time and one microbatch's time on a rank: (step seconds, microbatch seconds).

    ``layer_s`` includes the layer's tensor-parallel collectives. Without a pipeline every
    microbatch runs all layers and the output; with one the slowest chunk (``load`` layers plus its
    send) paces m x v chunk slots and the pp - 1 slots of fill and drain.
    """
    pp, v, m = layout.mesh.pp, layout.virtual_stages, layout.microbatches
    if pp == 1:
        compute_s = m * (n_layers * layer_s + output_s)
        return compute_s, compute_s / m
    chunk_s = load * layer_s + p2p_s
    if layout.schedule in ZERO_BUBBLE_SCHEDULES:  # weight-gradient passes fill part of the bubble
        return m * v * chunk_s / (1.0 - pipeline_bubble(pp, m, v, layout.schedule)), v * chunk_s
    return (m * v + pp - 1) * chunk_s, v * chunk_s


def _layer_seconds(
    workload: Workload, cluster: Cluster, layout: Layout, assumptions: Assumptions, tokens: int
) -> tuple[float, float]:
    """Compute time of one layer and of the output head, per microbatch, on one GPU."""
    model, tp = workload.model, layout.mesh.tp
    flops_rate = cluster.gpu.peak_flops * assumptions.compute_efficiency
    recompute = 4.0 / 3.0 if layout.activation_checkpointing else 1.0
    layer_flops = workload.layer_flops_per_token()
    output_flops = workload.flops_per_token() - model.n_layers * layer_flops
    return layer_flops * recompute * tokens / (tp * flops_rate), output_flops * tokens / (tp * flops_rate)


def _fsdp_peer_params(layout: Layout, model: ModelSpec, params_on_rank: float, layers_on_rank: int) -> float:
    """Parameters a rank receives in one all-gather of its stage (and sends in one reduce-scatter):
    ``(n - 1)/n`` of each FSDP group's unsharded size. What tp splits is sharded over
    ``dp_shard x cp`` (``params_on_rank`` holds its 1/tp); what tp leaves whole (a mixture of
    experts' block: ``tp_whole_params_per_layer``) is sharded over tp too: its router and shared
    experts over ``dp_shard x cp x tp``, its routed experts, ``1 / ep`` of them on the rank, over
    ``dp_shard / ep x cp x tp``."""
    shard, tp, ep = layout.mesh.fsdp_shards, layout.mesh.tp, layout.ep
    block = layers_on_rank * model.tp_whole_params_per_layer / tp
    routed = layers_on_rank * model.expert_params_per_layer / tp
    others, rest = block - routed, params_on_rank - block
    routed_shard = shard // ep * tp
    return (
        (shard - 1) / shard * rest
        + (shard * tp - 1) / (shard * tp) * others * tp
        + (routed_shard - 1) / routed_shard * routed * tp / ep
    )


def _memory(
    workload: Workload, layout: Layout, layers_per_chunk: int, layers_on_rank: int, tokens: int
) -> tuple[MemoryEstimate, float]:
    """Peak memory over the first and the last pipeline rank (embedding vs output + logits)."""
    model, mesh = workload.model, layout.mesh
    tp, pp, shard = mesh.tp, mesh.pp, mesh.fsdp_shards  # FSDP shards over dp_shard x cp
    embedding = model.embedding_params
    output = model.head_params  # the last stage's own: final norm and output projection
    per_token_layer = activation_bytes_per_token(model) / tp
    kept_per_token_layer = ACTIVATION_BYTES * model.dim / tp if layout.activation_checkpointing else per_token_layer
    # FSDP gathers one layer at a time; under expert parallelism only this rank's experts of it;
    # under tp 1/tp of what tp splits, and whole what it does not (the routed experts are part of that).
    not_gathered_experts = (1 - 1 / layout.ep) * model.expert_params_per_layer
    whole = model.tp_whole_params_per_layer - not_gathered_experts
    gathered_layer = (model.params_per_layer - not_gathered_experts - whole) / tp + whole
    # The V schedules put the first and the last stage on rank 0.
    v_shaped = layout.schedule in V_SCHEDULES
    stages = [(0, embedding + (output if pp == 1 or v_shaped else 0))]
    if pp > 1 and not v_shaped:
        stages.append((pp - 1, output))
    cp_kept, cp_working = cp_attention_bytes(workload, layout, tokens)
    worst: MemoryEstimate | None = None
    worst_params = 0.0
    for stage, extra in stages:
        params = (layers_on_rank * model.params_per_layer + extra) / tp
        buffers = fsdp_buffer_bytes(
            layout, layers_on_rank * gathered_layer + extra / tp, gathered_layer, reduced_share=workload.trained_share
        )
        held = in_flight_chunk_microbatches(layout, stage) * layers_per_chunk
        # Kept activations of every layer-microbatch in flight, plus one layer's full working set;
        # context parallel adds the keys and values its method keeps and holds (``cp_attention_bytes``).
        activations = tokens * (held * kept_per_token_layer + per_token_layer) + held * cp_kept + cp_working
        logits = 0.0
        if stage == pp - 1 or v_shaped:
            logit_microbatches = layout.microbatches if layout.schedule == "gpipe" else 1
            logits = logit_microbatches * tokens * model.vocab_size * LOGIT_BYTES / tp
        state = _state_bytes(params, layers_on_rank * workload.adapter_params_per_layer / tp, shard)
        on_gpu = (0.0, 0.0, 0.0) if layout.cpu_offload else state
        estimate_ = MemoryEstimate(
            *on_gpu,
            fsdp_buffers=buffers,
            activations=activations,
            logits=logits,
            host=sum(state) if layout.cpu_offload else 0.0,
        )
        if worst is None or estimate_.total > worst.total:
            worst = estimate_
        worst_params = max(worst_params, params)
    assert worst is not None
    return worst, worst_params


def _state_bytes(params: float, adapters: float, shard: int) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes of a rank's shard of ``params`` model parameters and
    ``adapters`` LoRA parameters: every parameter trains when there are no adapters, else only they do."""
    if not adapters:
        return PARAM_BYTES * params / shard, GRAD_BYTES * params / shard, ADAM_BYTES * params / shard
    return (
        (FROZEN_PARAM_BYTES * params + PARAM_BYTES * adapters) / shard,
        GRAD_BYTES * adapters / shard,
        ADAM_BYTES * adapters / shard,
    )


def _data_parallel(
    mesh: MeshSpec,
    cluster: Cluster,
    assumptions: Assumptions,
    layout: Layout,
    params_on_rank: float,
    fsdp_params: float,
    rank_microbatch_s: float,
    layers_on_rank: int,
    *,
    reduced_share: float = 1.0,
) -> dict[str, CommCost]:
    """FSDP/HSDP traffic and how much of it compute cannot hide.

    Without a pipeline every microbatch all-gathers the parameters twice (forward, and again in
    backward after resharding) and reduce-scatters the gradients, overlapped with that
    microbatch's compute. With a pipeline the stage gathers once during the first microbatch's
    forward and reduces once during the last one's backward. ``reshard_after_forward`` moves
    between the two: ``never`` drops the backward's gather, ``always`` with a pipeline gathers
    twice per microbatch. The first gather and last reduce of a layer cannot overlap anything
    (the ``tail``). ``fsdp_params``: what one gather brings in (``_fsdp_peer_params``);
    ``reduced_share``: the fraction of it whose gradients are reduced (the adapters under LoRA).
    """
    shard, replicas, m = mesh.fsdp_shards, mesh.dp_replicate, layout.microbatches  # dp_shard x cp
    shard_link, shard_bw = link(mesh, "dp_shard", cluster, assumptions)
    repl_link, repl_bw = link(mesh, "dp_replicate", cluster, assumptions)
    gather_bytes = PARAM_BYTES * fsdp_params
    reduce_bytes = REDUCE_BYTES * fsdp_params * reduced_share
    allreduce_bytes = 2 * (replicas - 1) / replicas * REDUCE_BYTES * params_on_rank / shard * reduced_share
    gather_s = gather_bytes / shard_bw if shard > 1 else 0.0
    reduce_s = reduce_bytes / shard_bw if shard > 1 else 0.0
    allreduce_s = allreduce_bytes / repl_bw if replicas > 1 else 0.0
    forward_share = 0.25 if layout.activation_checkpointing else 1.0 / 3.0
    forward_window = forward_share * rank_microbatch_s
    backward_window = rank_microbatch_s - forward_window
    # Resharded after forward (not keeps_gathered): gather again for backward, every microbatch.
    regather_s = 0.0 if layout.keeps_gathered else gather_s
    gather_rounds = 1 if mesh.pp > 1 and layout.keeps_gathered else m
    reduce_rounds = m if mesh.pp == 1 else 1  # a pipeline stage reduces once, after its last microbatch
    rounds = max(gather_rounds, reduce_rounds)
    backward_s = (gather_rounds * regather_s + reduce_rounds * (reduce_s + allreduce_s)) / rounds
    exposed = gather_rounds * max(0.0, gather_s - forward_window) + rounds * max(0.0, backward_s - backward_window)
    exposed += (gather_s + reduce_s + allreduce_s) / max(1, layers_on_rank)
    shard_busy = gather_rounds * (gather_s + regather_s) + reduce_rounds * reduce_s
    gathers = gather_rounds * gather_bytes * (1 if layout.keeps_gathered else 2)
    shard_bytes = gathers + reduce_rounds * reduce_bytes if shard > 1 else 0.0
    repl_busy = reduce_rounds * allreduce_s
    busy = shard_busy + repl_busy
    shard_share = shard_busy / busy if busy else 0.0
    return {
        "dp_shard": CommCost(shard_bytes, shard_link, shard_busy, exposed * shard_share),
        "dp_replicate": CommCost(
            reduce_rounds * allreduce_bytes if replicas > 1 else 0.0,
            repl_link,
            repl_busy,
            exposed * (1.0 - shard_share) if busy else 0.0,
        ),
    }
