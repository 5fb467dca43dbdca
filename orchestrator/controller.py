"""The driver's control loop: an explicit state machine, one iteration per ``step()`` call.

Runs on the driver. States carry their data; ``step()`` looks at the current state, does one
bounded piece of work (start actors, wait a little for a configuration, poll the ranks once)
and moves to the next state. ``run()`` calls ``step()`` until a terminal state. Tests drive it
one iteration at a time with a fake worker group (``Controller.worker_group_class``).

    Starting -> Configuring -> Running -> Finished
                     ^            |
                     +------------+  (a new generation after a change of mesh)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from elastic.placement import RankResources
from elastic.spec import MeshSpec
from orchestrator.config import JobConfig
from orchestrator.events import EventLog
from orchestrator.job import data_bytes, train_spec
from orchestrator.reports import ReportRouter
from orchestrator.worker_group import CallFailed, PendingCalls, WorkerGroup
from workers.actor import RunOutcome, StartFrom

log = logging.getLogger("meshpilot")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


# ------------------------------------------------------------------------------ states
@dataclass(frozen=True)
class Starting:
    mesh: MeshSpec


@dataclass(frozen=True)
class Configuring:
    generation: int
    mesh: MeshSpec
    calls: PendingCalls
    deadline: float


@dataclass(frozen=True)
class Running:
    generation: int
    mesh: MeshSpec
    calls: PendingCalls


@dataclass(frozen=True)
class Finished:
    status: str  # finished | failed | interrupted
    exit_code: int
    reason: str | None = None


State = Starting | Configuring | Running | Finished


class Controller:
    """Owns the worker group and carries the run from start to a terminal state (driver side)."""

    worker_group_class = WorkerGroup

    def __init__(self, config: JobConfig, events: EventLog, *, poll_interval_s: float = 0.25) -> None:
        self.config = config
        self.events = events
        self.poll_interval_s = poll_interval_s
        self.spec = train_spec(config)
        self.router = ReportRouter(events, mesh=config.mesh,
                                   tokens_per_step=config.training.global_batch * config.training.seq_len)
        self.group = self.worker_group_class(
            spec=self.spec, data=data_bytes(config),
            per_rank=RankResources(cpus=config.runtime.cpus_per_rank, gpus=config.runtime.gpus_per_rank),
            start_timeout_s=config.runtime.start_timeout_s,
        )
        self.state: State = Starting(config.mesh)
        self.started_at = time.monotonic()
        self.last_step = 0
        self.generation = 0

    # ------------------------------------------------------------------- loop
    @property
    def done(self) -> bool:
        return isinstance(self.state, Finished)

    def run(self) -> Finished:
        """Step until a terminal state; always shuts the group down and ends with a ``done`` event."""
        try:
            while not self.done:
                self.step()
        except KeyboardInterrupt:
            self.state = self._interrupt()
        except BaseException as error:
            self.state = Finished("failed", EXIT_FAILED, reason=str(error))
            raise
        finally:
            self.group.shutdown()
            self.events.emit("done", status=self.state.status, steps=self.last_step,
                             elapsed_s=round(time.monotonic() - self.started_at, 3), reason=self.state.reason)
        return self.state

    def step(self) -> None:
        """One iteration of the state machine."""
        state = self.state
        if isinstance(state, Starting):
            self.state = self._start(state)
        elif isinstance(state, Configuring):
            self.state = self._await_configuration(state)
        elif isinstance(state, Running):
            self.state = self._supervise(state)

    # ----------------------------------------------------------------- states
    def _start(self, state: Starting) -> State:
        self.group.start(state.mesh)
        self.events.emit("start", run_dir=str(self.events.path.parent) if self.events.path else None,
                         name=self.config.name, mesh=state.mesh.as_dict(), world_size=state.mesh.world_size,
                         steps=self.spec.steps, global_batch=self.spec.global_batch, seq_len=self.spec.seq_len,
                         config_hash=self.config.config_hash())
        return self._configure(state.mesh, StartFrom(mode="fresh"))

    def _configure(self, mesh: MeshSpec, start: StartFrom) -> Configuring:
        self.generation += 1
        self.router.set_mesh(mesh)
        calls = self.group.configure(generation=self.generation, mesh=mesh, start=start)
        return Configuring(self.generation, mesh, calls,
                           deadline=time.monotonic() + self.config.runtime.start_timeout_s)

    def _await_configuration(self, state: Configuring) -> State:
        state.calls.collect(self.poll_interval_s)
        failed = {rank: r for rank, r in state.calls.results.items() if isinstance(r, CallFailed)}
        if failed:
            return self._fail("configuration", group_errors({r: f.message for r, f in failed.items()}))
        if not state.calls.done:
            if time.monotonic() > state.deadline:
                missing = len(state.calls.refs) - len(state.calls.results)
                return self._fail("configuration", f"{missing} ranks did not finish configuring within "
                                  f"runtime.start_timeout_s={self.config.runtime.start_timeout_s:g}")
            return state
        self.last_step = max(state.calls.results.values())
        return Running(state.generation, state.mesh, self.group.run(last_step=self.spec.steps))

    def _supervise(self, state: Running) -> State:
        self._drain_reports()
        state.calls.collect(timeout=0)
        self._drain_reports()  # reports queued just before a rank returned
        outcomes = {rank: _as_outcome(result, self.last_step) for rank, result in state.calls.results.items()}
        failed = {rank: o for rank, o in outcomes.items() if o.status in ("failed", "died")}
        if failed:
            return self._on_failure(state, failed)
        if state.calls.done:
            statuses = {o.status for o in outcomes.values()}
            if statuses == {"finished"}:
                return Finished("finished", EXIT_OK)
            return self._fail("stopped", f"ranks ended with {sorted(statuses)}")
        time.sleep(self.poll_interval_s)
        return state

    def _on_failure(self, state: Running, failed: dict[int, RunOutcome]) -> State:
        message = group_errors({rank: o.error or o.status for rank, o in failed.items()})
        kind = "rank_died" if any(o.status == "died" for o in failed.values()) else "rank_error"
        self.events.emit("failure", kind=kind, ranks=sorted(failed), node=None, message=message)
        return self._fail(kind, message)

    def _fail(self, kind: str, message: str) -> Finished:
        log.error("run failed (%s): %s", kind, message)
        return Finished("failed", EXIT_FAILED, reason=message)

    def _interrupt(self, grace_s: float = 15.0) -> Finished:
        """Ctrl-C: let the step in flight finish everywhere, then stop (a second Ctrl-C stops at once)."""
        log.warning("interrupted: stopping after the step in flight (Ctrl-C again to stop at once)")
        self.group.request_stop()
        if isinstance(self.state, Running):
            deadline = time.monotonic() + grace_s
            while not self.state.calls.done and time.monotonic() < deadline:
                self.state.calls.collect(timeout=0.2)
            self._drain_reports()
        return Finished("interrupted", EXIT_INTERRUPTED, reason="interrupted by the user")

    # --------------------------------------------------------------- reports
    def _drain_reports(self) -> None:
        for heartbeat in self.group.poll(self.config.elastic.heartbeat_timeout_s).values():
            if isinstance(heartbeat, CallFailed):
                continue  # a dead actor: its run call says so
            self.router.route(heartbeat.reports)
        self.last_step = max(self.last_step, self.router.last_emitted_step)


def _as_outcome(result: Any, last_step: int) -> RunOutcome:
    if isinstance(result, CallFailed):
        status = "died" if result.kind == "died" else "failed"
        return RunOutcome(status, last_step, error=result.message, error_kind=result.kind)
    return result


def group_errors(messages: dict[int, str]) -> str:
    """Identical failures print once: ``[Rank 0, 1]: message``."""
    by_message: dict[str, list[int]] = {}
    for rank, text in sorted(messages.items()):
        by_message.setdefault(_last_line(text), []).append(rank)
    return "; ".join(f"[Rank {', '.join(map(str, ranks))}]: {message}" for message, ranks in by_message.items())


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text
