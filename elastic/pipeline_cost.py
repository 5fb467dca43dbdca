"""What a pipeline schedule costs: the bubble it leaves and the microbatches it keeps in flight.

Pure arithmetic (no ray, no torch), for ``elastic.cost_model``. ``p`` pipeline ranks, ``m``
microbatches, ``v`` stages (model chunks) per rank; forward, input-gradient and weight-gradient
passes of a chunk are taken to cost the same (F = B = W), as the papers' formulas do.

* GPipe and 1F1B: ``(p - 1) / (m + p - 1)`` (Narayanan et al. 2021); interleaved 1F1B divides
  the bubble time by ``v``: ``(p - 1) / (v·m + p - 1)``.
* zero_bubble (torch's ScheduleInterleavedZeroBubble, ZB1P of Qi et al. 2024, "Zero Bubble
  Pipeline Parallelism"): weight-gradient passes fill the drain, leaving ``(p - 1)(F + B - W)``
  of idle time against ``m (F + B + W)`` of work, a third of 1F1B's: ``(p - 1) / (3 v·m + p - 1)``.
* zbv (ZB-V, same paper, section 6) and dualpipev (DeepSeek-V3's DualPipe, V-shaped): zero with
  at least ``2 p - 1`` microbatches when F = B = W; with fewer, the V does not fill and the
  interleaved formula (v = 2) stands in.
"""

from __future__ import annotations

from typing import Protocol

from elastic.spec import MeshSpec

# Schedules whose backward is split into input- and weight-gradient passes.
ZERO_BUBBLE_SCHEDULES = ("zero_bubble", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")


class PipelinedLayout(Protocol):
    """What of a ``cost_model.Layout`` the pipeline arithmetic reads."""

    @property
    def mesh(self) -> MeshSpec: ...
    @property
    def schedule(self) -> str: ...
    @property
    def virtual_stages(self) -> int: ...
    @property
    def microbatches(self) -> int: ...


def pipeline_bubble(pp: int, microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Fraction of the step a pipeline rank idles under ``schedule`` (see the module docstring)."""
    if pp <= 1:
        return 0.0
    work = virtual_stages * microbatches
    if schedule in V_SCHEDULES and microbatches >= 2 * pp - 1:
        return 0.0
    if schedule == "zero_bubble":
        return (pp - 1) / (3 * work + pp - 1)
    return (pp - 1) / (work + pp - 1)


def in_flight_chunk_microbatches(layout: PipelinedLayout, stage: int) -> int:
    """Chunk-microbatches whose activations pipeline rank ``stage`` holds at its peak.

    1F1B (and zero_bubble with one stage per rank): rank i warms up with ``p - i - 1``
    forwards, so it holds ``p - i`` microbatches. Interleaved (Megatron; zero_bubble keeps the
    same warm-up): ``2·(p - i - 1) + (v - 1)·p + 1`` chunk-microbatches. The V schedules hold
    as much as 1F1B does on rank 0 (ZB-V's design point): ``2 p`` half-size chunks. GPipe: every
    microbatch. Without a pipeline: one microbatch at a time.
    """
    pp, v, m = layout.mesh.pp, layout.virtual_stages, layout.microbatches
    if pp == 1 or layout.schedule == "none":
        return 1
    if layout.schedule == "gpipe":
        return m * v
    if layout.schedule in V_SCHEDULES:
        return min(m * v, 2 * pp)
    if v == 1:
        return min(m, pp - stage)
    return min(m * v, 2 * (pp - stage - 1) + (v - 1) * pp + 1)
