"""The one channel through which a rank tells the driver anything.

Runs on every rank. Worker code never calls the controller: it queues reports here, and the
driver drains them with the actor's ``poll()``. Each report is a frozen dataclass of
``workers/spec/messages.py`` (``StepReport``, ``EvalReport``, ``LogReport``,
``CheckpointUploadReport``, ``DrainNoticeReport``) carrying the rank and the rank's clock; the
channel stamps both, so callers say only what happened. ``RankLogHandler`` routes the rank's Python log records
through the same channel, so per-rank logs reach the driver's run directory even when the
rank runs on another machine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from checkpointing.spec import FailureReport, ShardReport
from workers.spec.messages import (
    CheckpointUploadReport,
    DrainNoticeReport,
    EvalReport,
    LogReport,
    NoticeScope,
    RankReport,
    StepReport,
)


class ReportChannel:
    """Thread-safe queue of reports, bounded so a driver that stops polling cannot exhaust memory.

    Written by the loop thread, the checkpoint uploader and the control threads; drained by
    ``poll()`` on a control thread.
    """

    def __init__(self, rank: int = -1, max_reports: int = 100_000) -> None:
        self.rank = rank
        self._reports: deque[RankReport] = deque(maxlen=max_reports)
        self._lock = threading.Lock()
        # Reports queued so far, how many of them the driver has drained, and how many times it
        # drained (``wait_delivered``).
        self._queued = 0
        self._delivered = 0
        self._drains = 0
        self._drained = threading.Condition(self._lock)
        # The last drain's reports: a driver that dies before it handles a poll's answer takes
        # them along; a driver adopting this rank gets them again (``redeliver_last``).
        self._last_drained: list[RankReport] = []

    def step(self, **fields: Any) -> None:
        """The loop applied a step (fields of ``StepReport`` other than rank and time)."""
        self.send(StepReport(rank=self.rank, time=time.time(), **fields))

    def evaluated(self, *, step: int, loss: float, tokens: int, eval_s: float) -> None:
        """The ranks evaluated the model after ``step`` (sent by one rank per evaluation)."""
        self.send(EvalReport(rank=self.rank, time=time.time(), step=step, loss=loss, tokens=tokens, eval_s=eval_s))

    def log(self, *, level: str, logger: str, message: str) -> None:
        self.send(LogReport(rank=self.rank, time=time.time(), level=level, logger=logger, message=message))

    def checkpoint_upload(self, upload: ShardReport | FailureReport, *, generation: int) -> None:
        """The uploader finished one save of ``generation``: durable, or given up."""
        self.send(CheckpointUploadReport(rank=self.rank, time=time.time(), upload=upload, generation=generation))

    def drain_notice(self, reason: str, scope: NoticeScope = NoticeScope.NODE) -> None:
        self.send(DrainNoticeReport(rank=self.rank, time=time.time(), reason=reason, scope=scope))

    def send(self, report: RankReport) -> None:
        with self._lock:
            self._reports.append(report)
            self._queued += 1

    def drain(self) -> list[RankReport]:
        with self._lock:
            reports = list(self._reports)
            self._reports.clear()
            self._last_drained = reports
            self._delivered = self._queued
            self._drains += 1
            self._drained.notify_all()
        return reports

    def redeliver_last(self) -> None:
        """Queue the last drain's reports again, before those queued since (a new driver adopts
        this rank: it drops what the old driver had already recorded, by step)."""
        with self._lock:
            self._reports.extendleft(reversed(self._last_drained))
            self._queued += len(self._last_drained)
            self._last_drained = []

    def wait_delivered(self, timeout_s: float) -> bool:
        """Block until the driver holds every report queued before this call, or ``timeout_s``
        passed; True when it does. Called by a rank about to end its own process (an injected
        kill), whose queued reports would otherwise die with it.

        A drain hands the reports to the reply of a ``poll``; the driver polls again only once
        that poll has answered, so the next drain after ours means the reply was delivered.
        """
        deadline = time.monotonic() + timeout_s
        with self._drained:
            queued = self._queued
            if not self._drained.wait_for(lambda: self._delivered >= queued, timeout=timeout_s):
                return False
            drains = self._drains
            return self._drained.wait_for(lambda: self._drains > drains, timeout=max(0.0, deadline - time.monotonic()))


class NullChannel(ReportChannel):
    """Drops every report (torchrun reference, unit tests)."""

    def send(self, report: RankReport) -> None:
        return None

    def wait_delivered(self, timeout_s: float) -> bool:
        return True


class RankLogHandler(logging.Handler):
    """Forwards log records of level INFO and above to the driver as ``LogReport``s."""

    def __init__(self, channel: ReportChannel, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.channel.log(level=record.levelname.lower(), logger=record.name, message=record.getMessage())
        except Exception:  # noqa: BLE001 - a log line must never take the rank down
            self.handleError(record)
