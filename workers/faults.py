"""Deterministic fault injection, keyed by (rank, step): a feature, not a test hack.

``--inject KIND@STEP[:RANK]`` (repeatable) on ``meshpilot train``, or ``FaultSpec`` values in
tests. The driver hands each generation the faults it has not consumed yet; a rank fires a
fault at the start of step STEP when its rank in the current mesh is RANK (default 0), so
the same fault hits the same place in every run. Kinds fired on the rank side:

    kill        SIGKILL this rank's process (a crashed process, an OOM kill)
    raise       raise an exception in the step (a software error)
    hang        stop making progress inside the step (a deadlock, a stuck device)
    drain       ask Ray to drain this rank's node, as a spot reclaim or autoscaler would
    sigterm     send SIGTERM to this rank's process, as a pod's termination does
    s3_outage   make every storage request of this rank fail for STORAGE_OUTAGE_S seconds

and on the driver side:

    driver      SIGKILL the driver itself once STEP has completed (resume from storage)
    node        remove the Ray node of RANK (only under a multi-node test cluster)
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from workers.spec.messages import FailureKind

RANK_KINDS = ("kill", "raise", "hang", "drain", "sigterm", "s3_outage")
# How long an injected storage outage lasts: long enough to exhaust the writer's retries.
STORAGE_OUTAGE_S = 8.0
DRIVER_KINDS = ("driver", "node")
KINDS = RANK_KINDS + DRIVER_KINDS


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws inside the step."""

    failure_kind = FailureKind.INJECTED


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    step: int
    rank: int = 0

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        """``KIND@STEP[:RANK]`` -> FaultSpec; ValueError naming what is wrong."""
        kind, at, where = text.partition("@")
        if not at or kind not in KINDS:
            raise ValueError(f"--inject {text!r}: expected KIND@STEP[:RANK] with KIND one of {', '.join(KINDS)}")
        step_text, _, rank_text = where.partition(":")
        try:
            step = int(step_text)
            rank = int(rank_text) if rank_text else 0
        except ValueError:
            raise ValueError(f"--inject {text!r}: STEP and RANK must be integers, e.g. kill@5:1") from None
        if step < 1 or rank < 0:
            raise ValueError(f"--inject {text!r}: STEP must be >= 1 and RANK >= 0")
        return cls(kind, step, rank)

    def describe(self) -> str:
        return f"{self.kind}@{self.step}:{self.rank}"


class FaultInjector:
    """Rank side: fires this generation's faults for this rank at the start of their step."""

    def __init__(self, faults: tuple[FaultSpec, ...], *, rank: int, on_fire=None) -> None:
        self.faults = [f for f in faults if f.rank == rank and f.kind in RANK_KINDS]
        self.on_fire = on_fire
        self.storage_outage_until = 0.0

    def before_step(self, step: int) -> None:
        for fault in self.faults:
            if fault.step == step:
                self._fire(fault)

    def storage_down(self) -> bool:
        return time.monotonic() < self.storage_outage_until

    def _fire(self, fault: FaultSpec) -> None:
        if self.on_fire is not None:
            self.on_fire(fault)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "raise":
            raise InjectedFault(f"injected fault {fault.describe()}")
        elif fault.kind == "hang":
            while True:  # never returns; the driver's hang detection must find and stop this rank
                time.sleep(3600)
        elif fault.kind == "drain":
            _drain_this_node(f"injected fault {fault.describe()}")
        elif fault.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.kind == "s3_outage":
            self.storage_outage_until = time.monotonic() + STORAGE_OUTAGE_S


def _drain_this_node(message: str) -> None:
    """Tell Ray's GCS this node will be preempted, exactly as the autoscaler or a preStop hook does."""
    import ray

    from workers import ray_compat  # Ray's private modules: imported only when a drain fault fires

    ray_compat.drain_node_for_preemption(ray.get_runtime_context().get_node_id(), message, deadline_s=60.0)
