"""Logs of a run: a readable console, JSON lines per rank in the run directory, secrets masked.

Runs on the driver. Ranks do not write log files: they send ``log`` events through the
reporting channel like everything else, and ``RankLogWriter`` (an ``EventLog`` subscriber)
appends each to ``RUN_DIR/logs/rank-N.jsonl``. The driver's own records go to the console
(rich, or JSON lines for log collectors) and to ``RUN_DIR/logs/driver.jsonl``. Every handler
installed here masks credentials (``orchestrator/observe/redact.py``), tracebacks included. Usage::

    logger = setup_logging(run_dir=run_dir, console=progress_console)
    event_log.subscribe(RankLogWriter(run_dir))
    event_log.subscribe(ConsoleEventPrinter(logger))
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.logging import RichHandler

from elastic.spec import MeshSpec
from orchestrator.observe.events import checkpoint_failure_reason, is_failure_recovery
from orchestrator.observe.redact import redact, redact_text

LOGGER_NAME = "meshpilot"
CONSOLE_FORMATS = ("rich", "json")
_OURS = "_meshpilot_handler"  # marks handlers setup_logging installed, so a second call replaces them


class RedactingFilter(logging.Filter):
    """Masks credentials in the message and in the traceback before any handler formats them."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info:
            # Exception messages carry URLs and keys; render the traceback now so it is masked too.
            message += "\n" + logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
            record.exc_text = None
        if record.stack_info:
            message += "\n" + record.stack_info
            record.stack_info = None
        record.msg = redact_text(message)
        record.args = None
        return True


class JsonLinesFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message (and rank when the record has one)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        # ``rank`` is not a LogRecord attribute: it arrives through ``extra=`` or a filter, when at all.
        rank = getattr(record, "rank", None)
        if rank is not None:
            line["rank"] = rank
        return json.dumps(line)


def setup_logging(
    *,
    level: str | int = "INFO",
    run_dir: Path | None = None,
    console_format: str = "rich",
    console: Console | None = None,
    stream: TextIO | None = None,
) -> logging.Logger:
    """Configure the ``meshpilot`` logger (driver); calling it again replaces what it installed.

    ``console`` lets the progress bar and the log share one rich Console, so log lines appear
    above the bar instead of tearing it. ``console_format="json"`` writes JSON lines to the
    stream instead (for pods whose logs are collected).
    """
    if console_format not in CONSOLE_FORMATS:
        raise ValueError(f"console_format={console_format!r} is not one of {', '.join(CONSOLE_FORMATS)}")
    logger = logging.getLogger(LOGGER_NAME)
    for handler in [h for h in logger.handlers if getattr(h, _OURS, False)]:
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(level)
    logger.propagate = False  # our handlers print it once; the root logger's would print it again
    handlers: list[logging.Handler] = []
    if console_format == "rich":
        console = console or Console(file=stream or sys.stderr)
        handlers.append(
            RichHandler(console=console, show_path=False, markup=False, rich_tracebacks=False, log_time_format="[%X]")
        )
    else:
        json_handler = logging.StreamHandler(stream or sys.stderr)
        json_handler.setFormatter(JsonLinesFormatter())
        handlers.append(json_handler)
    if run_dir is not None:
        log_dir = Path(run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_dir / "driver.jsonl", encoding="utf-8")
        file_handler.setFormatter(JsonLinesFormatter())
        handlers.append(file_handler)
    for handler in handlers:
        handler.addFilter(RedactingFilter())
        setattr(handler, _OURS, True)
        logger.addHandler(handler)
    return logger


class RankLogWriter:
    """``log`` events -> ``RUN_DIR/logs/rank-N.jsonl`` (driver; an EventLog subscriber).

    Records without a rank come from the driver and go through the ``meshpilot`` logger instead.
    Files stay open (line-buffered, so ``tail -f`` works) until ``close()``.
    """

    def __init__(self, run_dir: Path) -> None:
        self.log_dir = Path(run_dir) / "logs"
        self._files: dict[int, TextIO] = {}
        self._lock = threading.Lock()
        self._logger = logging.getLogger(LOGGER_NAME)
        self._warned = False

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("event") != "log":
            return
        try:
            self._write(event)
        except (OSError, TypeError, ValueError) as error:  # a full disk must not stop training
            if not self._warned:
                self._warned = True
                self._logger.warning("cannot write rank logs to %s: %s", self.log_dir, error)

    def _write(self, event: dict[str, Any]) -> None:
        record = redact({key: item for key, item in event.items() if key != "event"})
        rank = record.get("rank")
        if rank is None:
            self._logger.log(_level(record.get("level")), "%s", record.get("message", ""))
            return
        with self._lock:
            handle = self._files.get(int(rank))
            if handle is None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                handle = open(self.log_dir / f"rank-{int(rank)}.jsonl", "a", encoding="utf-8", buffering=1)
                self._files[int(rank)] = handle
            handle.write(json.dumps(record, default=str) + "\n")

    def close(self) -> None:
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()


class ConsoleEventPrinter:
    """Prints what an operator must notice (driver; an EventLog subscriber).

    Failures, recoveries, checkpoints, evaluations, mesh changes and rank log records at or
    above ``rank_level``; steps are left to the progress bar.
    """

    def __init__(self, logger: logging.Logger | None = None, *, rank_level: str | int = "WARNING") -> None:
        self.logger = logger or logging.getLogger(LOGGER_NAME)
        self.rank_level = _level(rank_level)

    def on_event(self, event: dict[str, Any]) -> None:
        try:
            line = self._describe(event)
        except (TypeError, ValueError, KeyError, AttributeError):
            line = (logging.INFO, f"{event.get('event')}: {event}")  # an odd event is shown raw, never fatal
        if line is not None:
            level, text = line
            self.logger.log(level, "%s", text)

    def _describe(self, event: dict[str, Any]) -> tuple[int, str] | None:
        """(level, line) for an event an operator must notice, else None."""
        name = event.get("event")
        if name == "log":
            return self._describe_rank_log(event)
        describe = _DESCRIBERS.get(name) if isinstance(name, str) else None
        return describe(event) if describe is not None else None

    def _describe_rank_log(self, event: dict[str, Any]) -> tuple[int, str] | None:
        """A rank's log record at or above ``rank_level``; the quieter ones stay in its rank file."""
        level = _level(event.get("level"))
        if event.get("rank") is None or level < self.rank_level:
            return None
        return level, f"[rank {event.get('rank')}] {event.get('message')}"


# One console line per kind of event (the rank ``log`` records aside, which depend on the printer's
# ``rank_level``). Each takes the event and gives (level, line).
def _describe_start(event: dict[str, Any]) -> tuple[int, str]:
    get = event.get
    return logging.INFO, (
        f"run {get('name')}: {_mesh(get('mesh'))} ({get('world_size')} ranks), "
        f"{get('steps')} steps, run dir {get('run_dir')}"
    )


def _describe_failure(event: dict[str, Any]) -> tuple[int, str]:
    get = event.get
    return logging.WARNING, (
        f"failure: {get('kind')} on node {get('node')}, ranks {_ranks(get('ranks'))}: {get('message')}"
    )


def _describe_recovered(event: dict[str, Any]) -> tuple[int, str]:
    get = event.get
    change = f"{_mesh(get('old_mesh'))} -> {_mesh(get('new_mesh'))}"
    if not is_failure_recovery(event):  # the end of a drain's (or an idle grow's) pause
        return logging.INFO, f"training again after the {get('cause')} in {float(get('mttr_s') or 0):.1f} s: {change}"
    return logging.INFO, (
        f"recovered in {float(get('mttr_s') or 0):.1f} s: {change}, {get('lost_steps') or 0} steps lost"
    )


def _describe_restored(event: dict[str, Any]) -> tuple[int, str]:
    get = event.get
    return logging.INFO, (
        f"restored step {get('step')} from {get('uri')} in "
        f"{float(get('restore_s') or 0):.1f} s onto {_mesh(get('to_mesh'))}"
    )


def _describe_eval(event: dict[str, Any]) -> tuple[int, str]:
    get = event.get
    return logging.INFO, (
        f"eval at step {get('step')}: loss {float(event['loss']):.4f} over {int(event['tokens']):,} tokens "
        f"in {float(get('eval_s') or 0):.1f} s"
    )


def _describe_checkpoint_committed(event: dict[str, Any]) -> tuple[int, str]:
    get = event.get
    return logging.INFO, (
        f"checkpoint step {get('step')} committed: {_megabytes(get('bytes'))} in "
        f"{float(get('upload_s') or 0):.1f} s -> {get('uri')}"
    )


def _describe_checkpoint_failed(event: dict[str, Any]) -> tuple[int, str]:
    get = event.get
    if checkpoint_failure_reason(event) == "interrupted":  # storage is fine: the mesh moved on
        return logging.INFO, f"checkpoint step {get('step')} dropped: {get('error')}"
    return logging.WARNING, f"checkpoint step {get('step')} failed: {get('error')}"


def _describe_drain(event: dict[str, Any]) -> tuple[int, str]:
    get = event.get
    return logging.WARNING, f"draining node {get('node')} (ranks {_ranks(get('ranks'))}): {get('reason')}"


def _describe_grow(event: dict[str, Any]) -> tuple[int, str]:
    get = event.get
    return logging.INFO, (
        f"grew to {_mesh(get('new_mesh'))}, added ranks {_ranks(get('added_ranks'))} "
        f"in {float(get('join_s') or 0):.1f} s"
    )


def _describe_done(event: dict[str, Any]) -> tuple[int, str]:
    get = event.get
    return logging.INFO, f"done: {get('status')} after {get('steps')} steps in {float(get('elapsed_s') or 0):.1f} s"


_DESCRIBERS: dict[str, Callable[[dict[str, Any]], tuple[int, str]]] = {
    "start": _describe_start,
    "failure": _describe_failure,
    "recovered": _describe_recovered,
    "restored": _describe_restored,
    "eval": _describe_eval,
    "checkpoint_committed": _describe_checkpoint_committed,
    "checkpoint_failed": _describe_checkpoint_failed,
    "drain": _describe_drain,
    "grow": _describe_grow,
    "done": _describe_done,
}


def _level(level: Any) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(str(level or "INFO").upper())
    return value if isinstance(value, int) else logging.INFO


def _mesh(mesh: Any) -> str:
    """Short mesh text for one console line: the degrees above 1 (``dp_replicate=2 x tp=2``)."""
    if isinstance(mesh, dict):
        try:
            mesh = MeshSpec.from_dict(mesh)
        except ValueError:
            return str(mesh)
    if not isinstance(mesh, MeshSpec):
        return str(mesh)
    degrees = [f"{dim}={degree}" for dim, degree in mesh.as_dict().items() if degree > 1]
    return " x ".join(degrees) or "1 rank"


def _ranks(ranks: Any) -> str:
    if not ranks:
        return "-"
    return ", ".join(str(rank) for rank in ranks)


def _megabytes(size: Any) -> str:
    return f"{int(size or 0) / 1e6:.1f} MB"
