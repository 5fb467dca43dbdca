"""Whether one given layout runs, and why not: a job config's, or a published one.

Pure (no ray, no torch). ``meshpilot plan`` prices a config's own layout with it next to the
search's picks; the planner's tests check published layouts (TorchTitan's, Llama 3's) with it.
"""

from __future__ import annotations

from elastic.cost_model import Assumptions, Cluster, Estimate, Layout, Workload, estimate
from elastic.plan_explain import memory_rejection
from elastic.planner import PIPELINE_SCHEDULES, Constraints, expert_degrees, stage_counts, tp_problem


def check_layout(
    workload: Workload,
    cluster: Cluster,
    layout: Layout,
    *,
    constraints: Constraints = Constraints(),
    assumptions: Assumptions = Assumptions(),
) -> tuple[Estimate | None, list[str]]:
    """Price one given layout (a config's, a published one) and list why it cannot run, if it cannot.

    Returns (estimate, problems): the estimate is None when the layout does not even divide the
    model and batch; problems is empty when it runs and fits.
    """
    mesh, model = layout.mesh, workload.model
    problems: list[str] = []
    if mesh.world_size != cluster.gpus:
        problems.append(f"{mesh.describe()} has {mesh.world_size} ranks, not the {cluster.gpus} GPUs planned for")
    tp_reason = tp_problem(workload, cluster, constraints, mesh.tp)
    if tp_reason:
        problems.append(f"tp={mesh.tp}: {tp_reason}")
    problems.extend(schedule_problems(layout))
    if layout.ep not in expert_degrees(model, mesh):
        problems.append(
            model.expert_parallel_problem(layout.ep, "ep") or f"ep={layout.ep} must divide dp_shard={mesh.dp_shard}"
        )
    problems.extend(
        mesh.check_divides(
            n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads,
            n_layers=model.n_layers,
            ffn_dim=model.tp_split_ffn_dim,
            global_batch=workload.global_batch,
            microbatches=layout.microbatches,
            seq_len=workload.seq_len,
            stages_per_rank=layout.virtual_stages,
            even_stages=constraints.even_stages,
        )
    )
    if problems:
        return None, problems
    result = estimate(workload, cluster, layout, assumptions)
    if not result.fits:
        problems.append(memory_rejection(layout.describe(), result, 1).reason)
    return result, problems


def schedule_problems(layout: Layout) -> list[str]:
    """Why ``layout``'s pipeline schedule, microbatches and stages per rank do not go together."""
    mesh, problems = layout.mesh, []
    if mesh.pp == 1 and layout.schedule != "none":
        problems.append(f"schedule {layout.schedule!r} needs pp > 1")
    if mesh.pp > 1:
        if layout.schedule not in PIPELINE_SCHEDULES:
            problems.append(f"pp={mesh.pp} needs a schedule from {', '.join(PIPELINE_SCHEDULES)}")
        if layout.microbatches < mesh.pp:
            problems.append(f"microbatches={layout.microbatches} must be >= pp={mesh.pp} so every stage has work")
        if layout.schedule in ("interleaved_1f1b", "zero_bubble") and layout.microbatches % mesh.pp:
            problems.append(
                f"microbatches={layout.microbatches} must be a multiple of pp={mesh.pp} for {layout.schedule}"
            )
        if layout.schedule == "dualpipev" and layout.microbatches < 2 * mesh.pp:
            problems.append(f"microbatches={layout.microbatches} must be >= 2 x pp={mesh.pp} for dualpipev")
    if layout.schedule in PIPELINE_SCHEDULES and layout.virtual_stages not in stage_counts(layout.schedule):
        counts = stage_counts(layout.schedule)
        problems.append(f"virtual_stages={layout.virtual_stages}: {layout.schedule} takes {counts[0]}..{counts[-1]}")
    if layout.schedule == "none" and layout.virtual_stages != 1:
        problems.append(f"virtual_stages={layout.virtual_stages} needs a pipeline schedule")
    return problems
