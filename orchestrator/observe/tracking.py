"""MLflow and Weights & Biases tracking of a run: an ``EventLog`` subscriber on the driver.

Runs on the driver only (the ranks know nothing of it), and only when ``tracking.mlflow`` or
``tracking.wandb`` is set. Usage (in ``run_training``)::

    tracker = build_tracker(config, run_dir)         # NullTracker when no tracking is configured
    event_log.subscribe(tracker)
    ...
    tracker.close()                                  # after events.jsonl and the logs are closed

What each backend is given (the same keys in both):

* at the start: the resolved config as parameters (flattened keys, ``training.lr``); the run is
  named after the run directory, and tagged with the config hash, the starting mesh and the run
  directory;
* per step, at that step: ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``step_time_s``,
  ``world_size``, and ``mfu`` when the device's peak is known (``metrics.device_peak_tflops``);
  per evaluation ``eval_loss`` at its step;
* each ``failure`` (value: ranks lost), ``recovered`` from a failure (its mttr_s), ``drain``
  (ranks drained), ``grow`` (ranks added) and ``restored`` (restore_s) as a metric of that name at
  the step the run had reached when it happened (the last step completed; a restore's is the
  checkpoint's step, where the run goes on from), plus a ``meshpilot.<kind>.<n>`` tag (W&B: a
  summary key) saying what happened;
* at the end: the run record (config.yaml, events.jsonl, logs/, whatever else RUN_DIR holds but
  W&B's own directory) as artifacts (W&B: one artifact of type ``run-record``), and the status
  (MLflow FINISHED, FAILED or KILLED; W&B the exit code).

It never fails or slows the run. ``on_event`` runs on the controller's thread and only turns the
event into records and appends them to each backend's bounded queue (when full the oldest record
is dropped and counted). One thread per backend sends what is queued, batched, so a slow or dead
server holds up nothing but its own queue. A failed send is logged once per backend (one warning
line) and retried with backoff; ``close()`` waits for the queues at most
``tracking.close_timeout_s`` altogether, then says at info level what was not sent. MLflow's own
HTTP retries are turned off and its request timeout shortened (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
``MLFLOW_HTTP_REQUEST_TIMEOUT``, unless the environment sets them), since this module retries.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from orchestrator.observe.events import is_failure_recovery
from orchestrator.observe.metric_names import peak_flops
from orchestrator.observe.redact import redact_text

if TYPE_CHECKING:
    from orchestrator.config import JobConfig, MlflowTrackingConfig, WandbTrackingConfig

log = logging.getLogger("meshpilot.tracking")

INSTALL_HINT = "pip install 'meshpilot[tracking]'"
# W&B keeps its run directory (offline-run-*, logs) under RUN_DIR/wandb: not part of the record it uploads.
WANDB_DIR = "wandb"
# The type of the W&B artifact that holds the run record (named run-record-<run id>).
WANDB_RECORD_TYPE = "run-record"
# Records a backend's queue holds before the oldest is dropped: ~10,000 steps of a run the
# server missed, a few MB of driver memory.
QUEUE_RECORDS = 10_000
# Records per send: MLflow's log_batch takes at most 1,000 metrics (a step has up to 8) and 100 tags.
BATCH_RECORDS = 100
FIRST_RETRY_S = 1.0
MAX_RETRY_S = 30.0
# While closing, the retries come this often: the close timeout bounds them.
CLOSING_RETRY_S = 0.5
# MLflow's defaults retry a request 7 times with backoff for minutes; the queue's retries replace them.
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
# The done event's status (orchestrator.driver.states.RunEnd) as MLflow's run status and W&B's exit code
# (the CLI's); a run without a done event (a driver that crashed) is failed.
MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED", "preempted": "KILLED"}
WANDB_EXIT_CODES = {"finished": 0, "failed": 1, "interrupted": 130, "preempted": 143}
WANDB_INIT_TIMEOUT_S = 30
# A marker's tag (a failure's message can carry a traceback's last line); MLflow takes up to 8,000.
TAG_CHARS = 1000
# An error's text cut to fit a log line.
ERROR_CHARS = 240


# ---------------------------------------------------------------------------- records
@dataclass(frozen=True)
class StepValues:
    """Metrics at one training step (``time``: unix seconds of the event)."""

    step: int
    time: float
    values: dict[str, float]


@dataclass(frozen=True)
class RunTags:
    """Text about the run: MLflow tags, W&B summary keys."""

    tags: dict[str, str]


@dataclass(frozen=True)
class EndOfRun:
    """The run is over: its status (the ``done`` event's, ``failed`` without one) and its record's files."""

    status: str
    run_dir: Path
    files: tuple[Path, ...]


Record = StepValues | RunTags | EndOfRun


class EventRecords:
    """Events -> tracking records (driver; pure, so the tests feed it recorded runs).

    Keeps the step the run has reached, where markers (failure, recovery, drain, grow, restore)
    are placed, and how many of each there were.
    """

    def __init__(self, *, flops_per_token: float | None = None, peak_flops_per_device: float | None = None) -> None:
        self._flops_per_token = flops_per_token
        self._peak_flops = peak_flops_per_device
        self.step = 0
        self.status: str | None = None
        self._counts: dict[str, int] = {}
        self._handlers: dict[str, Callable[[dict[str, Any]], list[Record]]] = {
            "start": self._start,
            "step": self._step,
            "eval": self._eval,
            "failure": self._failure,
            "recovered": self._recovered,
            "drain": self._drain,
            "grow": self._grow,
            "restored": self._restored,
            "done": self._done,
        }

    def records(self, event: dict[str, Any]) -> list[Record]:
        handler = self._handlers.get(str(event.get("event")))
        return handler(event) if handler is not None else []

    def _start(self, event: dict[str, Any]) -> list[Record]:
        return [
            RunTags(
                {
                    "meshpilot.config_hash": str(event.get("config_hash")),
                    "meshpilot.mesh": json.dumps(event.get("mesh")),
                    "meshpilot.world_size": str(event.get("world_size")),
                    "meshpilot.run_dir": str(event.get("run_dir")),
                }
            )
        ]

    def _step(self, event: dict[str, Any]) -> list[Record]:
        self.step = int(event["step"])
        seconds = event.get("step_time_s")
        tokens_per_s = event.get("tokens", 0) / seconds if seconds else None
        values = {
            "loss": event.get("loss"),
            "lr": event.get("lr"),
            "grad_norm": event.get("grad_norm"),
            "tokens_per_s": tokens_per_s,
            "step_time_s": seconds,
            "world_size": event.get("world_size"),
        }
        world_size = event.get("world_size")
        if tokens_per_s is not None and self._flops_per_token and self._peak_flops and world_size:
            values["mfu"] = tokens_per_s * self._flops_per_token / (world_size * self._peak_flops)
        return [self._at_step(event, values)]

    def _eval(self, event: dict[str, Any]) -> list[Record]:
        return [StepValues(int(event["step"]), float(event["time"]), _numbers({"eval_loss": event.get("loss")}))]

    def _failure(self, event: dict[str, Any]) -> list[Record]:
        ranks = list(event.get("ranks") or [])
        text = f"{event.get('kind')}: ranks {ranks} on node {event.get('node')}: {event.get('message')}"
        return self._marker(event, "failure", len(ranks), text)

    def _recovered(self, event: dict[str, Any]) -> list[Record]:
        if not is_failure_recovery(event):  # the end of a drain's or grow's pause: the drain/grow is the marker
            return []
        text = (
            f"in {event.get('mttr_s')} s, {event.get('lost_steps')} steps lost, "
            f"mesh {json.dumps(event.get('new_mesh'))} (state from {event.get('source') or 'replica'})"
        )
        return self._marker(event, "recovered", event.get("mttr_s"), text)

    def _drain(self, event: dict[str, Any]) -> list[Record]:
        ranks = list(event.get("ranks") or [])
        return self._marker(
            event, "drain", len(ranks), f"node {event.get('node')} ranks {ranks}: {event.get('reason')}"
        )

    def _grow(self, event: dict[str, Any]) -> list[Record]:
        added = list(event.get("added_ranks") or [])
        return self._marker(event, "grow", len(added), f"ranks {added} joined in {event.get('join_s')} s")

    def _restored(self, event: dict[str, Any]) -> list[Record]:
        self.step = int(event["step"])  # the run goes on from the checkpoint's step
        text = f"step {event['step']} from {event.get('uri')} ({event.get('source') or 'storage'})"
        return self._marker(event, "restored", event.get("restore_s"), text)

    def _done(self, event: dict[str, Any]) -> list[Record]:
        self.status = str(event.get("status"))
        return [RunTags({"meshpilot.status": self.status, "meshpilot.reason": str(event.get("reason") or "")})]

    def _marker(self, event: dict[str, Any], kind: str, value: Any, text: str) -> list[Record]:
        number = self._counts[kind] = self._counts.get(kind, 0) + 1
        return [
            self._at_step(event, {kind: value}),
            RunTags({f"meshpilot.{kind}.{number}": redact_text(f"step {self.step}: {text}")[:TAG_CHARS]}),
        ]

    def _at_step(self, event: dict[str, Any], values: dict[str, Any]) -> StepValues:
        return StepValues(self.step, float(event["time"]), _numbers(values))


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in values.items() if isinstance(value, (int, float))}


def flat_params(section: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A config mapping as ``{"training.lr": "0.003", ...}`` (MLflow parameters are flat strings)."""
    flat: dict[str, str] = {}
    for key, value in section.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, f"{name}."))
        else:
            flat[name] = redact_text(value if isinstance(value, str) else json.dumps(value))
    return flat


def record_files(run_dir: Path) -> tuple[Path, ...]:
    """The run record's files (config.yaml, events.jsonl, logs/...), W&B's own directory left out."""
    return tuple(
        sorted(
            path for path in run_dir.rglob("*") if path.is_file() and path.relative_to(run_dir).parts[0] != WANDB_DIR
        )
    )


# ---------------------------------------------------------------------------- backends
class RecordsRefused(Exception):
    """The tracker answered and refused these records (a bad value, say): retrying cannot help."""


class TrackingBackend(Protocol):
    """One tracker. ``send`` runs on the backend's own thread and raises on any failure: it is called
    again with the same records after one (each call must be all-or-nothing, or repeatable), except
    after ``RecordsRefused``, when the records are dropped."""

    name: str
    where: str

    def send(self, records: list[Record]) -> None: ...


class MlflowBackend:
    """An MLflow run through ``MlflowClient`` (REST to a tracking server, or MLflow's local store)."""

    name = "MLflow"

    def __init__(
        self, settings: MlflowTrackingConfig, *, experiment: str, run_name: str, params: dict[str, str]
    ) -> None:
        self.where = redact_text(settings.tracking_uri or "MLFLOW_TRACKING_URI (or MLflow's local default)")
        self._tracking_uri = settings.tracking_uri
        self._experiment = experiment
        self._run_name = run_name
        self._params_left = list(params.items())
        self._client: Any = None
        self._run_id: str | None = None

    def send(self, records: list[Record]) -> None:
        from mlflow.exceptions import RestException  # the server answered with an error

        try:
            self._send(records)
        except RestException as error:
            status = error.get_http_status_code()
            if 400 <= status < 500 and status not in (408, 429):  # not a timeout or a rate limit: refused
                raise RecordsRefused(str(error)) from error
            raise

    def _send(self, records: list[Record]) -> None:
        self._open()
        from mlflow.entities import Metric, RunTag

        metrics = [
            Metric(key, value, int(record.time * 1000), record.step)
            for record in records
            if isinstance(record, StepValues)
            for key, value in record.values.items()
        ]
        tags = [RunTag(k, v) for record in records if isinstance(record, RunTags) for k, v in record.tags.items()]
        if metrics or tags:
            self._client.log_batch(self._run_id, metrics=metrics, tags=tags, synchronous=True)
        for record in records:
            if isinstance(record, EndOfRun):
                self._finish(record)

    def _open(self) -> None:
        """Experiment, run and parameters, each step once (a retry goes on where the last one stopped)."""
        if self._client is None:
            from mlflow import MlflowClient  # imported here: the first send, off the driver's thread

            self._client = MlflowClient(tracking_uri=self._tracking_uri)
        if self._run_id is None:
            experiment = self._client.get_experiment_by_name(self._experiment)
            experiment_id = (
                experiment.experiment_id if experiment is not None else self._client.create_experiment(self._experiment)
            )
            self._run_id = self._client.create_run(experiment_id, run_name=self._run_name).info.run_id
        from mlflow.entities import Param

        while self._params_left:  # log_batch takes at most 100 parameters
            chunk = self._params_left[:100]
            self._client.log_batch(self._run_id, params=[Param(k, v) for k, v in chunk], synchronous=True)
            del self._params_left[:100]

    def _finish(self, end: EndOfRun) -> None:
        for path in end.files:
            parent = path.parent.relative_to(end.run_dir).as_posix()
            self._client.log_artifact(self._run_id, str(path), artifact_path=None if parent == "." else parent)
        self._client.set_terminated(self._run_id, status=MLFLOW_STATUS.get(end.status, "FAILED"))


class WandbBackend:
    """A W&B run (``wandb.init`` in ``RUN_DIR/wandb``); steps on the x axis ``step``.

    The metrics are logged against a ``step`` metric rather than W&B's own step, which must only
    grow: after a restore the run's step goes back, and W&B would drop those points.
    """

    name = "W&B"

    def __init__(
        self, settings: WandbTrackingConfig, *, project: str, run_name: str, run_dir: Path, config: dict[str, Any]
    ) -> None:
        self.where = f"project {project} ({settings.mode})"
        self._mode: Literal["online", "offline"] = "offline" if settings.mode == "offline" else "online"
        self._project = project
        self._run_name = run_name
        self._run_dir = run_dir
        self._config = config
        self._run: Any = None

    def send(self, records: list[Record]) -> None:
        if self._run is None:
            import wandb  # imported here: the first send, off the driver's thread

            # silent in the process's W&B settings too (where its terminal setup reads it): without an API
            # key, an online run would otherwise prompt for a login on the driver's terminal, from this thread.
            wandb.setup(settings=wandb.Settings(silent=True))
            run = wandb.init(
                project=self._project,
                name=self._run_name,
                mode=self._mode,
                dir=str(self._run_dir),
                config=self._config,
                reinit="create_new",
                # console=off: W&B must not take over the driver's stdout and stderr.
                settings=wandb.Settings(console="off", silent=True, init_timeout=WANDB_INIT_TIMEOUT_S),
            )
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
            self._run = run
        for record in records:
            if isinstance(record, StepValues):
                self._run.log({"step": record.step, **record.values})
            elif isinstance(record, RunTags):
                self._run.summary.update(record.tags)
            else:
                self._finish(record)

    def _finish(self, end: EndOfRun) -> None:
        """The record as one artifact (``run.save`` would note every file on the terminal), then the end."""
        import wandb

        if end.files:
            artifact = wandb.Artifact(f"run-record-{self._run.id}", type=WANDB_RECORD_TYPE)
            for path in end.files:
                artifact.add_file(str(path), name=path.relative_to(end.run_dir).as_posix())
            self._run.log_artifact(artifact)
        self._run.summary["meshpilot.status"] = end.status
        self._run.finish(exit_code=WANDB_EXIT_CODES.get(end.status, 1))


# ---------------------------------------------------------------------------- the queue
@dataclass
class Delivery:
    """What a backend took by the end: records sent, dropped from a full queue, and left unsent at close."""

    sent: int = 0
    dropped: int = 0
    unsent: int = 0
    # Failed sends (each retried), and the last one's error.
    failures: int = 0
    last_error: str | None = None


class BackendQueue:
    """A bounded queue of records and the thread that sends them to one backend (driver).

    ``put`` (the controller's thread) never blocks beyond a lock held for a list operation;
    the thread takes up to ``BATCH_RECORDS`` at a time, and retries a failed batch with backoff
    (1 s, doubling to 30 s) until it goes through or ``close`` gives up on it.
    """

    def __init__(
        self,
        backend: TrackingBackend,
        *,
        capacity: int = QUEUE_RECORDS,
        first_retry_s: float = FIRST_RETRY_S,
        closing_retry_s: float = CLOSING_RETRY_S,
    ) -> None:
        self.backend = backend
        self.capacity = capacity
        self.first_retry_s = first_retry_s
        self.closing_retry_s = closing_retry_s
        self.delivery = Delivery()
        self._pending: deque[Record] = deque()
        self._in_flight: list[Record] = []
        self._cond = threading.Condition()
        self._closing = False
        self._abandoned = False
        self._warned = False
        self._warned_refused = False
        self._thread = threading.Thread(target=self._run, name=f"meshpilot-tracking-{backend.name}", daemon=True)
        self._thread.start()

    def put(self, record: Record) -> None:
        with self._cond:
            if len(self._pending) >= self.capacity:
                self._pending.popleft()  # the oldest goes: the latest values are the ones a user watches
                self.delivery.dropped += 1
            self._pending.append(record)
            self._cond.notify()

    def close(self, deadline: float) -> Delivery:
        """Send what is queued until ``deadline`` (``time.monotonic()``), then give up on the rest."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()
            self.delivery.unsent = len(self._pending) + len(self._in_flight)
        return self.delivery

    def _run(self) -> None:
        retry_s = self.first_retry_s
        while self._next_batch():
            try:
                self.backend.send(self._in_flight)
            except RecordsRefused as error:
                self._refused(error)
                continue
            except Exception as error:  # noqa: BLE001 - a tracker's failure must never reach the run
                self._failed(error)
                self._back_off(retry_s)
                retry_s = min(2 * retry_s, MAX_RETRY_S)
                continue
            retry_s = self.first_retry_s
            with self._cond:
                self.delivery.sent += len(self._in_flight)
                self._in_flight = []

    def _back_off(self, retry_s: float) -> None:
        """Wait before a retry; a close cuts the wait short (and its retries come quicker)."""
        with self._cond:
            closing = self._closing
            self._cond.wait_for(
                lambda: self._abandoned or self._closing != closing,
                timeout=min(retry_s, self.closing_retry_s) if closing else retry_s,
            )

    def _next_batch(self) -> bool:
        """Wait for records (keeping a failed batch for its retry); False once there is nothing left to do."""
        with self._cond:
            while not self._in_flight and not self._pending and not self._closing:
                self._cond.wait()
            if self._abandoned:
                return False
            # The end of the run goes alone: its artifacts and status are retried apart from the metrics.
            while self._pending and len(self._in_flight) < BATCH_RECORDS:
                if isinstance(self._pending[0], EndOfRun) and self._in_flight:
                    break
                self._in_flight.append(self._pending.popleft())
                if isinstance(self._in_flight[-1], EndOfRun):
                    break
            return bool(self._in_flight)

    def _refused(self, error: RecordsRefused) -> None:
        """Drop a batch the tracker refused (counted), so that it cannot hold up the ones behind it."""
        message = redact_text((str(error).splitlines() or [""])[0])[:ERROR_CHARS]
        with self._cond:
            self.delivery.dropped += len(self._in_flight)
            self.delivery.last_error = message
            self._in_flight = []
        if not self._warned_refused:
            self._warned_refused = True
            log.warning(
                "tracking: %s at %s refused records (%s); they are dropped",
                self.backend.name,
                self.backend.where,
                message,
            )

    def _failed(self, error: Exception) -> None:
        message = error_text(error)
        self.delivery.failures += 1
        self.delivery.last_error = message
        if not self._warned:
            self._warned = True
            log.warning(
                "tracking: cannot reach %s at %s (%s); retrying in the background, the run goes on",
                self.backend.name,
                self.backend.where,
                message,
            )


def error_text(error: BaseException) -> str:
    """The root of an error's chain, on one short line: ``ConnectionRefusedError: [Errno 111] Connection
    refused`` rather than MLflow's wrapper naming the URL, urllib3's pool and its retries."""
    chain = [error]
    while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None and inner not in chain:
        chain.append(inner)
    # The deepest that says something (W&B's missing API key ends in a NotATerminalError without a word).
    root = next((link for link in reversed(chain) if str(link).strip()), error)
    lines = str(root).strip().splitlines()
    return redact_text(f"{type(root).__name__}: {lines[0] if lines else ''}")[:ERROR_CHARS]


# ---------------------------------------------------------------------------- the subscriber
class Tracker:
    """Events -> every configured backend's queue (driver; an ``EventLog`` subscriber)."""

    def __init__(
        self,
        backends: list[TrackingBackend],
        run_dir: Path,
        *,
        records: EventRecords | None = None,
        close_timeout_s: float = 10.0,
        capacity: int = QUEUE_RECORDS,
        first_retry_s: float = FIRST_RETRY_S,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.close_timeout_s = close_timeout_s
        self._records = records or EventRecords()
        self._queues = [BackendQueue(backend, capacity=capacity, first_retry_s=first_retry_s) for backend in backends]
        self._closed: dict[str, Delivery] | None = None

    def describe(self) -> str:
        """Where the run is tracked, for the log line at the start."""
        return ", ".join(f"{queue.backend.name} ({queue.backend.where})" for queue in self._queues)

    def on_event(self, event: dict[str, Any]) -> None:
        try:
            records = self._records.records(event)
        except (KeyError, TypeError, ValueError) as error:  # an odd event must not stop training
            log.debug("tracking: skipped a %r event (%s)", event.get("event"), error)
            return
        for record in records:
            for queue in self._queues:
                queue.put(record)

    def close(self) -> dict[str, Delivery]:
        """End the runs (status, the record's files as artifacts); waits at most ``close_timeout_s``.

        Call after events.jsonl and the logs are closed, so the artifacts are whole. Safe to call twice.
        """
        if self._closed is not None:
            return self._closed
        end = EndOfRun(self._records.status or "failed", self.run_dir, record_files(self.run_dir))
        for queue in self._queues:
            queue.put(end)
        deadline = time.monotonic() + self.close_timeout_s
        self._closed = {queue.backend.name: queue.close(deadline) for queue in self._queues}
        for name, delivery in self._closed.items():
            if delivery.dropped or delivery.unsent:
                log.info(
                    "tracking: %s took %d records; %d dropped from a full queue, %d not sent in the %g s allowed "
                    "at the end; the whole run record is in %s",
                    name,
                    delivery.sent,
                    delivery.dropped,
                    delivery.unsent,
                    self.close_timeout_s,
                    self.run_dir,
                )
        return self._closed


class NullTracker:
    """No ``tracking`` backend: the same interface, nothing sent."""

    def describe(self) -> str:
        return ""

    def on_event(self, event: dict[str, Any]) -> None:
        pass

    def close(self) -> dict[str, Delivery]:
        return {}


def build_tracker(config: JobConfig, run_dir: Path) -> Tracker | NullTracker:
    """The tracker the config asks for (driver, before the first event); no network call is made here."""
    settings = config.tracking
    if settings.mlflow is None and settings.wandb is None:
        return NullTracker()
    backends: list[TrackingBackend] = []
    resolved = config.to_dict()
    if settings.mlflow is not None:
        for name, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        backends.append(
            MlflowBackend(
                settings.mlflow,
                experiment=settings.mlflow.experiment or config.name,
                run_name=run_dir.name,
                params=flat_params(resolved),
            )
        )
    if settings.wandb is not None:
        backends.append(
            WandbBackend(
                settings.wandb,
                project=settings.wandb.project or config.name,
                run_name=run_dir.name,
                run_dir=run_dir,
                config=json.loads(json.dumps(resolved)),
            )
        )
    records = EventRecords(
        flops_per_token=config.model_spec.flops_per_token(config.training.seq_len),
        peak_flops_per_device=peak_flops(config.metrics.device_peak_tflops),
    )
    return Tracker(backends, run_dir, records=records, close_timeout_s=settings.close_timeout_s)


def tracking_problems(config: JobConfig) -> list[str]:
    """The tracking section against what is installed and sane (driver, with the other config checks)."""
    settings = config.tracking
    problems = []
    for key, module in (("mlflow", "mlflow"), ("wandb", "wandb")):
        if getattr(settings, key) is not None and importlib.util.find_spec(module) is None:
            problems.append(
                f"tracking.{key} is set but {module} is not installed: {INSTALL_HINT} (or remove tracking.{key})"
            )
    if settings.close_timeout_s <= 0:
        problems.append(f"tracking.close_timeout_s={settings.close_timeout_s:g} must be > 0 (seconds)")
    return problems
