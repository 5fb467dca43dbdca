"""The pipeline schedules and their rules, as plain values both sides read.

Imported by the driver's config checks and the planner (no torch) and by the ranks, which
split the model by ``stage_ids`` and build torch's schedule class of the same name
(``workers.pipeline_schedules``). One table, so the validation, the placement the ranks use
and the planner's bubble cannot disagree about a schedule.

Placement follows ``torch.distributed.pipelining._utils.generate_stage_to_rank_mapping``:
"loop" puts stage ``s`` on rank ``s % pp`` (rank ``r`` holds ``r, r + pp, ...``); "v" puts
stage ``r`` and stage ``2 pp - 1 - r`` on rank ``r``, so rank 0 holds both the first and the
last stage (the V of ZB-V and DualPipeV).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class PipelineSchedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    # torch's ScheduleInterleavedZeroBubble (ZB1P: backward split into input and weight parts).
    ZERO_BUBBLE = "zero_bubble"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"


class StagePlacement(StrEnum):
    LOOP = "loop"
    V = "v"


@dataclass(frozen=True)
class ScheduleRules:
    """What one schedule needs: where its stages go and how many a rank holds."""

    placement: StagePlacement
    # Stages per rank when the config leaves ``stages_per_rank`` unset.
    default_stages_per_rank: int
    # The fewest stages per rank it runs with; ``exact`` when it runs with that number only.
    min_stages_per_rank: int
    exact: bool
    # Whether the backward runs as separate input- and weight-gradient passes.
    splits_backward: bool


RULES: dict[PipelineSchedule, ScheduleRules] = {
    PipelineSchedule.GPIPE: ScheduleRules(StagePlacement.LOOP, 1, 1, True, False),
    PipelineSchedule.ONE_F_ONE_B: ScheduleRules(StagePlacement.LOOP, 1, 1, True, False),
    PipelineSchedule.INTERLEAVED_1F1B: ScheduleRules(StagePlacement.LOOP, 2, 2, False, False),
    PipelineSchedule.ZERO_BUBBLE: ScheduleRules(StagePlacement.LOOP, 2, 2, False, True),
    PipelineSchedule.ZBV: ScheduleRules(StagePlacement.V, 2, 2, True, True),
    PipelineSchedule.DUALPIPEV: ScheduleRules(StagePlacement.V, 2, 2, True, True),
}

# Schedules whose torch class takes a list of stages (every rank may hold several).
MULTI_STAGE = frozenset(
    {PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.ZERO_BUBBLE, PipelineSchedule.ZBV, PipelineSchedule.DUALPIPEV}
)


def stage_ids(schedule: str, *, pp: int, pp_rank: int, stages_per_rank: int) -> list[int]:
    """The global stage indices pipeline rank ``pp_rank`` holds, in ascending order."""
    num_stages = pp * stages_per_rank
    if RULES[PipelineSchedule(schedule)].placement is StagePlacement.LOOP:
        return list(range(pp_rank, num_stages, pp))
    # V: going down the ranks for even rounds, back up for odd ones.
    return sorted(round_ * pp + (pp_rank if round_ % 2 == 0 else pp - 1 - pp_rank) for round_ in range(stages_per_rank))


def stages_per_rank_problem(schedule: str, stages_per_rank: int) -> str | None:
    """Why ``stages_per_rank`` does not suit ``schedule`` (the config key's message), or None."""
    rules = RULES[PipelineSchedule(schedule)]
    if rules.exact and stages_per_rank != rules.min_stages_per_rank:
        if rules.min_stages_per_rank == 1:
            return (
                f"parallelism.stages_per_rank={stages_per_rank} needs pp_schedule=interleaved_1f1b or "
                "zero_bubble (zbv and dualpipev hold exactly 2)"
            )
        return (
            f"parallelism.stages_per_rank={stages_per_rank}: pp_schedule={schedule} places exactly "
            f"{rules.min_stages_per_rank} stages per rank (stage r and 2 pp - 1 - r on rank r); leave it unset"
        )
    if stages_per_rank < rules.min_stages_per_rank:
        return f"parallelism.stages_per_rank must be >= {rules.min_stages_per_rank} for pp_schedule={schedule}"
    return None


def microbatches_problem(schedule: str, *, pp: int, stages_per_rank: int, microbatches: int) -> str | None:
    """Why ``microbatches`` cannot run ``schedule`` at ``pp`` (torch's rule for it), or None."""
    if microbatches < pp:
        return f"parallelism.microbatches={microbatches} must be >= pp={pp} so that every pipeline stage has work"
    kind = PipelineSchedule(schedule)
    if kind in (PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.ZERO_BUBBLE) and microbatches % pp:
        return f"parallelism.microbatches={microbatches} must be a multiple of pp={pp} for pp_schedule={schedule}"
    stages = pp * stages_per_rank
    if kind is PipelineSchedule.DUALPIPEV and microbatches < stages:
        return (
            f"parallelism.microbatches={microbatches} must be >= the {stages} pipeline stages "
            f"(2 x pp={pp}) for pp_schedule=dualpipev"
        )
    return None
