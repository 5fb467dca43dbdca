"""Turning the ranks' reports into the run's events.

Runs on the driver, called by the controller with every batch of reports it polls (the typed
reports of ``workers/spec/messages.py``, dispatched on their ``ReportKind``). Per-rank
``StepReport``s are joined into one ``step`` event once every rank of the mesh has reported
that step (the loss is the mean over data-parallel slices; the step time the slowest rank's),
and handed to the sample ledger (``sample_ledger.py``, a null one unless ``data.record_samples``);
``LogReport``s become ``log`` events, ``PretrainedLoadReport``s ``pretrained_loaded`` events,
``EvalReport``s ``eval`` events (one per step boundary: a boundary evaluated again when a run
resumes there is dropped).
Other kinds are handed to the handlers registered for them (checkpoint coordination registers
its own for ``CHECKPOINT_UPLOAD``, the controller one for ``DRAIN_NOTICE``).

What else must happen when a step or an evaluation is known is given to the constructor as
``RouterHooks`` (the controller fires injected driver faults after a step, and counts an
evaluation as progress for the hang check).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from elastic.spec import MeshSpec
from orchestrator.driver.sample_ledger import NoLedger, SampleLedger
from orchestrator.observe.events import EventLog
from workers.spec.messages import (
    CompileCounts,
    EvalReport,
    LogReport,
    PretrainedLoadReport,
    RankReport,
    ReportKind,
    StepReport,
)

Handler = Callable[[Any], None]  # called with the report of the kind it was registered for


def _nothing(*_: object) -> None:
    return None


@dataclass(frozen=True)
class RouterHooks:
    """What the router calls, on the driver, as it emits events."""

    # After each step event, with the step (``last_emitted_step`` is already that step).
    after_step: Callable[[int], None] = _nothing
    # After each eval event.
    after_eval: Callable[[], None] = _nothing
    # With each step every rank of the mesh reported: the step and its reports by rank.
    step_reports: Callable[[int, Mapping[int, StepReport]], None] = _nothing


class ReportRouter:
    """The ranks' reports -> the run's events (driver side); see the module docstring."""

    def __init__(
        self,
        events: EventLog,
        *,
        mesh: MeshSpec,
        tokens_per_step: int,
        ledger: SampleLedger | NoLedger | None = None,
        hooks: RouterHooks | None = None,
    ) -> None:
        self.events = events
        self.tokens_per_step = tokens_per_step
        self.mesh = mesh
        self.handlers: dict[ReportKind, Handler] = {
            ReportKind.STEP: self._on_step,
            ReportKind.LOG: self._on_log,
            ReportKind.PRETRAINED_LOAD: self._on_pretrained_load,
            ReportKind.EVAL: self._on_eval,
        }
        self._evaluated: set[int] = set()  # step boundaries with an ``eval`` event
        self._pending: dict[int, dict[int, StepReport]] = {}
        self.last_emitted_step = 0
        # Step events emitted over the run, redone steps included: progress never rewinds.
        self.steps_emitted = 0
        self.last_step_time_s: float | None = None
        # step -> when its slowest rank finished it (the ranks' clocks), for recovery timings.
        self.completed_at: dict[int, float] = {}
        self.ledger: SampleLedger | NoLedger = ledger if ledger is not None else NoLedger()
        self.hooks = hooks if hooks is not None else RouterHooks()

    def on(self, kind: ReportKind | str, handler: Handler) -> None:
        self.handlers[ReportKind(kind)] = handler

    def set_mesh(self, mesh: MeshSpec) -> None:
        """A new generation: reports of steps the old mesh did not finish are dropped."""
        self.mesh = mesh
        self._pending = {}

    def reported(self, upto_step: int, ranks: Iterable[int]) -> bool:
        """Whether every step up to ``upto_step`` is emitted or reported by all of ``ranks``."""
        wanted = set(ranks)
        return all(
            wanted <= self._pending.get(step, {}).keys() for step in range(self.last_emitted_step + 1, upto_step + 1)
        )

    def flush(self, upto_step: int) -> None:
        """Emit steps up to ``upto_step`` that every survivor applied but a lost rank never
        reported (it died between the commit and its report): the run did take them."""
        while self.last_emitted_step < upto_step:
            step = self.last_emitted_step + 1
            ranks = self._pending.pop(step, {})
            if not ranks:
                break
            self._emit(step, ranks)

    def route(self, reports: Iterable[RankReport]) -> None:
        for report in reports:
            handler = self.handlers.get(report.kind)
            if handler is not None:
                handler(report)

    def _on_log(self, report: LogReport) -> None:
        self.events.emit("log", rank=report.rank, level=report.level, message=report.message, logger=report.logger)

    def _on_pretrained_load(self, report: PretrainedLoadReport) -> None:
        self.events.emit(
            "pretrained_loaded",
            rank=report.rank,
            uri=report.uri,
            bytes_read=report.bytes_read,
            bytes_total=report.bytes_total,
            seconds=round(report.seconds, 3),
        )

    def _on_eval(self, report: EvalReport) -> None:
        if report.step in self._evaluated:
            return
        self._evaluated.add(report.step)
        self.events.emit(
            "eval", step=report.step, loss=report.loss, tokens=report.tokens, eval_s=round(report.eval_s, 6)
        )
        self.hooks.after_eval()

    def _on_step(self, report: StepReport) -> None:
        step = report.step
        if step <= self.last_emitted_step:
            return
        self._pending.setdefault(step, {})[report.rank] = report
        while (ranks := self._pending.get(self.last_emitted_step + 1)) and len(ranks) == self.mesh.world_size:
            self._emit(self.last_emitted_step + 1, self._pending.pop(self.last_emitted_step + 1))

    def _emit(self, step: int, ranks: dict[int, StepReport]) -> None:
        losses = [r.loss for r in ranks.values() if r.loss is not None]
        any_report = next(iter(ranks.values()))
        extra: dict[str, Any] = {}
        if load := _worst_expert_load(ranks.values()):
            extra["expert_load_max_over_mean"] = load
        if compiled := _compiled(ranks.values()):
            # training.compile: graphs the ranks compiled in the step and graphs their caches held.
            extra["compile"] = {"compiled": compiled.compiled, "cache_hits": compiled.cache_hits}
        if len(ranks) < self.mesh.world_size:
            # A rank died after applying the step but before its report reached the driver:
            # the loss is the mean over the data-parallel slices that did report.
            extra |= {"loss_partial": True, "reported_ranks": len(ranks)}
        self.events.emit(
            "step",
            **extra,
            step=step,
            # Each slice's loss is its share of the global batch's, scaled by dp (Trainer.microbatch_loss):
            # their mean is the loss over every trained label of the global batch.
            loss=sum(losses) / len(losses) if losses else None,
            tokens=self.tokens_per_step,
            trained_tokens=_trained_tokens(ranks.values(), self.tokens_per_step),
            step_time_s=max(r.step_time_s for r in ranks.values()),
            world_size=self.mesh.world_size,
            mesh=self.mesh.as_dict(),
            lr=any_report.lr,
            grad_norm=any_report.grad_norm,
            rank_step_time_s={str(rank): round(r.step_time_s, 6) for rank, r in sorted(ranks.items())},
            # Per phase of the step (data = reading or awaiting its samples, compute, sync = the
            # clip and the commit vote, optimizer), the longest any rank spent in it.
            phases_s=_slowest_phases(ranks.values()),
            # When the slowest rank finished the step (its own clock): the driver learns of
            # it up to one poll interval later.
            completed_at=max(r.time for r in ranks.values()),
        )
        self.ledger.record(step, ranks.values(), self.mesh)
        if len(ranks) == self.mesh.world_size:
            self.hooks.step_reports(step, ranks)
        self.last_emitted_step = step
        self.steps_emitted += 1
        self.last_step_time_s = max(r.step_time_s for r in ranks.values())
        self.completed_at[step] = max(r.time for r in ranks.values())
        self.completed_at.pop(step - 100, None)
        stalls = [r.checkpoint_stall_s for r in ranks.values() if r.checkpoint_stall_s is not None]
        if stalls:
            # The loop waits for its slowest rank: that rank's staging time is the run's stall.
            self.events.emit("checkpoint_staged", step=step, stall_s=round(max(stalls), 6))
        self.hooks.after_step(step)

    def rewind(self, step: int) -> None:
        """Training goes back to ``step`` (a restore from a checkpoint): later steps run again."""
        self._pending = {}
        self.last_emitted_step = step
        self._evaluated = {evaluated for evaluated in self._evaluated if evaluated <= step}
        self.ledger.rewind(step)


def _trained_tokens(reports: Iterable[StepReport], tokens_per_step: int) -> int:
    """The step's trained labels, as its ranks counted them (every rank the same number); a rank
    that does not count them (an older report) means every label trained."""
    counts = [report.trained_tokens for report in reports if report.trained_tokens is not None]
    return counts[0] if counts else tokens_per_step


def _compiled(reports: Iterable[StepReport]) -> CompileCounts:
    """What every rank of the step compiled and loaded, summed (nothing when none compiles)."""
    return sum((report.compiled for report in reports if report.compiled is not None), CompileCounts())


def _slowest_phases(reports: Iterable[StepReport]) -> dict[str, float]:
    slowest: dict[str, float] = {}
    for report in reports:
        for phase, seconds in (report.phases or {}).items():
            slowest[phase] = round(max(seconds, slowest.get(phase, 0.0)), 6)
    return slowest


def _worst_expert_load(reports: Iterable[StepReport]) -> dict[str, float]:
    """Per mixture-of-experts layer, the most uneven load any data-parallel slice saw in the step."""
    worst: dict[str, float] = {}
    for report in reports:
        for layer, ratio in (report.expert_load or {}).items():
            worst[layer] = max(ratio, worst.get(layer, 0.0))
    return worst
