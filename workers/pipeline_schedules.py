"""torch's pipeline schedule for this rank's stages, by the name the job config gives.

Runs on every rank, inside ``Trainer`` construction (the schedule's first step is collective
over the pp group). The stages come from ``parallelize.stage_plans``, which places them as
``workers.spec.pipeline`` says the schedule expects; torch checks the same placement again
(``stage_index_to_group_rank``) for the V schedules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
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

from checkpointing.torch_compat import around_shape_inference
from workers.models import StageModel
from workers.parallelize import StagePlan
from workers.spec import TrainSpec
from workers.spec.pipeline import MULTI_STAGE, RULES, PipelineSchedule, StagePlacement

Schedule = PipelineScheduleSingle | PipelineScheduleMulti


class PipelineStageForwardOnlyV(PipelineStage):
    """A PipelineStage whose forward-only pass (``schedule.eval``) works in the V schedules.

    torch 2.13's runtime schedules replay their whole action list in ``eval``, backward actions
    included; each backward action is a no-op on a stage without backward, except the hand-over
    of input gradients between the two stages of one rank at the V's turn (stage pp - 1 to pp),
    which asserts. With no backward there is nothing to hand over.
    """

    def get_local_bwd_output(self, mb_index: int) -> tuple[torch.Tensor | None, ...]:
        if not self.has_backward:
            return ()
        return super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple[torch.Tensor | None, ...], mb_index: int) -> None:
        if not self.has_backward:
            return
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


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
    modules: Sequence[StageModel],
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
    v_shaped = RULES[schedule].placement is StagePlacement.V
    stage_class = PipelineStageForwardOnlyV if v_shaped else PipelineStage
    stages = [
        stage_class(module, plan.stage_index, plan.num_stages, device, group=group)
        for module, plan in zip(modules, plans)
    ]
    for stage, module in zip(stages, modules):
        # A model's forward-side state (MoE routing counts) leaves the inference forward out.
        around_shape_inference(
            stage,
            functools.partial(module.set_shape_inference, True),
            functools.partial(module.set_shape_inference, False),
        )
    target = stages if schedule in MULTI_STAGE else stages[0]
    return SCHEDULES[schedule](target, n_microbatches=spec.microbatches, loss_fn=loss_fn, scale_grads=False)
