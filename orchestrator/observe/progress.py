"""The terminal view of a run: a progress bar (step, loss, tokens/s, ETA) fed by events.

Runs on the driver as an event subscriber. On a terminal it draws a rich progress bar; when
output goes to a file or a CI log it prints one plain line every ~10% of the run instead.
Everything else an operator must notice (failures, checkpoints, the end) is printed by
``orchestrator.observe.logs.ConsoleEventPrinter`` through the same console.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn


class ProgressView:
    def __init__(self, *, console: Console | None = None, force_plain: bool = False) -> None:
        self.console = console or Console(stderr=True)
        self.plain = force_plain or not self.console.is_terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._total = 0
        self._tokens_per_s = 0.0
        self._last_plain = 0.0

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "start":
            self._begin(event)
        elif kind == "step":
            self._advance(event)
        elif kind == "done":
            self._finish()

    def _begin(self, event: dict[str, Any]) -> None:
        self._total = event["steps"]
        if self.plain:
            return
        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} tok/s"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=self._total, loss="-", rate="-")

    def _advance(self, event: dict[str, Any]) -> None:
        loss = f"{event['loss']:.4f}" if event.get("loss") is not None else "-"
        if event.get("step_time_s"):
            self._tokens_per_s = event["tokens"] / event["step_time_s"]
        rate = f"{self._tokens_per_s:,.0f}"
        if self._progress is not None:
            assert self._task is not None  # _begin adds the task as it starts the bar
            self._progress.update(self._task, completed=event["step"], loss=loss, rate=rate)
            return
        now = time.monotonic()
        every = max(1, self._total // 10)
        if event["step"] % every == 0 or event["step"] == self._total or now - self._last_plain > 30:
            self._last_plain = now
            self.console.print(f"step {event['step']}/{self._total}  loss {loss}  {rate} tok/s")

    def _finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
