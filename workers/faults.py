"""Deterministic fault injection, keyed by (rank, step): a feature, not a test hack.

``--inject KIND@STEP[:RANK][/PHASE]`` (``slow@STEP:RANK[:FACTOR]``; repeatable) on ``meshpilot train``,
or ``FaultSpec`` values in tests. The driver keeps the faults not consumed yet (``DriverFaults``) and
hands each generation those still ahead of it; a rank fires a fault at the start of step STEP when its
rank in the current mesh is RANK (default 0), so the same fault hits the same place in every
run. With ``/configure`` (kill and raise only) it fires instead while a mesh that resumes at
step STEP is being configured, after the rank filled its state: a fault during a recovery, a
grow or a restore when one happens there, and nothing otherwise; ``/join`` (kill only) fires
earlier in that configuration, once every rank passed the join barrier and before the process
groups exist, where peers wait in torch's rendezvous, out of reach of an abort. Kinds fired on the rank side
(``FaultInjector``, in the rank actor):

    kill        SIGKILL this rank's process (a crashed process, an OOM kill)
    raise       raise an exception in the step (a software error)
    hang        stop making progress inside the step (a deadlock, a stuck device)
    drain       ask Ray to drain this rank's node, as a spot reclaim or autoscaler would
    sigterm     send SIGTERM to this rank's process, as a pod's termination does
    s3_outage   make every storage request of this rank fail for STORAGE_OUTAGE_S seconds
    slow        from STEP on, this rank's compute phase takes FACTOR (default SLOW_FACTOR) times as
                long: a throttled device or a noisy neighbour. It stays with the process (a
                later generation's rank on it is slow too; a replacement is not)

and on the driver side (``DriverFaults``, in the controller):

    driver      SIGKILL the driver itself once STEP has completed (resume from storage)
    node        remove the Ray node of RANK (only under a multi-node test cluster)

and, on the driver side too, network faults (``NetworkFault``, only under a separate-network
test cluster: tests/fixtures/netns_nodes.py; NODE is a worker node's index there, 0 for the
first node added, never reused):

    partition@STEP:NODE[:SECONDS]      drop every packet to and from NODE, restored after SECONDS
                                       (default PARTITION_S)
    throttle@STEP:NODE:MBIT            cap NODE's link at MBIT Mbit/s each way (a slow link)
    netem@STEP:NODE:DELAY_MS[:LOSS]    delay (and lose LOSS percent of) NODE's packets: needs the
                                       kernel's sch_netem module, refused where it is missing
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from workers.spec.messages import FailureKind

log = logging.getLogger("meshpilot")


class FaultKind(StrEnum):
    """What an injected fault does; see the module docstring."""

    KILL = "kill"
    RAISE = "raise"
    HANG = "hang"
    DRAIN = "drain"
    SIGTERM = "sigterm"
    S3_OUTAGE = "s3_outage"
    DRIVER = "driver"
    NODE = "node"
    SLOW = "slow"
    PARTITION = "partition"
    THROTTLE = "throttle"
    NETEM = "netem"


RANK_KINDS = (
    FaultKind.KILL,
    FaultKind.RAISE,
    FaultKind.HANG,
    FaultKind.DRAIN,
    FaultKind.SIGTERM,
    FaultKind.S3_OUTAGE,
    FaultKind.SLOW,
)
# A slow fault's compute factor when none is given: clearly a straggler at any sane threshold.
SLOW_FACTOR = 4.0
# How long an injected storage outage lasts: long enough to exhaust the writer's retries.
STORAGE_OUTAGE_S = 8.0
NETWORK_KINDS = (FaultKind.PARTITION, FaultKind.THROTTLE, FaultKind.NETEM)
DRIVER_KINDS = (FaultKind.DRIVER, FaultKind.NODE, *NETWORK_KINDS)
KINDS = RANK_KINDS + DRIVER_KINDS
# How long a partition lasts when its fault does not say: past the driver's detection and
# recovery, short of Ray's own verdict on a default cluster (5 missed health checks, 3 s apart).
PARTITION_S = 10.0


class FaultPhase(StrEnum):
    """When a rank fault fires: at the start of its step, while a mesh resuming there is
    configured (once the rank filled its state, or as it joins: past the join barrier, before
    the process groups are built, so peers wait in torch's rendezvous), or while the rank's
    peer-memory snapshot of the step is copied to its buddy."""

    STEP = "step"
    CONFIGURE = "configure"
    JOIN = "join"
    SNAPSHOT = "snapshot"


# The kinds that can fire while configuring (a hang there would be a start-up timeout, not a hang).
CONFIGURE_KINDS = (FaultKind.KILL, FaultKind.RAISE)
# The kinds each phase other than STEP takes.
PHASE_KINDS = {
    FaultPhase.CONFIGURE: CONFIGURE_KINDS,
    FaultPhase.JOIN: (FaultKind.KILL,),
    FaultPhase.SNAPSHOT: (FaultKind.KILL,),
}
# The phases that fire while a mesh is configured: a failure there leaves the step's faults armed.
CONFIGURING_PHASES = (FaultPhase.CONFIGURE, FaultPhase.JOIN)


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws inside the step."""

    failure_kind = FailureKind.INJECTED


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    step: int
    rank: int = 0  # for a network kind: the worker node's index
    phase: FaultPhase = FaultPhase.STEP
    # A network kind's numbers after NODE (seconds; Mbit/s; delay ms and loss percent).
    values: tuple[float, ...] = ()
    # slow: how many times as long the rank's compute phase takes (> 1); 0 for the other kinds.
    factor: float = 0.0

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``KIND@STEP[:RANK][/PHASE]`` -> FaultSpec; ValueError naming what is wrong."""
        kind, at, where = text.partition("@")
        if not at or kind not in KINDS:
            raise ValueError(
                f"--inject {text!r}: expected KIND@STEP[:RANK][/PHASE] with KIND one of {', '.join(KINDS)}"
            )
        if kind in NETWORK_KINDS:
            return _parse_network(text, FaultKind(kind), where)
        where, slash, phase_text = where.partition("/")
        phase = FaultPhase(phase_text) if phase_text in PHASE_KINDS else FaultPhase.STEP
        if slash and (phase == FaultPhase.STEP or kind not in PHASE_KINDS[phase]):
            raise ValueError(
                f"--inject {text!r}: the phases are /configure (for {' and '.join(CONFIGURE_KINDS)}, e.g. "
                "kill@5:1/configure), /join (for kill: as a configured mesh's process groups are built, e.g. "
                "kill@5:1/join) and /snapshot (for kill: while the step's peer-memory snapshot is copied, "
                "e.g. kill@5:1/snapshot)"
            )
        step_text, _, rank_text = where.partition(":")
        factor = 0.0
        if kind == FaultKind.SLOW:
            rank_text, _, factor_text = rank_text.partition(":")
            factor = _slow_factor(text, factor_text)
        try:
            step = int(step_text)
            rank = int(rank_text) if rank_text else 0
        except ValueError:
            raise ValueError(f"--inject {text!r}: STEP and RANK must be integers, e.g. kill@5:1") from None
        if step < 1 or rank < 0:
            raise ValueError(f"--inject {text!r}: STEP must be >= 1 and RANK >= 0")
        return cls(FaultKind(kind), step, rank, phase, factor=factor)

    def describe(self) -> str:
        suffix = f"/{self.phase}" if self.phase != FaultPhase.STEP else ""
        values = "".join(f":{value:g}" for value in self.values)
        if self.kind == FaultKind.SLOW:
            values = f":{self.factor:g}"
        return f"{self.kind}@{self.step}:{self.rank}{values}{suffix}"

    def network(self) -> NetworkFault:
        """This network fault as the harness's callable takes it."""
        values = self.values
        if self.kind == FaultKind.PARTITION:
            return NetworkFault(NetworkFaultKind.PARTITION, self.rank, seconds=values[0] if values else PARTITION_S)
        if self.kind == FaultKind.THROTTLE:
            return NetworkFault(NetworkFaultKind.THROTTLE, self.rank, mbit=values[0])
        return NetworkFault(
            NetworkFaultKind.NETEM, self.rank, delay_ms=values[0], loss_percent=values[1] if len(values) > 1 else 0.0
        )


class NetworkFaultKind(StrEnum):
    PARTITION = "partition"
    THROTTLE = "throttle"
    NETEM = "netem"


@dataclass(frozen=True)
class NetworkFault:
    """What the driver asks the separate-network test cluster to do to worker node ``node``
    (its index there): cut it off for ``seconds``, cap its link at ``mbit``, or delay and lose
    its packets (``delay_ms``, ``loss_percent``)."""

    kind: NetworkFaultKind
    node: int
    seconds: float = 0.0
    mbit: float = 0.0
    delay_ms: float = 0.0
    loss_percent: float = 0.0


# The numbers each network kind takes after NODE: (required, optional), and its form for messages.
_NETWORK_FORMS = {
    FaultKind.PARTITION: (0, 1, "partition@STEP:NODE[:SECONDS], e.g. partition@6:1:10"),
    FaultKind.THROTTLE: (1, 0, "throttle@STEP:NODE:MBIT, e.g. throttle@6:1:5"),
    FaultKind.NETEM: (1, 1, "netem@STEP:NODE:DELAY_MS[:LOSS], e.g. netem@6:1:50:1"),
}


def _parse_network(text: str, kind: FaultKind, where: str) -> FaultSpec:
    """``STEP:NODE[:NUMBERS]`` of a network kind; ValueError naming the form."""
    required, optional, form = _NETWORK_FORMS[kind]
    parts = where.split(":")
    try:
        step, node = int(parts[0]), int(parts[1])
        values = tuple(float(part) for part in parts[2:])
    except (ValueError, IndexError):
        raise ValueError(f"--inject {text!r}: expected {form} (integers STEP and NODE, numbers after)") from None
    if not required <= len(values) <= required + optional:
        raise ValueError(f"--inject {text!r}: expected {form}")
    if step < 1 or node < 0:
        raise ValueError(f"--inject {text!r}: STEP must be >= 1 and NODE (a worker node's index) >= 0")
    if kind == FaultKind.NETEM:
        if values[0] < 0 or (len(values) > 1 and not 0 <= values[1] <= 100):
            raise ValueError(f"--inject {text!r}: DELAY_MS must be >= 0 and LOSS a percentage from 0 to 100")
    elif any(value <= 0 for value in values):
        raise ValueError(f"--inject {text!r}: {'SECONDS' if kind == FaultKind.PARTITION else 'MBIT'} must be > 0")
    return FaultSpec(kind, step, node, values=values)


def _slow_factor(text: str, factor_text: str) -> float:
    """A slow fault's FACTOR (SLOW_FACTOR when absent); ValueError unless a number > 1."""
    if not factor_text:
        return SLOW_FACTOR
    try:
        factor = float(factor_text)
    except ValueError:
        factor = 0.0
    if not factor > 1:
        raise ValueError(
            f"--inject {text!r}: FACTOR must be a number > 1 (how many times as long the rank's compute takes), "
            "e.g. slow@5:1:4"
        )
    return factor


# How long a rank about to kill itself (an injected kill) waits for the driver to poll the
# reports it queued: the driver polls every 0.25 s, so this is many polls, and still bounded.
REPORTS_BEFORE_KILL_S = 5.0


def kill_this_process() -> None:
    """SIGKILL: no handler, no cleanup, exactly as a crash or the OOM killer ends a process."""
    os.kill(os.getpid(), signal.SIGKILL)


class DriverFaults:
    """Driver side: the faults not consumed yet, and the firing of the driver's own kinds.

    Runs in the controller. Rank kinds are handed to each generation's ranks
    (``for_generation``); ``driver`` and ``node`` faults fire here the moment their step is
    known to have completed (``fire``). A failure consumes the faults of the step it
    interrupted, so a redo of that step does not fire them again. ``node_of`` gives the node of
    a rank of the current mesh; ``remove_node`` (only under a multi-node test cluster) removes
    one, and without it node faults are consumed without effect. ``network_fault`` (only under a
    separate-network test cluster) carries out partitions and slow links, likewise.
    """

    def __init__(
        self,
        faults: Iterable[FaultSpec] = (),
        *,
        node_of: Callable[[int], str | None] = lambda rank: None,
        remove_node: Callable[[str], None] | None = None,
        network_fault: Callable[[NetworkFault], None] | None = None,
    ) -> None:
        self.pending = list(faults)
        self.node_of = node_of
        self.remove_node = remove_node
        self.network_fault = network_fault

    def for_generation(self, after_step: int) -> tuple[FaultSpec, ...]:
        """The faults a generation that resumes after ``after_step`` may still meet."""
        return tuple(fault for fault in self.pending if fault.step > after_step)

    def fire(self, last_step: int, kill_driver: Callable[[], None] = kill_this_process) -> None:
        """Fire every driver-side fault whose step (``<= last_step``) has completed, once."""
        for fault in [f for f in self.pending if f.kind in DRIVER_KINDS]:
            if last_step < fault.step:
                continue
            self.pending.remove(fault)
            if fault.kind == FaultKind.DRIVER:
                log.warning("firing injected fault %s: killing the driver", fault.describe())
                kill_driver()
            elif fault.kind in NETWORK_KINDS:
                if self.network_fault is not None:
                    log.warning("firing injected fault %s", fault.describe())
                    self.network_fault(fault.network())
            elif self.remove_node is not None and (node := self.node_of(fault.rank)) is not None:
                log.warning("firing injected fault %s", fault.describe())
                self.remove_node(node)

    def consume_after_failure(self, last_completed_step: int, *, configuring: bool = False) -> None:
        """A generation failed after ``last_completed_step`` (``configuring``: while it was
        configured): the faults it fired are spent. Configure faults of the step it would have
        run stay armed for the recovery's own configuration, unless that is what failed."""
        redo = last_completed_step + 1
        self.pending = [
            fault
            for fault in self.pending
            if fault.step > redo or (fault.step == redo and fault.phase in CONFIGURING_PHASES and not configuring)
        ]


class FaultInjector:
    """Rank side: fires this generation's faults for this rank at the start of their step."""

    def __init__(
        self,
        faults: tuple[FaultSpec, ...],
        *,
        rank: int,
        on_fire: Callable[[FaultSpec], None] | None = None,
        before_kill: Callable[[], object] | None = None,
        slowdown: float = 1.0,
    ) -> None:
        """``on_fire(fault)`` runs as a fault fires; ``before_kill()`` just before a kill ends the
        process (the actor waits there until the driver has polled this rank's queued reports).
        ``slowdown``: the factor a slow fault of an earlier generation left on this process."""
        self.faults = [f for f in faults if f.rank == rank and f.kind in RANK_KINDS]
        self.on_fire = on_fire
        self.before_kill = before_kill
        self.storage_outage_until = 0.0
        # How many times as long this process's compute phase takes (a fired slow fault).
        self.slowdown = slowdown

    def after_compute(self, began: float, sync: Callable[[], None]) -> None:
        """On the rank's loop thread, right after a step's forward and backward, which began at
        ``began`` (``time.perf_counter``): a slowed process waits for its device (``sync``: on a GPU
        the work is queued, not done) and takes (slowdown - 1) x as long again, so its compute
        phase lasts ``slowdown`` times as long while its peers wait for it in the next collective."""
        if self.slowdown > 1:
            sync()
            time.sleep((self.slowdown - 1) * (time.perf_counter() - began))

    def before_step(self, step: int) -> None:
        for fault in self.faults:
            if fault.step == step and fault.phase == FaultPhase.STEP:
                self._fire(fault)

    def while_configuring(self, step: int) -> None:
        """Inside ``configure``, once the state is filled: the faults of a mesh resuming at ``step``."""
        for fault in self.faults:
            if fault.step == step and fault.phase == FaultPhase.CONFIGURE:
                self._fire(fault)

    def while_joining(self, step: int) -> None:
        """Inside ``configure``, past the join barrier: the join faults of a mesh resuming at ``step``."""
        for fault in self.faults:
            if fault.step == step and fault.phase == FaultPhase.JOIN:
                self._fire(fault)

    def while_snapshotting(self, step: int) -> None:
        """On the snapshot sender thread, while this rank's snapshot of ``step`` is copied to its buddy."""
        for fault in self.faults:
            if fault.step == step and fault.phase == FaultPhase.SNAPSHOT:
                self._fire(fault)

    def storage_down(self) -> bool:
        return time.monotonic() < self.storage_outage_until

    def _fire(self, fault: FaultSpec) -> None:
        if self.on_fire is not None:
            self.on_fire(fault)
        if fault.kind == FaultKind.KILL:
            # The driver must know every step this rank completed before it died: it consumes the
            # fault by the step the failure interrupted, and a kill that took queued step reports
            # along would look like one of an earlier step and fire again on the redo, forever.
            if self.before_kill is not None:
                self.before_kill()
            kill_this_process()
        elif fault.kind == FaultKind.RAISE:
            raise InjectedFault(f"injected fault {fault.describe()}")
        elif fault.kind == FaultKind.HANG:
            while True:  # never returns; the driver's hang detection must find and stop this rank
                time.sleep(3600)
        elif fault.kind == FaultKind.DRAIN:
            _drain_this_node(f"injected fault {fault.describe()}")
        elif fault.kind == FaultKind.SIGTERM:
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.kind == FaultKind.S3_OUTAGE:
            self.storage_outage_until = time.monotonic() + STORAGE_OUTAGE_S
        elif fault.kind == FaultKind.SLOW:
            self.slowdown = max(self.slowdown, fault.factor)


def _drain_this_node(message: str) -> None:
    """Tell Ray's GCS this node will be preempted, exactly as the autoscaler or a preStop hook does."""
    import ray

    from workers import ray_compat  # Ray's private modules: imported only when a drain fault fires

    ray_compat.drain_node_for_preemption(ray.get_runtime_context().get_node_id(), message, deadline_s=60.0)
