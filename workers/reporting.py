"""The one channel through which a rank tells the driver anything.

Runs on every rank. Worker code never calls the controller: it appends reports here, and the
driver drains them with the actor's ``poll()``. Each report is a JSON-able dict with a
``kind`` (``step``, ``log``, ``checkpoint_shard`` ...). ``RankLogHandler`` routes the rank's
Python log records through the same channel, so per-rank logs reach the driver's run
directory even when the rank runs on another machine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any


class ReportChannel:
    """Thread-safe queue of reports, bounded so a driver that stops polling cannot exhaust memory."""

    def __init__(self, rank: int = -1, max_reports: int = 100_000) -> None:
        self.rank = rank
        self._reports: deque[dict[str, Any]] = deque(maxlen=max_reports)
        self._lock = threading.Lock()

    def report(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "rank": self.rank, "time": time.time(), **fields}
        with self._lock:
            self._reports.append(record)

    def drain(self) -> list[dict[str, Any]]:
        with self._lock:
            reports = list(self._reports)
            self._reports.clear()
        return reports


class NullChannel(ReportChannel):
    """Drops every report (torchrun reference, unit tests)."""

    def report(self, kind: str, **fields: Any) -> None:
        return None


class RankLogHandler(logging.Handler):
    """Forwards log records of level INFO and above to the driver as ``log`` reports."""

    def __init__(self, channel: ReportChannel, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.channel.report("log", level=record.levelname.lower(), logger=record.name,
                                message=record.getMessage())
        except Exception:  # a log line must never take the rank down
            self.handleError(record)
