"""Values that cross the Ray boundary between the driver and a rank actor, in both directions.

Declared once, imported by both sides: the driver never imports ``workers/actor.py`` for a
type, and no side parses the other's message text to learn what happened. Every value here is
a ``StrEnum`` member or a frozen dataclass; a ``StrEnum`` member equals its string value, so
events and logs written with them read as before.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from checkpointing.manifest import Manifest
from checkpointing.spec import ChunkEntry, FailureReport, ShardReport, TensorEntry


class RunStatus(StrEnum):
    """How a rank's ``run`` call ended."""

    FINISHED = "finished"  # reached the last step
    PAUSED = "paused"  # left at a step boundary the driver asked for (drain, grow, termination)
    ABORTED = "aborted"  # the driver vetoed the step in flight
    FAILED = "failed"  # an error ended the loop: see ``RunOutcome.failure_kind``
    STOPPED = "stopped"  # the driver asked the loop to stop (Ctrl-C)


class StartMode(StrEnum):
    """Where ``configure`` takes the new trainer's state from."""

    FRESH = "fresh"  # seeded initialisation, step 0
    KEPT = "kept"  # the slices this process kept from the previous generation
    PEER = "peer"  # broadcast from replica group 0 of the new mesh
    CHECKPOINT = "checkpoint"  # a committed checkpoint, resharded to this mesh
    MEMORY = "memory"  # a peer-memory snapshot held by the ranks, resharded to this mesh


class FailureKind(StrEnum):
    """Why a rank-side call failed; set where the failure is raised or first caught."""

    PEER_FAILURE = "peer_failure"  # a consequence of another rank's failure (its connection closed)
    OWN_ERROR = "own_error"  # this rank's own error (a bug, a bad input)
    OUT_OF_MEMORY = "out_of_memory"  # this rank's device ran out of memory (torch.OutOfMemoryError)
    TIMEOUT = "timeout"  # this rank's own wait (a collective, the commit vote) timed out
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"  # a checksum mismatch while restoring
    STORAGE = "storage"  # object storage refused or could not be reached
    INJECTED = "injected"  # a fault injected on purpose (``--inject raise@STEP``)


# The kinds' string values, as ``checkpointing/`` errors declare them (see ``failure_kind_of``).
_FAILURE_KIND_VALUES = frozenset(kind.value for kind in FailureKind)


class Phase(StrEnum):
    """What a rank is doing, as its heartbeat says."""

    STARTING = "starting"
    CONFIGURING = "configuring"
    READY = "ready"
    STEP = "step"
    EVAL = "eval"  # evaluating at a step boundary (collective, like a step)
    CHECKPOINT = "checkpoint"
    FINISHED = "finished"
    PAUSED = "paused"
    ABORTED = "aborted"
    FAILED = "failed"
    STOPPED = "stopped"
    SHUTDOWN = "shutdown"


def failure_kind_of(error: BaseException) -> FailureKind:
    """The kind an exception class declares (``failure_kind = FailureKind.X``), else
    OUT_OF_MEMORY for torch's ``OutOfMemoryError``, else OWN_ERROR.

    Runs on the driver (a remote call's exception, unpickled) and on ranks. ``checkpointing/``
    cannot import this module (imports go workers -> checkpointing), so its errors declare the
    kind's string value; it is read here as the member of that value. torch's OOM declares
    nothing; it is recognised by type, through ``sys.modules`` so that this module stays
    importable without torch (an OOM exists only where torch is already loaded).
    """
    kind = getattr(error, "failure_kind", None)
    if isinstance(kind, str) and kind in _FAILURE_KIND_VALUES:
        return FailureKind(kind)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, torch.OutOfMemoryError):
        return FailureKind.OUT_OF_MEMORY
    return FailureKind.OWN_ERROR


class NoticeScope(StrEnum):
    """What a drain notice announces the end of."""

    NODE = "node"  # the machine: a cloud instance-action notice
    PROCESS = "process"  # this rank's process only: SIGTERM


class ReportKind(StrEnum):
    """What a rank report is about; the driver's ``ReportRouter`` dispatches on it."""

    STEP = "step"  # the rank applied a step
    LOG = "log"  # a log record of the rank
    CHECKPOINT_UPLOAD = "checkpoint"  # one of the rank's checkpoint uploads is durable, or was given up
    DRAIN_NOTICE = "drain_notice"  # the rank's node (spot notice) or process (SIGTERM) is about to go away
    PRETRAINED_LOAD = "pretrained_load"  # the rank loaded its slices of released weights
    EVAL = "eval"  # the ranks evaluated the model at a step boundary
    SNAPSHOT_LAYOUT = "snapshot_layout"  # where a rank's peer-memory snapshots hold each slice
    SNAPSHOT = "snapshot"  # a rank's snapshot of a step is in its memory and its buddy's
    MEMORY_RESTORE = "memory_restore"  # a rank filled its state from peer-memory snapshots


@dataclass(frozen=True)
class CompileCounts:
    """What a rank's inductor did during one step (``training.compile``): graphs it compiled, and
    graphs it loaded from the job's caches instead."""

    compiled: int = 0
    cache_hits: int = 0

    def __add__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(self.compiled + other.compiled, self.cache_hits + other.cache_hits)

    def __bool__(self) -> bool:
        return bool(self.compiled or self.cache_hits)


@dataclass(frozen=True)
class StepReport:
    """Sent by every rank after each step it applied (loop thread)."""

    rank: int
    time: float  # the rank's clock when it finished the step
    step: int
    loss: float | None  # None where this rank holds no loss (not the last pipeline stage)
    dp_rank: int
    step_time_s: float
    lr: float | None = None
    grad_norm: float | None = None
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase of the step
    checkpoint_stall_s: float | None = None  # set on steps that staged a checkpoint
    # With data.record_samples: the global sample indices this rank's data-parallel slice consumed.
    sample_indices: tuple[int, ...] | None = None
    # A mixture of experts: per layer this rank holds, the busiest expert's tokens over the mean's.
    expert_load: dict[str, float] = field(default_factory=dict)
    # Labels of the step's whole global batch that trained (the same on every rank of the step).
    trained_tokens: int | None = None
    # training.compile: what this rank compiled and loaded from the caches during the step.
    compiled: CompileCounts | None = None
    kind: ReportKind = ReportKind.STEP


@dataclass(frozen=True)
class LogReport:
    """One log record of level INFO or above, forwarded from the rank's ``meshpilot`` loggers."""

    rank: int
    time: float
    level: str  # lower case: info, warning, error
    logger: str
    message: str
    kind: ReportKind = ReportKind.LOG


@dataclass(frozen=True)
class CheckpointUploadReport:
    """A rank's checkpoint upload of one step ended (uploader thread): its shards are durable
    (``ShardReport``) or it gave up (``FailureReport``); the driver's commit coordinator reads it.
    ``generation``: the one that saved it (the upload may end after the next one began)."""

    rank: int
    time: float
    upload: ShardReport | FailureReport
    generation: int = 0
    kind: ReportKind = ReportKind.CHECKPOINT_UPLOAD


@dataclass(frozen=True)
class DrainNoticeReport:
    """Something of the rank is about to go away; sent once per rank.

    ``scope`` says what: the whole node (a cloud instance-action notice) or only this rank's
    process (SIGTERM: a signal to one process says nothing of its neighbours).
    """

    rank: int
    time: float
    reason: str
    scope: NoticeScope = NoticeScope.NODE
    kind: ReportKind = ReportKind.DRAIN_NOTICE


@dataclass(frozen=True)
class PretrainedLoadReport:
    """The rank filled its slices of the model from released weights (``model.init_from``)."""

    rank: int
    time: float
    uri: str
    bytes_read: int  # what this rank fetched: about its own share, not the whole files
    bytes_total: int  # the size of every tensor the model reads, for comparison
    seconds: float
    kind: ReportKind = ReportKind.PRETRAINED_LOAD


@dataclass(frozen=True)
class EvalReport:
    """The ranks evaluated the model after ``step`` (0: before step 1); sent by rank 0 only, since
    every rank holds the same reduced result (see ``workers/evaluation.py``)."""

    rank: int
    time: float
    step: int
    loss: float  # mean token cross entropy over the evaluation samples
    tokens: int  # tokens it is the mean over
    eval_s: float
    kind: ReportKind = ReportKind.EVAL


@dataclass(frozen=True)
class SnapshotLayoutReport:
    """How a rank lays out its peer-memory snapshots in one generation (sent once, when it
    joins the generation): every snapshot of the generation has this layout, so the driver can describe any
    of them to a reader. ``chunks`` carry no key (each snapshot's is ``snapshot_key``) and no
    checksums (memory is not verified like storage)."""

    rank: int
    time: float
    generation: int
    buddy_rank: int | None  # the rank that holds a copy of each snapshot (None: no copy)
    bytes: int  # one snapshot of this rank
    tensors: tuple[TensorEntry, ...]
    chunks: tuple[ChunkEntry, ...]
    kind: ReportKind = ReportKind.SNAPSHOT_LAYOUT


@dataclass(frozen=True)
class SnapshotReport:
    """A rank's snapshot of ``step`` is in its own memory and, when ``copied``, its buddy's.

    ``cost_steps``: what the snapshot cost this rank's loop, in units of its step time: the
    stall starting it and the wait for its copies (to host memory, to the buddy) before the next
    step's update (``workers/peer_snapshots.py``); 0 in the buddy's report of its copy.
    """

    rank: int
    time: float
    generation: int
    step: int
    copied: bool
    cost_steps: float = 0.0
    kind: ReportKind = ReportKind.SNAPSHOT


@dataclass(frozen=True)
class MemoryRestoreReport:
    """A rank filled its state from a peer-memory snapshot: bytes from its own process and from peers."""

    rank: int
    time: float
    step: int
    bytes_local: int
    bytes_remote: int
    seconds: float
    kind: ReportKind = ReportKind.MEMORY_RESTORE


RankReport = (
    StepReport
    | LogReport
    | CheckpointUploadReport
    | DrainNoticeReport
    | PretrainedLoadReport
    | EvalReport
    | SnapshotLayoutReport
    | SnapshotReport
    | MemoryRestoreReport
)


@dataclass(frozen=True)
class SnapshotPlan:
    """A rank's peer-memory snapshots in one generation: every ``interval_steps`` steps, and
    a copy sent to ``buddy`` (the actor holding rank ``buddy_rank``, on another node when the
    cluster has one; None when the world has one rank)."""

    interval_steps: int
    buddy_rank: int | None = None
    buddy: Any = None  # the buddy's actor handle
    memory_limit_bytes: int | None = None  # refuse snapshots needing more host memory per rank


@dataclass(frozen=True)
class MemorySource:
    """A peer-memory snapshot to restore from: its index, and which actors hold each object
    (``holders[key]``, best first: the owner, then its buddy)."""

    manifest: Manifest
    holders: dict[str, tuple[Any, ...]]


@dataclass(frozen=True)
class StartFrom:
    """How ``configure`` fills the new trainer's state.

    ``FRESH``: seeded initialisation (step 0). ``KEPT``: rebind the slices this process kept
    from the previous generation. ``PEER``: receive them from replica group 0 of the new mesh
    (every rank of such a generation is configured with ``sync_replicas=True``).
    ``CHECKPOINT``: load committed checkpoint ``step`` from storage, resharded to this mesh.
    ``MEMORY``: load the peer-memory snapshot ``memory`` (of ``step``), resharded to this mesh.
    """

    mode: StartMode = StartMode.FRESH
    step: int = 0
    memory: MemorySource | None = None


@dataclass(frozen=True)
class RunOutcome:
    """What a rank's ``run`` call returns (it never raises)."""

    status: RunStatus
    last_step: int  # the last step whose optimizer update this rank applied
    error: str | None = None  # the traceback's last frames, for whoever debugs it
    error_type: str | None = None  # the exception's class name
    failure_kind: FailureKind | None = None  # set when status is FAILED
    # Fingerprint of the rank's state when it finished or paused (see Trainer.state_digest).
    state_digest: str | None = None

    @property
    def caused_by_peer(self) -> bool:
        """The error is a consequence of another rank's failure: this rank is a survivor."""
        return self.failure_kind == FailureKind.PEER_FAILURE


@dataclass(frozen=True)
class Heartbeat:
    """A rank's answer to ``poll()``: where it is, and the reports queued since the last poll."""

    rank: int
    phase: Phase
    step: int
    phase_age_s: float
    reports: tuple[RankReport, ...] = ()
    # In a step: is the loop blocked waiting for other ranks (a collective, the commit vote)?
    # A rank busy in a step that everyone else waits on is the one that hangs.
    waiting: bool | None = None
    where: str | None = None


@dataclass(frozen=True)
class LiveRank:
    """A detached rank actor's answer to a driver that adopts it (``runtime.survive_driver_loss``):
    its place in the generation it last ran, and whether it holds that generation's state at a
    step boundary (paused, its slices kept), ready for ``configure(start=kept)``."""

    rank: int
    generation: int
    mesh: dict[str, Any] | None  # MeshSpec.as_dict()
    last_step: int
    phase: Phase
    holds_state: bool


@dataclass(frozen=True)
class DriverRecord:
    """What the rendezvous store's actor keeps of the driver that renews its lease: the run's
    config (YAML), record directory, and the generation and step it had last reached."""

    config_yaml: str
    run_dir: str | None
    generation: int
    last_step: int
