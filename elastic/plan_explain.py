"""Why the planner rejects a family of layouts, and why it picks the one it picks: one line each.

Pure (no ray, no torch); ``elastic.planner`` calls these while it searches.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastic.cost_model import Assumptions, Cluster, Estimate, Workload, estimate

if TYPE_CHECKING:  # the planner imports this module; only its type is needed here
    from elastic.planner import Constraints


@dataclass(frozen=True)
class Rejection:
    """A family of layouts that cannot run, and why, in one line."""

    layout: str
    reason: str
    kind: str  # "tp", "pp", "batch", "memory"
    layouts: int = 1  # how many (dp_replicate, dp_shard, tp, pp) meshes this line covers
    needs_gb: float | None = None

    def line(self) -> str:
        return f"{self.layout}: {self.reason}"

    def as_dict(self) -> dict[str, object]:
        return {
            "layout": self.layout,
            "reason": self.reason,
            "kind": self.kind,
            "layouts": self.layouts,
            "needs_gb": None if self.needs_gb is None else round(self.needs_gb, 3),
        }


def memory_rejection(name: str, closest: Estimate, splits: int) -> Rejection:
    memory, layout = closest.memory, closest.layout
    state = memory.params + memory.grads + memory.optimizer
    detail = (
        f"params+grads+optimizer {format_gb(state)}, FSDP buffers {format_gb(memory.fsdp_buffers)}, "
        f"activations {format_gb(memory.activations)}, logits {format_gb(memory.logits)}"
    )
    ac = " with activation checkpointing" if layout.activation_checkpointing else ""
    across = f" (best of {splits} dp splits: {layout.mesh.describe()})" if splits > 1 else ""
    return Rejection(
        name,
        f"needs {format_gb(memory.total)} GB per GPU{ac} > {format_gb(closest.usable_memory)} GB usable "
        f"({detail}){across}",
        "memory",
        splits,
        needs_gb=memory.total / 1e9,
    )


def explain_choice(
    workload: Workload, cluster: Cluster, constraints: Constraints, assumptions: Assumptions, chosen: Estimate
) -> tuple[str, ...]:
    layout, memory = chosen.layout, chosen.memory
    reasons = [
        f"fits {format_gb(memory.total)} of {format_gb(chosen.usable_memory)} GB usable "
        f"(state {format_gb(memory.params + memory.grads + memory.optimizer)}, "
        f"FSDP buffers {format_gb(memory.fsdp_buffers)}, activations {format_gb(memory.activations)}, "
        f"logits {format_gb(memory.logits)})"
    ]
    if layout.mesh.pp > 1:
        schedule = layout.schedule if layout.virtual_stages == 1 else f"{layout.schedule} v={layout.virtual_stages}"
        reasons.append(
            f"bubble {chosen.bubble:.1%} ({schedule}, {layout.microbatches} microbatches of "
            f"{chosen.microbatch_size} sequence{'s' if chosen.microbatch_size > 1 else ''})"
        )
    for dim in ("tp", "cp", "ep", "pp", "dp_shard", "dp_replicate"):
        cost = chosen.comm.get(dim)
        if cost is not None and cost.bytes_per_step > 0:
            reasons.append(
                f"{dim} {format_gb(cost.bytes_per_step)} GB/step over {cost.link}, "
                f"{cost.exposed_s / chosen.step_s:.0%} of the step exposed"
            )
    chunks = layout.mesh.pp * layout.virtual_stages
    if workload.model.n_layers % chunks:
        low, high = workload.model.n_layers // chunks, -(-workload.model.n_layers // chunks)
        reasons.append(
            f"uneven pipeline split: {workload.model.n_layers} layers in {chunks} chunks of {low}-{high} "
            "(meshpilot's trainer splits layers evenly today; --even-stages plans only such splits)"
        )
    if layout.activation_checkpointing and False in constraints.activation_checkpointing:
        without = estimate(workload, cluster, dataclasses.replace(layout, activation_checkpointing=False), assumptions)
        if not without.fits:
            reasons.append(f"activation checkpointing needed (off: {format_gb(without.memory.total)} GB)")
    return tuple(reasons)


def merge_families(tp: int, families: list[tuple[int, int, str, str, int]]) -> list[Rejection]:
    """One line per run of consecutive pp values rejected for the same reason."""
    merged: list[Rejection] = []
    run: list[tuple[int, int, str, str, int]] = []
    for family in families + [(0, 0, "", "", 0)]:
        if run and (family[2], family[3]) != (run[0][2], run[0][3]):
            pps = [f[0] for f in run]
            dps = [f[1] for f in run]
            if len(run) == 1:
                name = f"tp={tp} pp={pps[0]} dp={dps[0]}"
            else:
                name = f"tp={tp} pp={_span(pps)} (dp={_span(dps)})"
            merged.append(Rejection(name, run[0][3], run[0][2], sum(f[4] for f in run)))
            run = []
        run.append(family)
    return merged


def merge_tp(rejections: list[Rejection]) -> list[Rejection]:
    """Consecutive tp degrees rejected for the same kind of reason become one line."""
    merged: list[Rejection] = []
    for rejection in rejections:
        previous = merged[-1] if merged else None
        if (
            previous is not None
            and rejection.kind == "tp" == previous.kind
            and _reason_shape(rejection.reason) == _reason_shape(previous.reason)
        ):
            first = previous.layout.split("..")[0]
            last = rejection.layout.removeprefix("tp=")
            merged[-1] = Rejection(
                f"{first}..{last}",
                previous.reason + _LIKEWISE if not previous.reason.endswith(_LIKEWISE) else previous.reason,
                "tp",
                previous.layouts + rejection.layouts,
            )
        else:
            merged.append(rejection)
    return merged


_LIKEWISE = " (and likewise for the larger tp)"


def _reason_shape(reason: str) -> str:
    """A reason with its numbers taken out, so tp=16 and tp=32 failing alike compare equal."""
    return re.sub(r"\d+", "#", reason.removesuffix(_LIKEWISE))


def _span(values: list[int]) -> str:
    if len(values) <= 3:
        return ",".join(str(v) for v in values)
    return f"{values[0]}..{values[-1]}"


# ---------------------------------------------------------------------------- helpers
def format_gb(num_bytes: float) -> str:
    """Gigabytes with three significant digits, so 0.0123 and 361 both read well."""
    value = num_bytes / 1e9
    return f"{value:.1f}" if 10 <= value < 1000 else f"{value:.3g}"
