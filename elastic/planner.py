"""The parallelism planner: every valid mesh for a model on N GPUs, priced, ranked and explained.

Pure (no ray, no torch): ``meshpilot plan`` runs it on a laptop for 16,384 GPUs in well under a
second, and the elastic scaling policy calls ``best_mesh`` on the driver when capacity changes.

Search, smallest first so whole families are rejected with one reason:

1. ``tp`` over the divisors of N: it must divide the heads, KV heads, FFN width and sequence
   (sequence parallel), and stay inside a node unless ``tp_across_nodes``.
2. ``pp`` over the divisors of N / tp: at least one layer per stage (or equal layers per stage
   with ``even_stages``).
3. ``cp`` (context parallel, powers of two up to ``MAX_CP``) over the divisors of N / (tp·pp)
   whose ``2·cp`` divides the sequence (and ``tp`` the ``seq_len / cp`` tokens a rank holds).
   ``dp = N / (tp·pp·cp)`` must split the global batch, and with a pipeline leave at least ``pp``
   microbatches per data-parallel rank.
4. every ``dp_replicate x dp_shard = dp`` split, every schedule (GPipe, 1F1B, interleaved 1F1B
   with 2..16 virtual stages), activation checkpointing on/off and, for a mixture of experts,
   every expert-parallel degree ``ep`` dividing both ``dp_shard`` and the expert count are priced by
   ``elastic.cost_model.estimate``. Microbatches: with a pipeline, as many as the batch allows
   (one sequence each: the smallest bubble and the least activation memory); without one, the
   fewest gradient-accumulation steps that fit (each costs FSDP another gather).

Rank order is ``MeshSpec``'s (``dp_replicate`` outermost, then ``pp``, ``dp_shard``, ``cp``, ``tp``), so TP
is packed inside a node and PP and DP cross the network; the cost model reads which link each
group uses from ``MeshSpec.stride``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from elastic.cost_model import Assumptions, Cluster, Estimate, Layout, Workload, estimate
from elastic.hardware import GpuSpec
from elastic.plan_explain import Rejection, explain_choice, memory_rejection, merge_families, merge_tp
from elastic.spec import DIM_ORDER, CpMethod, MeshSpec, samples_per_rank, ulysses_heads_problem
from workers.spec import ModelSpec
from workers.spec.pipeline import RULES, PipelineSchedule, microbatches_problem

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
# The search's default: the zero-bubble schedules' near-zero bubble assumes equal forward, input- and
# weight-gradient times (their papers' premise), so they are priced when asked for (--schedule).
SEARCHED_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# The most stages per rank an interleaved schedule is priced with.
MAX_VIRTUAL_STAGES = 16
# Largest context-parallel degree the search tries, and the fewest tokens of a sequence a cp rank
# keeps unless cp is fixed: Llama 3 trained its 128K context on cp=16 (8K tokens per rank) and
# its 8K pretraining without cp; below that, per-rank attention blocks are too small to pay.
MAX_CP = 16
MIN_CP_TOKENS = 8192
# best_mesh tries at most this many world sizes, largest first.
MAX_WORLD_SIZES_TRIED = 64


@dataclass(frozen=True)
class Constraints:
    """What the search may not change or must respect (CLI flags; the elastic policy's limits)."""

    # Degrees that are given, e.g. {"tp": 8, "pp": 16}; keys from DIM_ORDER.
    fixed: Mapping[str, int] = field(default_factory=dict)
    tp_across_nodes: bool = False
    # True: every pipeline stage holds the same number of layers (n_layers % (pp·v) == 0).
    even_stages: bool = False
    min_replicas: int = 1
    schedules: tuple[str, ...] = SEARCHED_SCHEDULES
    activation_checkpointing: tuple[bool, ...] = (False, True)
    # A fixed expert-parallel degree (a mixture of experts only); None: every one that divides.
    ep: int | None = None
    # The context-parallel methods priced for a mesh with cp > 1 (``meshpilot plan --cp-method``).
    cp_methods: tuple[CpMethod, ...] = tuple(CpMethod)


@dataclass(frozen=True)
class Plan:
    """A feasible layout with its estimate and the one-line reasons a user reads."""

    estimate: Estimate
    reasons: tuple[str, ...]

    @property
    def mesh(self) -> MeshSpec:
        return self.estimate.layout.mesh

    @property
    def layout(self) -> Layout:
        return self.estimate.layout


@dataclass
class PlanResult:
    """Everything the search found: feasible plans best first, rejected families, counts."""

    workload: Workload
    cluster: Cluster
    assumptions: Assumptions
    plans: list[Plan]
    rejections: list[Rejection]
    meshes_considered: int
    layouts_priced: int
    elapsed_s: float

    def top(self, k: int) -> list[Plan]:
        """The best ``k`` plans with distinct (tp, pp, cp, ep): the dp split and schedule each at its best."""
        seen: set[tuple[int, int, int, int]] = set()
        chosen = []
        for plan in self.plans:
            key = (plan.mesh.tp, plan.mesh.pp, plan.mesh.cp, plan.layout.ep)
            if key in seen:
                continue
            seen.add(key)
            chosen.append(plan)
            if len(chosen) == k:
                break
        return chosen


# ---------------------------------------------------------------------------- search
def plan_layouts(
    workload: Workload,
    cluster: Cluster,
    *,
    constraints: Constraints = Constraints(),
    assumptions: Assumptions = Assumptions(),
) -> PlanResult:
    """Enumerate, price and rank every layout of ``workload`` on ``cluster``."""
    started = time.perf_counter()
    rejections: list[Rejection] = []
    plans: list[Plan] = []
    considered = priced = 0
    gpus = cluster.gpus
    for tp in _divisors(gpus):
        if not _allowed(constraints, "tp", tp):
            continue
        family = _count_meshes(gpus // tp, constraints)
        considered += family
        problem = tp_problem(workload, cluster, constraints, tp)
        if problem:
            rejections.append(Rejection(f"tp={tp}", problem, "tp", family))
            continue
        families: list[tuple[int, int, str, str, int]] = []  # (pp, dp, kind, reason, meshes)
        for pp, cp in _pp_cp_degrees(workload, constraints, gpus // tp, tp):
            dp = gpus // (tp * pp * cp)
            splits = [s for s in _divisors(dp) if _split_allowed(constraints, dp, s)]
            if not splits:
                continue
            name = f"tp={tp} pp={pp} dp={dp}" + (f" cp={cp}" if cp > 1 else "")
            problem, kind = _family_problem(workload, constraints, tp, pp, dp)
            if problem:
                families.append((pp, dp, kind, problem, len(splits)))
                continue
            best_failure: Estimate | None = None
            for shard in splits:
                mesh = MeshSpec(dp_replicate=dp // shard, dp_shard=shard, tp=tp, pp=pp, cp=cp)
                fitting, closest, count = _price_mesh(workload, cluster, constraints, assumptions, mesh)
                priced += count
                for fits in fitting:
                    plans.append(Plan(fits, explain_choice(workload, cluster, constraints, assumptions, fits)))
                if (
                    not fitting
                    and closest is not None
                    and (best_failure is None or closest.memory.total < best_failure.memory.total)
                ):
                    best_failure = closest
            if best_failure is not None and not any((p.mesh.tp, p.mesh.pp, p.mesh.cp) == (tp, pp, cp) for p in plans):
                rejections.append(memory_rejection(name, best_failure, len(splits)))
        rejections.extend(merge_families(tp, families))
    plans.sort(key=lambda plan: (round(plan.estimate.step_s, 9), plan.estimate.memory.total))
    rejections = merge_tp(rejections)
    return PlanResult(
        workload, cluster, assumptions, plans, rejections, considered, priced, time.perf_counter() - started
    )


def _price_mesh(
    workload: Workload, cluster: Cluster, constraints: Constraints, assumptions: Assumptions, mesh: MeshSpec
) -> tuple[list[Estimate], Estimate | None, int]:
    """The fastest fitting variant of ``mesh`` for each expert-parallel degree (none fitting: an
    empty list), the smallest non-fitting one, and how many were priced."""
    best: dict[int, Estimate] = {}
    smallest: Estimate | None = None
    priced = 0
    settled: set[tuple[bool, int, CpMethod]] = set()  # without a pipeline: (checkpointing, ep, cp method) that fit
    for layout in _variants(workload, constraints, mesh):
        if (layout.activation_checkpointing, layout.ep, layout.cp_method) in settled:
            continue
        result = estimate(workload, cluster, layout, assumptions)
        priced += 1
        if result.fits:
            known = best.get(layout.ep)
            if known is None or (result.step_s, result.memory.total) < (known.step_s, known.memory.total):
                best[layout.ep] = result
            if mesh.pp == 1:
                # Gradient-accumulation steps are tried fewest first; more would only add gathers.
                settled.add((layout.activation_checkpointing, layout.ep, layout.cp_method))
        elif smallest is None or result.memory.total < smallest.memory.total:
            smallest = result
    return list(best.values()), smallest, priced


def _variants(workload: Workload, constraints: Constraints, mesh: MeshSpec) -> Iterator[Layout]:
    """Schedules x virtual stages x activation checkpointing x microbatches x ep x cp method worth pricing."""
    methods = cp_methods(workload.model, mesh, constraints.cp_methods)
    for layout in _schedule_variants(workload, constraints, mesh):
        for ep in expert_degrees(workload.model, mesh, constraints.ep):
            for method in methods:
                yield dataclasses.replace(layout, ep=ep, cp_method=method)


def cp_methods(model: ModelSpec, mesh: MeshSpec, allowed: Sequence[CpMethod] = tuple(CpMethod)) -> list[CpMethod]:
    """The ``allowed`` context-parallel methods ``mesh`` can run ``model`` with: all but Ulysses
    when its heads do not split over cp (``ulysses_heads_problem``); only ``allgather`` (what a
    run without cp is priced as) when cp = 1."""
    if mesh.cp == 1:
        return [CpMethod.ALLGATHER]
    heads_split = ulysses_heads_problem(n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, tp=mesh.tp, cp=mesh.cp)
    return [method for method in allowed if method is not CpMethod.ULYSSES or heads_split is None]


def pick_cp_method(
    workload: Workload, cluster: Cluster, layout: Layout, assumptions: Assumptions = Assumptions()
) -> CpMethod:
    """The planner's context-parallel method for ``layout`` (``parallelism.cp_method: auto``): of
    the methods the model's heads allow, the fastest step among those that fit in memory (all of
    them when none fits), ties to the one holding less; ``allgather`` when cp = 1."""
    priced = [
        estimate(workload, cluster, dataclasses.replace(layout, cp_method=method), assumptions)
        for method in cp_methods(workload.model, layout.mesh)
    ]
    candidates = [result for result in priced if result.fits] or priced
    best = min(candidates, key=lambda result: (round(result.step_s, 9), result.memory.total))
    return best.layout.cp_method


def expert_degrees(model: ModelSpec, mesh: MeshSpec, fixed: int | None = None) -> list[int]:
    """The expert-parallel degrees ``mesh`` can run ``model`` with: the divisors of ``dp_shard``
    that split its routed experts evenly (1 alone without experts; only ``fixed`` when given)."""
    degrees = [ep for ep in _divisors(mesh.dp_shard) if model.splits_experts(ep)]
    return [ep for ep in degrees if ep == fixed] if fixed is not None else degrees


def _schedule_variants(workload: Workload, constraints: Constraints, mesh: MeshSpec) -> Iterator[Layout]:
    """Schedules x virtual stages x activation checkpointing x microbatches worth pricing."""
    model = workload.model
    per_rank = samples_per_rank(workload.global_batch, mesh.dp)
    for checkpointing in constraints.activation_checkpointing:
        if mesh.pp == 1:
            for microbatch_count in _divisors(per_rank):
                yield Layout(mesh, "none", 1, microbatch_count, checkpointing)
            continue
        for schedule in constraints.schedules:
            microbatches = _pipeline_microbatches(per_rank, mesh.pp, schedule)
            if microbatches is None:
                continue
            for virtual in stage_counts(schedule):
                problems = mesh.check_divides(
                    n_heads=model.n_heads,
                    n_kv_heads=model.n_kv_heads,
                    n_layers=model.n_layers,
                    ffn_dim=model.tp_split_ffn_dim,
                    global_batch=workload.global_batch,
                    microbatches=microbatches,
                    seq_len=workload.seq_len,
                    stages_per_rank=virtual,
                    even_stages=constraints.even_stages,
                )
                if problems:
                    continue
                yield Layout(mesh, schedule, virtual, microbatches, checkpointing)


def stage_counts(schedule: str) -> Sequence[int]:
    """The stages per rank a schedule is priced with: 2..16 interleaved, 2 for the V schedules."""
    rules = RULES[PipelineSchedule(schedule)]
    if rules.exact:
        return (rules.min_stages_per_rank,)
    return range(rules.min_stages_per_rank, MAX_VIRTUAL_STAGES + 1)


def _pipeline_microbatches(per_rank: int, pp: int, schedule: str) -> int | None:
    """The most microbatches the rank's batch splits into that the schedule takes (torch's rules:
    >= pp; a multiple of pp when interleaved; >= 2 pp for dualpipev)."""
    stages_per_rank = RULES[PipelineSchedule(schedule)].default_stages_per_rank
    for microbatches in sorted(_divisors(per_rank), reverse=True):
        if microbatches < pp:
            return None
        if microbatches_problem(schedule, pp=pp, stages_per_rank=stages_per_rank, microbatches=microbatches) is None:
            return microbatches
    return None


# ---------------------------------------------------------------------------- rules
def tp_problem(workload: Workload, cluster: Cluster, constraints: Constraints, tp: int) -> str | None:
    model = workload.model
    problems = MeshSpec(tp=tp).check_divides(
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads,
        n_layers=model.n_layers,
        ffn_dim=model.tp_split_ffn_dim,
        global_batch=1,
        microbatches=1,
        seq_len=workload.seq_len,
    )
    if problems:
        return "; ".join(problems)
    if tp > cluster.gpus_per_node and not constraints.tp_across_nodes:
        nodes = -(-tp // cluster.gpus_per_node)
        return (
            f"spans {nodes} nodes of {cluster.gpus_per_node} GPUs; tensor parallel stays inside a node "
            "(NVLink) unless --tp-across-nodes"
        )
    return None


def _family_problem(workload: Workload, constraints: Constraints, tp: int, pp: int, dp: int) -> tuple[str | None, str]:
    model = workload.model
    mesh = MeshSpec(dp_shard=dp, tp=tp, pp=pp)
    stage_problems = mesh.check_divides(
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads,
        n_layers=model.n_layers,
        ffn_dim=model.tp_split_ffn_dim,
        global_batch=dp,
        microbatches=1,
        seq_len=workload.seq_len,
        even_stages=constraints.even_stages,
    )
    if stage_problems:
        if constraints.even_stages:
            return (f"pp (x virtual stages) must divide model.n_layers={model.n_layers} (--even-stages)"), "pp"
        return f"more pipeline stages than model.n_layers={model.n_layers}", "pp"
    if workload.global_batch % dp:
        return (
            f"dp must divide the global batch of {workload.global_batch} sequences "
            "(every data-parallel rank takes an equal share)"
        ), "batch"
    per_rank = samples_per_rank(workload.global_batch, dp)
    if pp > 1 and per_rank < pp:
        return (
            "fewer sequences per data-parallel rank than pipeline stages, so some stage idles; "
            "raise --global-batch or give dp fewer GPUs"
        ), "batch"
    return None, ""


def _pp_cp_degrees(workload: Workload, constraints: Constraints, remaining: int, tp: int) -> Iterator[tuple[int, int]]:
    """(pp, cp) pairs to try on ``remaining = N / tp`` GPUs: cp a power of two up to ``MAX_CP``
    (or the fixed one) whose ``2·cp`` chunks divide the sequence and leave tp whole tokens, and,
    unless cp is fixed, at least ``MIN_CP_TOKENS`` tokens per cp rank."""
    seq_len = workload.seq_len
    for pp in _divisors(remaining):
        if not _allowed(constraints, "pp", pp):
            continue
        cp = 1
        while cp <= max(MAX_CP, constraints.fixed.get("cp", 1)) and (remaining // pp) % cp == 0:
            long_enough = "cp" in constraints.fixed or seq_len // cp >= MIN_CP_TOKENS
            fits_sequence = cp == 1 or (seq_len % (2 * cp) == 0 and (seq_len // cp) % tp == 0 and long_enough)
            if fits_sequence and _allowed(constraints, "cp", cp):
                yield pp, cp
            cp *= 2


def _divisors(n: int) -> list[int]:
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def _allowed(constraints: Constraints, dim: str, degree: int) -> bool:
    fixed = constraints.fixed.get(dim)
    return fixed is None or fixed == degree


def _split_allowed(constraints: Constraints, dp: int, shard: int) -> bool:
    replicas = dp // shard
    return (
        _allowed(constraints, "dp_shard", shard)
        and _allowed(constraints, "dp_replicate", replicas)
        and replicas >= constraints.min_replicas
    )


def _count_meshes(remaining: int, constraints: Constraints) -> int:
    """(pp, dp_shard, dp_replicate) choices multiplying to ``remaining`` that the constraints allow."""
    count = 0
    for pp in _divisors(remaining):
        if not _allowed(constraints, "pp", pp):
            continue
        dp = remaining // pp
        count += sum(1 for shard in _divisors(dp) if _split_allowed(constraints, dp, shard))
    return count


# ---------------------------------------------------------------------------- elastic entry point
def best_plan(
    model: ModelSpec,
    *,
    available_ranks: int,
    gpus_per_node: int,
    hardware: GpuSpec,
    global_batch: int,
    seq_len: int,
    fixed: Mapping[str, int] | None = None,
    min_replicas: int = 1,
    even_stages: bool = True,
    assumptions: Assumptions = Assumptions(),
) -> Estimate | None:
    """The fastest feasible layout using as many of ``available_ranks`` as possible; see ``best_mesh``."""
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(DIM_ORDER))
    if unknown:
        raise ValueError(f"fixed degrees {unknown} are not mesh dimensions; use {', '.join(DIM_ORDER)}")
    unit = 1
    for degree in fixed.values():
        unit *= degree
    if not fixed and available_ranks >= gpus_per_node:
        unit = gpus_per_node  # nothing pinned: whole nodes
    constraints = Constraints(fixed=fixed, min_replicas=min_replicas, even_stages=even_stages)
    workload = Workload(model, seq_len, global_batch)
    tried = 0
    for world_size in range(available_ranks - available_ranks % unit, 0, -unit):
        if tried == MAX_WORLD_SIZES_TRIED:
            break
        tried += 1
        cluster = Cluster(world_size, min(gpus_per_node, world_size), hardware)
        result = plan_layouts(workload, cluster, constraints=constraints, assumptions=assumptions)
        if result.plans:
            return result.plans[0].estimate
    return None


def best_mesh(
    model: ModelSpec,
    *,
    available_ranks: int,
    gpus_per_node: int,
    hardware: GpuSpec,
    global_batch: int,
    seq_len: int,
    fixed: Mapping[str, int] | None = None,
    min_replicas: int = 1,
    even_stages: bool = True,
    assumptions: Assumptions = Assumptions(),
) -> MeshSpec | None:
    """The mesh the elastic scaling policy should run on ``available_ranks`` ranks, or None.

    Runs on the driver (pure: no Ray, no torch); the policy calls it when capacity changes.

    * ``available_ranks``: ranks (GPUs) the job may use now. The result may use fewer: world
      sizes are tried from ``available_ranks`` downwards in steps of the product of the fixed
      degrees (of ``gpus_per_node`` when nothing is fixed), at most 64 sizes, and the first
      size with any feasible layout wins with its fastest layout, because more ranks train
      faster whenever a layout fits.
    * ``fixed``: degrees that may not change, e.g. ``{"tp": 2, "pp": 2, "dp_shard": 2}`` for
      an in-place shrink or grow, where only ``dp_replicate`` (whole replica groups) changes
      and the surviving shards stay where they are. Keys are ``MeshSpec`` field names.
    * ``global_batch`` (sequences) and ``seq_len`` stay as configured: the mesh must split the
      global batch evenly (``MeshSpec.check_divides``), so a shrink keeps the same batch.
    * ``min_replicas``: fewest ``dp_replicate`` groups acceptable (the config's
      ``elastic.min_replicas``).
    * ``even_stages``: True (the default) keeps to meshes whose pipeline stages hold equal
      numbers of layers, which is what meshpilot's trainer builds (``workers.parallelize``).

    Returns None when no world size up to ``available_ranks`` has a layout that divides the
    model and batch and fits in ``hardware``'s memory; the policy then fails or waits.
    """
    chosen = best_plan(
        model,
        available_ranks=available_ranks,
        gpus_per_node=gpus_per_node,
        hardware=hardware,
        global_batch=global_batch,
        seq_len=seq_len,
        fixed=fixed,
        min_replicas=min_replicas,
        even_stages=even_stages,
        assumptions=assumptions,
    )
    return chosen.layout.mesh if chosen is not None else None
