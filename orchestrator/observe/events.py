"""The run's event stream: ``RUN_DIR/events.jsonl`` and everything that listens to it.

Runs on the driver. The controller emits one event per thing that happened; the event log
writes it as one JSON line and hands it to every subscriber (metrics, progress bar), so the
file, Prometheus and the terminal can never disagree.

The schema below is a contract with dashboards, ``meshpilot report`` and users' scripts:
add fields freely (declare them in ``OPTIONAL_FIELDS``), never rename or drop one.
``EventLog.emit`` refuses an event whose name is not declared or that lacks a required field
(a programming error: the tests that drive the emitting code catch it).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from checkpointing.commit import MESH_CHANGED
from orchestrator.observe.redact import redact

# Every event has ``event`` (its name) and ``time`` (unix seconds); these required fields come
# on top (a field may be None where the emitter has no value, but it is always there).
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "start": ("run_dir", "name", "mesh", "world_size", "steps", "global_batch", "seq_len", "config_hash"),
    "step": ("step", "loss", "tokens", "step_time_s", "world_size", "mesh", "lr", "rank_step_time_s"),
    # The ranks evaluated the model after ``step`` (0: before step 1): the mean token loss over
    # ``tokens`` tokens of the fixed evaluation samples, in ``eval_s`` seconds.
    "eval": ("step", "loss", "tokens", "eval_s"),
    "checkpoint_staged": ("step", "stall_s"),
    "checkpoint_committed": ("step", "uri", "bytes", "upload_s"),
    "checkpoint_failed": ("step", "error"),
    "restored": ("step", "uri", "from_mesh", "to_mesh", "restore_s"),
    "failure": ("kind", "ranks", "node", "message"),
    "recovered": ("mttr_s", "lost_steps", "old_mesh", "new_mesh"),
    "drain": ("node", "ranks", "reason"),
    # A rank's compute phase took over elastic.straggler.factor x its peers' median in window_steps
    # steps (all but one) up to ``step`` (``factor``: the median ratio of the window), and what was
    # done (warn, replace, exclude; ``reason`` when a replace or exclude could only warn).
    "straggler": ("rank", "node", "factor", "step", "action"),
    "grow": ("new_mesh", "added_ranks", "join_s"),
    "log": ("rank", "level", "message"),
    # A rank filled its slices from released weights (model.init_from): bytes it fetched of all.
    "pretrained_loaded": ("rank", "uri", "bytes_read", "bytes_total", "seconds"),
    # Periodic liveness from the detector, {rank: seconds since that rank's last heartbeat}.
    "heartbeat": ("rank_age_s",),
    "done": ("status", "steps", "elapsed_s"),
    # The faults the run was given (--inject, --chaos), as --inject takes them; seed: the
    # --chaos seed that drew them (None for --inject alone).
    "fault_schedule": ("seed", "faults"),
    # Host memory the peer-memory snapshots take per rank ({rank: bytes}) in a generation, the
    # largest of them and elastic.snapshot_memory_limit_mb in bytes.
    "snapshot_memory": ("generation", "bytes_per_rank", "max_bytes", "limit_bytes"),
    # Peer-memory snapshots are taken every interval_steps steps from here on: cost_steps, what
    # the loop waits for one snapshot (in steps, the slowest rank's, a median), against
    # overhead_limit (elastic.snapshot_overhead_limit; elastic/snapshot_cadence.py).
    "snapshot_interval": ("generation", "step", "interval_steps", "cost_steps", "overhead_limit"),
    # runtime.survive_driver_loss: this driver took over the live ranks a dead driver left, at
    # step (the dead driver's record ends at recorded_step; the ranks' queued reports fill the gap).
    "adopted": ("generation", "step", "recorded_step", "world_size", "lost_steps", "adopt_s"),
    # runtime.survive_driver_loss: no live ranks to adopt (reason); the run resumes from source
    # (checkpoint: at step; fresh).
    "adoption": ("adopted", "reason", "source", "step"),
}

# Fields the driver adds on top; readers must treat them as possibly absent (older runs, fakes).
OPTIONAL_FIELDS: dict[str, tuple[str, ...]] = {
    # completed_at: the slowest rank's clock when the step ended; loss_partial / reported_ranks
    # only when a rank died between applying the step and reporting it; phases_s: per phase of
    # the step, the longest any rank spent in it.
    # expert_load_max_over_mean: a mixture of experts' load per layer, the most uneven slice's.
    # trained_tokens: the labels the loss is the mean over (fewer than tokens on masked or packed data).
    "step": (
        "grad_norm",
        "completed_at",
        "loss_partial",
        "reported_ranks",
        "phases_s",
        "expert_load_max_over_mean",
        "trained_tokens",
    ),
    # reason: storage (uploads gave up) | interrupted (the mesh changed before every rank reported)
    "checkpoint_failed": ("reason",),
    # details: {rank: traceback} behind the one-line message
    "failure": ("details",),
    # cause: failure | restore | drain | grow; refilled_ranks: ranks rebuilt from warm actors;
    # source: where ranks without the state took it (replica | peer_memory | storage)
    "recovered": ("cause", "refilled_ranks", "source"),
    "grow": ("old_mesh", "source"),
    # source: peer_memory | storage; bytes_from_peers: what the ranks read from other ranks' memory
    "restored": ("source", "bytes_from_peers"),
    # logger: the rank's logger that wrote the record
    "log": ("logger",),
    # replicas_consistent: with several replica groups, whether they ended bitwise identical
    "done": ("reason", "replicas_consistent"),
}


# Why a ``checkpoint_failed`` happened: the object store gave up, or a change of mesh (failure,
# drain, grow) dropped a save whose shards were not all durable yet.
CHECKPOINT_FAILURE_REASONS = ("storage", "interrupted")


def checkpoint_failure_reason(event: dict[str, Any]) -> str:
    """``interrupted`` when a mesh change dropped the save, else ``storage`` (gave up after retries).

    The driver says so in the event's ``reason``; runs recorded before it did are told apart
    by the coordinator's wording.
    """
    if event.get("reason") in CHECKPOINT_FAILURE_REASONS:
        return event["reason"]
    return "interrupted" if MESH_CHANGED in str(event.get("error") or "") else "storage"


def is_failure_recovery(event: dict[str, Any]) -> bool:
    """A ``recovered`` event that ends a failure (in place, or by a restore), not a planned pause.

    The controller also reports the end of a drain's pause (``cause: drain``) and of a grow's
    pause that ended without growing (``cause: grow``) as ``recovered``.
    """
    return event.get("event") == "recovered" and str(event.get("cause") or "failure") not in ("drain", "grow")


class EventSubscriber(Protocol):
    def on_event(self, event: dict[str, Any]) -> None: ...


class EventLog:
    """Appends events to ``events.jsonl`` and fans them out to subscribers (driver only)."""

    def __init__(
        self,
        path: Path | None,
        subscribers: list[EventSubscriber] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.subscribers = list(subscribers or [])
        self._clock = clock
        self._lock = threading.Lock()
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8", buffering=1)  # line-buffered: tail -f works

    def subscribe(self, subscriber: EventSubscriber) -> None:
        self.subscribers.append(subscriber)

    def emit(self, name: str, /, **fields: Any) -> dict[str, Any]:
        """Write one event and hand it to every subscriber; raises ValueError for an undeclared
        event name or a missing required field (see ``EVENT_FIELDS``)."""
        check_event(name, fields)
        event = {"event": name, "time": round(self._clock(), 6), **redact(fields)}
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(event, default=_json_default) + "\n")
            for subscriber in self.subscribers:
                subscriber.on_event(event)
        return event

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def check_event(name: str, fields: dict[str, Any]) -> None:
    """Raise ValueError naming the event and the field when ``fields`` break the declared schema."""
    if name not in EVENT_FIELDS:
        raise ValueError(f"unknown event {name!r}; declare it in EVENT_FIELDS")
    missing = [field for field in EVENT_FIELDS[name] if field not in fields]
    if missing:
        raise ValueError(
            f"event {name!r} lacks required field(s) {', '.join(map(repr, missing))} "
            "(see EVENT_FIELDS in orchestrator/observe/events.py)"
        )


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events of a run, in order; a torn last line (killed driver) is ignored."""
    events = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def _json_default(value: Any) -> Any:
    if hasattr(value, "as_dict"):
        return value.as_dict()
    if isinstance(value, (set, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to events.jsonl")
