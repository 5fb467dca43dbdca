"""``meshpilot plan`` (and, through ``orchestrator.cli.simulate``, ``meshpilot simulate``).

Runs on the driver or a laptop; no cluster, no torch. Example:

    meshpilot plan --model llama3-405b --gpus 16384 --seq-len 8192 --global-batch 2048

prints the best layouts with the reasons they win, then every rejected family of layouts with
the reason, one line each. ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from elastic.cost_model import Assumptions, Cluster, Estimate, Layout, Workload, estimate
from elastic.hardware import GPU_KINDS, GpuSpec, gpu_spec
from elastic.plan_check import check_layout
from elastic.plan_explain import format_gb
from elastic.planner import (
    PIPELINE_SCHEDULES,
    SEARCHED_SCHEDULES,
    Constraints,
    Plan,
    PlanResult,
    cp_methods,
    plan_layouts,
)
from elastic.spec import CpMethod
from orchestrator.errors import UserError
from workers.spec import PRESETS, ModelSpec
from workers.spec.lora import DEFAULT_TARGETS, LoraSpec

DEFAULT_SEQ_LEN = 8192
# Llama 3 405B's batch: 2,048 sequences of 8,192 tokens = 16M tokens per step.
DEFAULT_GLOBAL_BATCH = 2048
CP_METHOD_NAMES = tuple(method.value for method in CpMethod)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="choose a mesh for N GPUs: memory, bubble, communication, step time, MFU",
        description="Enumerate every (dp_replicate, dp_shard, cp, tp, pp) mesh, schedule and activation "
        "checkpointing choice for a model on N GPUs; print the best with reasons and the "
        "rejected with why. No cluster needed.",
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="PRESET|CONFIG.yaml",
        help=f"a preset ({', '.join(PRESETS)}) or a job config whose model section is used",
    )
    parser.add_argument("--gpus", required=True, type=int, help="GPUs to plan for")
    add_hardware_flags(parser)
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help=f"tokens per sequence (default: the config's, else {DEFAULT_SEQ_LEN} or the model's max)",
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help=f"sequences per optimizer step (default: the config's, else {DEFAULT_GLOBAL_BATCH})",
    )
    parser.add_argument("--top", type=int, default=5, help="how many layouts to show (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    _add_search_flags(parser)
    _add_assumption_flags(parser)
    parser.set_defaults(handler=run_plan)

    from orchestrator.cli import simulate as simulate_cli

    simulate_cli.register(subparsers)


def _add_search_flags(parser: argparse.ArgumentParser) -> None:
    """What the search may choose: fixed degrees, replica floor, tp placement, stages, schedules."""
    for dim in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):
        parser.add_argument(
            f"--{dim.replace('_', '-')}", type=int, default=None, dest=dim, help=f"fix {dim} to this degree"
        )
    parser.add_argument(
        "--cp-method",
        choices=(*CP_METHOD_NAMES, "all"),
        default="all",
        help="how attention spans a sequence split over cp > 1 ranks: price only this method, or all "
        "(default: the fastest per layout, and a comparison of the three for the best layout with cp > 1)",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=None,
        help="fix the expert-parallel degree of a mixture of experts (default: every one dividing dp_shard)",
    )
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="fewest dp_replicate groups (each can be dropped in place on a failure)",
    )
    parser.add_argument("--tp-across-nodes", action="store_true", help="let tensor parallel span nodes")
    parser.add_argument(
        "--even-stages",
        action="store_true",
        help="require equal layers per pipeline stage (n_layers divisible by pp x virtual stages)",
    )
    parser.add_argument(
        "--schedule",
        action="append",
        choices=PIPELINE_SCHEDULES,
        default=None,
        help="pipeline schedules to consider (repeat; default gpipe, 1f1b and interleaved_1f1b)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: whichever fits and is faster",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="price LoRA fine-tuning: adapters of this rank train, the base is frozen (default: the config's "
        "model.lora, else full training)",
    )
    parser.add_argument(
        "--lora-targets",
        default=None,
        metavar="NAMES",
        help=f"comma-separated layers that get adapters (default {','.join(DEFAULT_TARGETS)})",
    )


def _add_assumption_flags(parser: argparse.ArgumentParser) -> None:
    """The cost model's efficiency and memory-reserve fractions (defaults: ``Assumptions``)."""
    parser.add_argument(
        "--compute-efficiency",
        type=float,
        default=Assumptions.compute_efficiency,
        help="fraction of peak bf16 FLOP/s the kernels reach (default %(default)s)",
    )
    parser.add_argument(
        "--link-efficiency",
        type=float,
        default=Assumptions.link_efficiency,
        help="fraction of link bandwidth collectives reach (default %(default)s)",
    )
    parser.add_argument(
        "--memory-reserve",
        type=float,
        default=Assumptions.memory_reserve,
        help="fraction of GPU memory kept free for CUDA context, NCCL, fragmentation (default %(default)s)",
    )
    parser.add_argument(
        "--overlap-expert-all-to-all",
        action="store_true",
        help="price zbv/dualpipev as hiding the experts' all-to-all behind the paired chunk's compute, as "
        "DeepSeek-V3's DualPipe does (meshpilot's runtime does not overlap them yet)",
    )
    parser.add_argument(
        "--expert-routing-nodes",
        type=int,
        default=None,
        help="node-limited routing: each token reaches experts on at most this many nodes, sent once per "
        "node (DeepSeek-V3: 4; default: a plain all-to-all, as meshpilot runs)",
    )


def add_hardware_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu",
        default="h100-80g",
        choices=sorted(GPU_KINDS),
        help="GPU kind (default h100-80g); the flags below override its figures",
    )
    parser.add_argument("--gpu-memory-gb", type=float, default=None, help="memory per GPU, GB")
    parser.add_argument("--gpu-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s per GPU")
    parser.add_argument(
        "--nvlink-gb-per-s", type=float, default=None, help="NVLink bandwidth per GPU, one direction, GB/s"
    )
    parser.add_argument(
        "--network-gbit-per-s", type=float, default=None, help="network bandwidth per GPU between nodes, Gbit/s"
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink in a node (default 8)")


def hardware_from_args(args: argparse.Namespace) -> GpuSpec:
    spec = gpu_spec(
        args.gpu,
        memory_gb=args.gpu_memory_gb,
        bf16_tflops=args.gpu_tflops,
        nvlink_gb_per_s=args.nvlink_gb_per_s,
        network_gbit_per_s=args.network_gbit_per_s,
    )
    problems = spec.problems()
    if problems:
        raise UserError("; ".join(problems))
    return spec


@dataclass(frozen=True)
class ModelSource:
    """The model to plan for and, when it came from a job config, that config's own choices."""

    name: str
    model: ModelSpec
    seq_len: int | None = None
    global_batch: int | None = None
    layout: Layout | None = None
    lora: LoraSpec | None = None


def load_model(reference: str) -> ModelSource:
    """A preset name, or a job config path whose model, training and parallelism sections are read."""
    if reference in PRESETS:
        return ModelSource(reference, PRESETS[reference])
    path = Path(reference)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        from orchestrator.config import load_config

        # Only the model, training and parallelism sections matter here; the data file need not exist.
        config = load_config(path, overrides=["data.source=synthetic"])
        from orchestrator.driver.train_spec import configured_layout

        method = config.parallelism.cp_method
        layout = configured_layout(config, CpMethod.ALLGATHER if method == "auto" else CpMethod(method))
        return ModelSource(
            f"{config.name} ({path})",
            config.model_spec,
            config.training.seq_len,
            config.training.global_batch,
            layout,
            lora=config.model.lora.spec() if config.model.lora is not None else None,
        )
    raise UserError(
        f"--model {reference!r} is neither a preset ({', '.join(PRESETS)}) nor a YAML job config; "
        "pass a preset name or the path of a config file"
    )


def run_plan(args: argparse.Namespace) -> int:
    source = load_model(args.model)
    workload, cluster, constraints, assumptions = _inputs(args, source.model, source.seq_len, source.global_batch)
    workload = dataclasses.replace(workload, lora=_lora(args, source))
    result = plan_layouts(workload, cluster, constraints=constraints, assumptions=assumptions)
    shown = result.top(args.top)
    configured = _configured(source, result, constraints, assumptions)
    if args.json:
        document = plan_json(source.name, result, shown)
        document["config_layout"] = configured
        document["cp_methods"] = [_comparison_dict(row) for row in cp_comparison(result, shown)]
        document["lora"] = _lora_summary(workload)
        print(json.dumps(document, indent=2))
    else:
        if workload.lora is not None:
            trainable = workload.model.n_layers * workload.adapter_params_per_layer
            print(
                f"LoRA rank {workload.lora.rank} on {', '.join(workload.lora.target_modules)}: "
                f"{trainable:,} trainable parameters ({trainable / workload.model.num_params:.3%} of the "
                "model); the base is frozen (no gradients, no optimizer state)"
            )
        print(format_plan(source.name, result, shown))
        comparison = cp_comparison(result, shown)
        if comparison:
            print(format_cp_comparison(comparison))
        if configured is not None:
            print(f"the config's layout ({configured['layout']}): {configured['verdict']}")
    if not result.plans:
        raise UserError(_no_layout_message(source.name, result))
    return 0


def _configured(
    source: ModelSource, result: PlanResult, constraints: Constraints, assumptions: Assumptions
) -> dict[str, object] | None:
    """How the config's own parallelism section fares on the planned cluster."""
    if source.layout is None:
        return None
    layout = source.layout
    if layout.mesh.world_size != result.cluster.gpus:
        verdict = f"not comparable: it uses {layout.mesh.world_size} ranks, the plan {result.cluster.gpus} GPUs"
        return {"layout": layout.describe(), "feasible": False, "verdict": verdict}
    estimate_, problems = check_layout(
        result.workload, result.cluster, layout, constraints=constraints, assumptions=assumptions
    )
    if problems or estimate_ is None:
        return {"layout": layout.describe(), "feasible": False, "verdict": "rejected: " + "; ".join(problems)}
    faster = sum(1 for plan in result.plans if plan.estimate.step_s < estimate_.step_s)
    bubble = f", pipeline bubble {estimate_.bubble:.1%}" if layout.mesh.pp > 1 else ""
    verdict = (
        f"fits {format_gb(estimate_.memory.total)} GB, step {_seconds(estimate_.step_s)} s, MFU {estimate_.mfu:.1%}"
        f"{bubble}; {faster} feasible layout{'s' if faster != 1 else ''} would be faster"
    )
    return {
        "layout": layout.describe(),
        "feasible": True,
        "step_s": round(estimate_.step_s, 6),
        "mfu": round(estimate_.mfu, 4),
        "faster_layouts": faster,
        "verdict": verdict,
    }


def _lora_summary(workload: Workload) -> dict[str, object] | None:
    if workload.lora is None:
        return None
    trainable = workload.model.n_layers * workload.adapter_params_per_layer
    return {
        **dataclasses.asdict(workload.lora),
        "trainable_params": trainable,
        "trainable_share": round(trainable / workload.model.num_params, 6),
    }


def _lora(args: argparse.Namespace, source: ModelSource) -> LoraSpec | None:
    """The adapters priced: ``--lora-rank``/``--lora-targets``, else the config's ``model.lora``."""
    if args.lora_rank is None and args.lora_targets is None:
        return source.lora
    base = source.lora or LoraSpec()
    rank = base.rank if args.lora_rank is None else args.lora_rank
    if rank < 1:
        raise UserError(f"--lora-rank={rank} must be >= 1")
    targets = base.target_modules
    if args.lora_targets is not None:
        targets = tuple(name.strip() for name in args.lora_targets.split(",") if name.strip())
        known = source.model.adapter_linear_shapes()
        unknown = [name for name in targets if name not in known]
        if unknown or not targets:
            raise UserError(
                f"--lora-targets={args.lora_targets!r}: {', '.join(unknown) or 'no name'} is not a layer of this "
                f"model that takes an adapter; name some of {', '.join(known)}"
            )
    return dataclasses.replace(
        base, rank=rank, alpha=2.0 * rank if args.lora_rank is not None else base.alpha, target_modules=targets
    )


def _inputs(
    args: argparse.Namespace, model: ModelSpec, config_seq_len: int | None, config_batch: int | None
) -> tuple[Workload, Cluster, Constraints, Assumptions]:
    if args.gpus < 1:
        raise UserError(f"--gpus={args.gpus} must be >= 1")
    if args.gpus_per_node < 1:
        raise UserError(f"--gpus-per-node={args.gpus_per_node} must be >= 1")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise UserError(
            f"--gpus={args.gpus} is not a multiple of --gpus-per-node={args.gpus_per_node}; "
            "plan whole nodes, or set --gpus-per-node"
        )
    seq_len = args.seq_len or config_seq_len or min(DEFAULT_SEQ_LEN, model.max_seq_len)
    global_batch = args.global_batch or config_batch or DEFAULT_GLOBAL_BATCH
    for flag, value in (
        ("--seq-len", seq_len),
        ("--global-batch", global_batch),
        ("--top", args.top),
        ("--min-replicas", args.min_replicas),
    ):
        if value < 1:
            raise UserError(f"{flag}={value} must be >= 1")
    if seq_len > model.max_seq_len:
        raise UserError(f"--seq-len={seq_len} exceeds the model's max_seq_len={model.max_seq_len}")
    fixed = {}
    for dim in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):
        value = getattr(args, dim)
        if value is not None:
            if value < 1:
                raise UserError(f"--{dim.replace('_', '-')}={value} must be >= 1")
            fixed[dim] = value
    product = 1
    for value in fixed.values():
        product *= value
    if args.gpus % product:
        named = ", ".join(f"--{dim.replace('_', '-')}={value}" for dim, value in fixed.items())
        raise UserError(f"the fixed degrees ({named}) multiply to {product}, which does not divide --gpus={args.gpus}")
    checkpointing = {"auto": (False, True), "on": (True,), "off": (False,)}[args.activation_checkpointing]
    constraints = Constraints(
        fixed=fixed,
        tp_across_nodes=args.tp_across_nodes,
        even_stages=args.even_stages,
        min_replicas=args.min_replicas,
        schedules=tuple(args.schedule) if args.schedule else SEARCHED_SCHEDULES,
        activation_checkpointing=checkpointing,
        ep=args.ep,
        cp_methods=tuple(CpMethod) if args.cp_method == "all" else (CpMethod(args.cp_method),),
    )
    _check_expert_flags(args, model)
    assumptions = _assumptions(args)
    cluster = Cluster(args.gpus, min(args.gpus_per_node, args.gpus), hardware_from_args(args))
    return Workload(model, seq_len, global_batch), cluster, constraints, assumptions


def _assumptions(args: argparse.Namespace) -> Assumptions:
    for flag, value in (("--compute-efficiency", args.compute_efficiency), ("--link-efficiency", args.link_efficiency)):
        if not 0 < value <= 1:
            raise UserError(f"{flag}={value} must lie in (0, 1]")
    if not 0 <= args.memory_reserve < 1:
        raise UserError(f"--memory-reserve={args.memory_reserve} must lie in [0, 1)")
    return Assumptions(
        compute_efficiency=args.compute_efficiency,
        link_efficiency=args.link_efficiency,
        memory_reserve=args.memory_reserve,
        overlap_expert_all_to_all=args.overlap_expert_all_to_all,
        expert_routing_nodes=args.expert_routing_nodes,
    )


def _check_expert_flags(args: argparse.Namespace, model: ModelSpec) -> None:
    for flag, value in (("--ep", args.ep), ("--expert-routing-nodes", args.expert_routing_nodes)):
        if value is not None and value < 1:
            raise UserError(f"{flag}={value} must be >= 1")
    problem = model.expert_parallel_problem(args.ep, "--ep") if args.ep is not None else None
    if problem:
        raise UserError(problem)


def _no_layout_message(name: str, result: PlanResult) -> str:
    cluster = result.cluster
    where = f"{cluster.gpus} x {cluster.gpu.name}"
    memory = [r for r in result.rejections if r.kind == "memory" and r.needs_gb is not None]
    if memory:
        closest = min(memory, key=lambda r: r.needs_gb or 0.0)
        assert closest.needs_gb is not None  # memory holds only rejections that carry a figure
        usable = cluster.gpu.memory_gb * (1 - result.assumptions.memory_reserve)
        return (
            f"no layout of {name} fits on {where}: the smallest ({closest.layout}) needs "
            f"{format_gb(closest.needs_gb * 1e9)} GB per GPU > {format_gb(usable * 1e9)} GB usable; "
            "use more GPUs or GPUs with more memory"
        )
    if not result.rejections:
        return f"no layout of {name} on {where} satisfies the fixed degrees and --min-replicas; relax them"
    return (
        f"no layout of {name} divides onto {where} (see the rejected families above); "
        "change --gpus, --global-batch or --seq-len"
    )


# ---------------------------------------------------------------------------- output
def config_snippet(plan: Plan) -> dict[str, object]:
    """The job config's parallelism section that runs this plan."""
    layout = plan.layout
    section: dict[str, object] = dict(layout.mesh.as_dict())
    if layout.mesh.cp == 1:
        del section["cp"]  # the config's default; a snippet names only what it sets
    if layout.mesh.pp > 1:
        section["pp_schedule"] = layout.schedule
        if layout.virtual_stages > 1:
            section["stages_per_rank"] = layout.virtual_stages
    if layout.mesh.cp > 1:
        section["cp_method"] = str(layout.cp_method)
    if layout.ep > 1:
        section["ep"] = layout.ep
    section["microbatches"] = layout.microbatches
    section["activation_checkpointing"] = layout.activation_checkpointing
    return section


def plan_json(name: str, result: PlanResult, shown: list[Plan]) -> dict[str, object]:
    workload, cluster, assumptions = result.workload, result.cluster, result.assumptions
    return {
        "model": {"name": name, "num_params": workload.model.num_params},
        "gpus": cluster.gpus,
        "gpus_per_node": cluster.gpus_per_node,
        "gpu": {
            "name": cluster.gpu.name,
            "memory_gb": cluster.gpu.memory_gb,
            "bf16_tflops": cluster.gpu.bf16_tflops,
            "nvlink_gb_per_s": cluster.gpu.nvlink_gb_per_s,
            "network_gbit_per_s": cluster.gpu.network_gbit_per_s,
        },
        "seq_len": workload.seq_len,
        "global_batch": workload.global_batch,
        "tokens_per_step": workload.tokens_per_step,
        "assumptions": {
            "compute_efficiency": assumptions.compute_efficiency,
            "link_efficiency": assumptions.link_efficiency,
            "memory_reserve": assumptions.memory_reserve,
            "overlap_expert_all_to_all": assumptions.overlap_expert_all_to_all,
            "expert_routing_nodes": assumptions.expert_routing_nodes,
        },
        "plans": [_plan_dict(rank, plan) for rank, plan in enumerate(shown, start=1)],
        "feasible": len(result.plans),
        "rejected": [rejection.as_dict() for rejection in result.rejections],
        "meshes_considered": result.meshes_considered,
        "layouts_priced": result.layouts_priced,
        "elapsed_s": round(result.elapsed_s, 4),
    }


def _plan_dict(rank: int, plan: Plan) -> dict[str, object]:
    estimate: Estimate = plan.estimate
    return {
        "rank": rank,
        "mesh": plan.mesh.as_dict(),
        "parallelism": config_snippet(plan),
        "microbatch_size": estimate.microbatch_size,
        "memory": {**estimate.memory.as_dict(), "usable_gb": round(estimate.usable_memory / 1e9, 3)},
        "bubble": round(estimate.bubble, 4),
        "stage_imbalance": round(estimate.stage_imbalance, 4),
        "comm": {dim: cost.as_dict() for dim, cost in estimate.comm.items()},
        "step_s": round(estimate.step_s, 4),
        "mfu": round(estimate.mfu, 4),
        "tokens_per_s_per_gpu": round(estimate.tokens_per_s_per_gpu, 1),
        "reasons": list(plan.reasons),
    }


def format_plan(name: str, result: PlanResult, shown: list[Plan]) -> str:
    workload, cluster, assumptions = result.workload, result.cluster, result.assumptions
    lines = [
        f"meshpilot plan: {name} ({_count(workload.model.num_params)} parameters) on {cluster.gpus} x "
        f"{cluster.gpu.describe()}, {cluster.gpus_per_node} GPUs per node",
        f"workload: seq_len {workload.seq_len}, global batch {workload.global_batch} sequences = "
        f"{_count(workload.tokens_per_step)} tokens per step",
        f"searched {result.meshes_considered} meshes ({result.layouts_priced} layouts priced) in "
        f"{result.elapsed_s:.2f} s: {len(result.plans)} feasible, {len(result.rejections)} families rejected",
        "",
    ]
    if shown:
        lines.append("best layouts (fastest first; one per tp x pp x cp x ep, its best dp split and schedule):")
        lines.append(
            f"  {'#':>2} {'dp_rep':>6} {'dp_shard':>8} {'tp':>3} {'pp':>4}  {'schedule':<22} "
            f"{'micro':>5} {'AC':>3} {'GB/GPU':>7} {'step s':>7} {'MFU':>6} {'tok/s/GPU':>9} {'bubble':>6}"
        )
        for rank, plan in enumerate(shown, start=1):
            lines.extend(_plan_lines(rank, plan))
        lines.append("")
    lines.append("rejected (one line per family of layouts):")
    lines.extend(f"  {rejection.line()}" for rejection in result.rejections)
    if not result.rejections:
        lines.append("  none")
    lines.append("")
    lines.append(
        f"assumptions: kernels reach {assumptions.compute_efficiency:.0%} of peak, collectives "
        f"{assumptions.link_efficiency:.0%} of link bandwidth, {assumptions.memory_reserve:.0%} of memory "
        "kept free; bf16 with fp32 Adam state (16 bytes/parameter), FSDP2 full shard within dp_shard"
    )
    return "\n".join(lines)


def cp_comparison(result: PlanResult, shown: list[Plan]) -> list[Estimate]:
    """The best shown layout with cp > 1 priced under each context-parallel method its heads
    allow (all of them, whatever --cp-method restricted the search to: this is the comparison);
    empty when no shown layout splits sequences."""
    split = [plan for plan in shown if plan.mesh.cp > 1]
    if not split:
        return []
    layout = split[0].layout
    return [
        estimate(result.workload, result.cluster, dataclasses.replace(layout, cp_method=method), result.assumptions)
        for method in cp_methods(result.workload.model, layout.mesh)
    ]


def format_cp_comparison(rows: list[Estimate]) -> str:
    """One line per method: step time, memory per GPU, and what cp moves and how much of it waits."""
    lines = [
        f"context parallel methods for layout 1 with cp > 1 ({rows[0].layout.mesh.describe()}), per GPU and step:",
        f"  {'method':<10} {'step s':>7} {'GB/GPU':>7} {'activ GB':>8} {'cp GB':>7} {'cp busy s':>9} {'exposed s':>9}",
    ]
    for row in rows:
        cp = row.comm["cp"]
        lines.append(
            f"  {row.layout.cp_method:<10} {_seconds(row.step_s):>7} {format_gb(row.memory.total):>7} "
            f"{format_gb(row.memory.activations):>8} {cp.bytes_per_step / 1e9:>7.2f} {cp.busy_s:>9.3g} "
            f"{cp.exposed_s:>9.3g}"
        )
    lines.append(
        "  allgather and ulysses wait for their collectives; ring hides its transfers behind each block's attention"
    )
    return "\n".join(lines)


def _comparison_dict(row: Estimate) -> dict[str, object]:
    return {
        "cp_method": str(row.layout.cp_method),
        "step_s": round(row.step_s, 6),
        "memory_gb": round(row.memory.total / 1e9, 3),
        "activations_gb": round(row.memory.activations / 1e9, 3),
        "cp": row.comm["cp"].as_dict(),
    }


def _count(value: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:g}"


def _seconds(value: float) -> str:
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def _plan_lines(rank: int, plan: Plan) -> list[str]:
    estimate, layout, mesh = plan.estimate, plan.layout, plan.mesh
    schedule = "-" if mesh.pp == 1 else layout.schedule
    if layout.virtual_stages > 1:
        schedule += f" v={layout.virtual_stages}"
    if mesh.cp > 1:
        schedule += f" cp={mesh.cp} {layout.cp_method}"
    if layout.ep > 1:
        schedule += f" ep={layout.ep}"
    lines = [
        f"  {rank:>2} {mesh.dp_replicate:>6} {mesh.dp_shard:>8} {mesh.tp:>3} {mesh.pp:>4}  {schedule:<22} "
        f"{layout.microbatches:>5} {'on' if layout.activation_checkpointing else 'off':>3} "
        f"{format_gb(estimate.memory.total):>7} {_seconds(estimate.step_s):>7} {estimate.mfu:>6.1%} "
        f"{estimate.tokens_per_s_per_gpu:>9.0f} {estimate.bubble:>6.1%}"
    ]
    lines.extend(f"       - {reason}" for reason in plan.reasons)
    snippet = ", ".join(
        f"{key}: {str(value).lower() if isinstance(value, bool) else value}"
        for key, value in config_snippet(plan).items()
    )
    lines.append(f"       config: parallelism: {{{snippet}}}")
    return lines
