"""torch's pipeline schedule for this rank's stages, by the name the job config gives.

Runs on every rank, inside ``Trainer`` construction (the schedule's first step is collective
over the pp group). The stages come from ``parallelize.stage_plans``, which places them as
``workers.spec.pipeline`` says the schedule expects; torch checks the same placement again
(``stage_index_to_group_rank``) for the V schedules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from workers.parallelize import StagePlan
from workers.spec import TrainSpec
from workers.spec.pipeline import MULTI_STAGE, PipelineSchedule

Schedule = PipelineScheduleSingle | PipelineScheduleMulti

SCHEDULES: dict[PipelineSchedule, Callable[..., Schedule]] = {
    PipelineSchedule.GPIPE: ScheduleGPipe,
    PipelineSchedule.ONE_F_ONE_B: Schedule1F1B,
    PipelineSchedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    PipelineSchedule.ZERO_BUBBLE: ScheduleInterleavedZeroBubble,
    PipelineSchedule.ZBV: ScheduleZBVZeroBubble,
    PipelineSchedule.DUALPIPEV: ScheduleDualPipeV,
}


def build_schedule(
    spec: TrainSpec,
    modules: Sequence[nn.Module],
    plans: Sequence[StagePlan],
    device: torch.device,
    group: ProcessGroup,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Schedule:
    """``spec.pp_schedule`` over this rank's stages (one PipelineStage per module), with
    ``spec.microbatches`` microbatches per pass.

    Gradients are not rescaled by the schedule (``scale_grads=False``): the loss already divides
    by the step's microbatch count, so every schedule sums to the same gradients.
    """
    schedule = PipelineSchedule(spec.pp_schedule)
    stages = [
        PipelineStage(module, plan.stage_index, plan.num_stages, device, group=group)
        for module, plan in zip(modules, plans)
    ]
    target = stages if schedule in MULTI_STAGE else stages[0]
    return SCHEDULES[schedule](target, n_microbatches=spec.microbatches, loss_fn=loss_fn, scale_grads=False)
