"""The terminal view of ``meshpilot data prepare``: input bytes done, documents/s, tokens/s (driver).

On a terminal a rich bar (like ``orchestrator/observe/progress.py`` for training); when output goes
to a file or a CI log, one plain line every ~10% of the input instead. ``SilentProgress`` is the
null object for callers that show nothing (the Python API, tests).
"""

from __future__ import annotations

import time
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class ProgressSink(Protocol):
    def start(self, total_bytes: int) -> None: ...

    def advance(self, *, documents: int, tokens: int, nbytes: int) -> None: ...

    def finish(self) -> None: ...


class SilentProgress:
    def start(self, total_bytes: int) -> None:
        pass

    def advance(self, *, documents: int, tokens: int, nbytes: int) -> None:
        pass

    def finish(self) -> None:
        pass


class PrepareProgress:
    """Counts documents and tokens as the driver takes them, with rates since the first call."""

    def __init__(self, *, console: Console | None = None, force_plain: bool = False) -> None:
        self.console = console or Console(stderr=True)
        self.plain = force_plain or not self.console.is_terminal
        self.documents = 0
        self.tokens = 0
        self._bytes = 0
        self._total = 0
        self._started = 0.0
        self._next_plain = 0.0
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def start(self, total_bytes: int) -> None:
        self._total = max(1, total_bytes)
        self._started = time.monotonic()
        if self.plain:
            return
        self._progress = Progress(
            TextColumn("prepare"),
            BarColumn(),
            DownloadColumn(),
            TextColumn("{task.fields[documents]} docs/s"),
            TextColumn("{task.fields[tokens]} tokens/s"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._progress.start()
        self._task = self._progress.add_task("prepare", total=self._total, documents="-", tokens="-")

    def advance(self, *, documents: int, tokens: int, nbytes: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self._bytes = min(self._total, self._bytes + nbytes)
        elapsed = max(1e-9, time.monotonic() - self._started)
        documents_rate, tokens_rate = f"{self.documents / elapsed:,.0f}", f"{self.tokens / elapsed:,.0f}"
        if self._progress is not None:
            assert self._task is not None  # start() adds the task as it starts the bar
            self._progress.update(self._task, completed=self._bytes, documents=documents_rate, tokens=tokens_rate)
            return
        if self._bytes >= self._next_plain or self._bytes == self._total:
            self._next_plain = self._bytes + self._total / 10
            self.console.print(
                f"prepare {100 * self._bytes / self._total:3.0f}%  {self.documents:,} documents "
                f"({documents_rate}/s)  {self.tokens:,} tokens ({tokens_rate}/s)"
            )

    def finish(self) -> None:
        if self._progress is not None:
            assert self._task is not None
            self._progress.update(self._task, completed=self._total)
            self._progress.stop()
            self._progress = None
