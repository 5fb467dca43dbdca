"""Running one training job end to end on the driver: run directory (and its mirror), Ray, controller, events.

``run_training`` is what ``meshpilot train`` calls, and what tests call in-process (with the
session's Ray cluster already up, which it then reuses and leaves running).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from rich.console import Console

from orchestrator.config import JobConfig
from orchestrator.driver import cluster
from orchestrator.driver.controller import Controller
from orchestrator.driver.run_record import default_run_dir, open_record_mirror, record_location
from orchestrator.observe.events import EventLog, read_events
from orchestrator.observe.logs import ConsoleEventPrinter, RankLogWriter, setup_logging
from orchestrator.observe.metrics import build_metrics
from orchestrator.observe.record_mirror import NoMirror, RecordMirror
from orchestrator.observe.tensorboard import build_tensorboard
from orchestrator.observe.tracking import build_tracker
from workers.faults import FaultSpec, NetworkFault


@dataclass(frozen=True)
class RunResult:
    """How a run ended, and where its record is (``events.jsonl``, ``config.yaml``, rank logs)."""

    run_dir: Path
    status: str
    exit_code: int  # 0 when the run finished its steps
    reason: str | None = None
    # Where the record is mirrored to (s3://...), None when RUN_DIR is the only copy.
    record_uri: str | None = None

    def events(self) -> list[dict[str, Any]]:
        """Every event of the run, in order (read from RUN_DIR/events.jsonl)."""
        return read_events(self.run_dir / "events.jsonl")

    @property
    def losses(self) -> dict[int, float]:
        """The training loss of every step the run took: step -> mean loss over the global batch."""
        return {e["step"]: e["loss"] for e in self.events() if e["event"] == "step" and e.get("loss") is not None}


def prepare_run_dir(config: JobConfig, run_dir: Path | None) -> Path:
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
    return run_dir


def run_training(
    config: JobConfig,
    run_dir: str | Path | None = None,
    *,
    subscribers: list | None = None,
    console: Console | None = None,
    faults: tuple[FaultSpec, ...] = (),
    node_fault: Callable[[str], None] | None = None,
    network_fault: Callable[[NetworkFault], None] | None = None,
    handle_signals: bool = False,
    chaos_seed: int | None = None,
) -> RunResult:
    """Train ``config`` to a terminal state; every event goes to RUN_DIR/events.jsonl.

    ``run_dir`` (else ``runtime.run_dir``) is a directory or an ``s3://`` URI the record is
    mirrored to from a local directory (``orchestrator/driver/run_record.py`` says where it
    goes). The event log feeds the metrics exporter, TensorBoard (when ``metrics.tensorboard_dir``
    is set), MLflow and W&B (``tracking``), the per-rank log files and the console, so all of them
    see the same run. With ``handle_signals`` (the CLI; main thread only), SIGTERM saves a
    checkpoint at the next step boundary and stops, instead of killing the driver mid-step, and
    Ctrl-C stops after the step in flight (a second Ctrl-C at once).
    """
    run_dir, logger, mirror = _open_record(config, run_dir, console)
    metrics = build_metrics(config)
    tensorboard = build_tensorboard(config)
    rank_logs = RankLogWriter(run_dir)
    tracker = build_tracker(config, run_dir)
    events = EventLog(
        run_dir / "events.jsonl",
        [*(subscribers or []), metrics, tensorboard, tracker, rank_logs, ConsoleEventPrinter(logger)],
    )
    if tracker.describe():
        logger.info("tracking: %s", tracker.describe())
    started_here = False
    previous_handlers: dict = {}
    try:
        mirror.start()
        url = metrics.start_server(config.metrics.host, config.metrics.port)
        if url:
            logger.info("metrics: %s", url)
        started_here = cluster.connect(config)
        controller = Controller(
            config, events, faults=faults, node_fault=node_fault, network_fault=network_fault, chaos_seed=chaos_seed
        )
        if handle_signals:
            # After connecting: Ray installs its own SIGTERM handler in the driver, which aborts.
            # Flags, not exceptions: raised inside a Ray call, KeyboardInterrupt can be lost.
            previous_handlers = {
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: controller.request_termination()),
                signal.SIGINT: signal.signal(signal.SIGINT, lambda signum, frame: controller.request_interrupt()),
            }
        final = controller.run()
    finally:
        # A finished controller ignores requests: give both signals back, or a SIGTERM after
        # the run (during the demo's export) would be swallowed.
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        events.close()
        rank_logs.close()
        tracker.close()  # after the files it sends as artifacts are closed; waits tracking.close_timeout_s at most
        mirror.close()  # after the files it copies are closed
        metrics.close()
        tensorboard.close()
        if started_here:
            ray.shutdown()
    return RunResult(
        run_dir=run_dir, status=final.status, exit_code=final.exit_code, reason=final.reason, record_uri=mirror.uri
    )


def _open_record(
    config: JobConfig, run_dir: str | Path | None, console: Console | None
) -> tuple[Path, logging.Logger, RecordMirror | NoMirror]:
    """The local run directory (with config.yaml), the logger writing into it, and its mirror (not started)."""
    # RAY_JOB_ID: Ray sets it in a submitted job's driver, whose working directory Ray deletes.
    location = record_location(config, run_dir, in_ray_job=bool(os.environ.get("RAY_JOB_ID")))
    local_dir = prepare_run_dir(config, location.local_dir)
    logger = setup_logging(run_dir=local_dir, console=console)
    if location.warning:
        logger.warning("%s", location.warning)
    return local_dir, logger, open_record_mirror(config, location)
