"""TensorBoard scalars of a run: an ``EventLog`` subscriber on the driver, like the metrics exporter.

Runs on the driver, and only when ``metrics.tensorboard_dir`` is set. Per step it writes the
training loss, learning rate, tokens/s and gradient norm, and per evaluation the eval loss, each at
its step (``tensorboard --logdir DIR`` draws them). The records are TensorBoard's own event files,
written with tensorboard's ``EventFileWriter``: the same ``simple_value`` scalars
``torch.utils.tensorboard.SummaryWriter.add_scalar`` writes, without importing torch into the
driver (which never imports it). Usage (in ``run_training``)::

    tensorboard = build_tensorboard(config)          # NullTensorBoard when tensorboard_dir is null
    event_log.subscribe(tensorboard)
    ...
    tensorboard.close()                               # after the "done" event
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from orchestrator.errors import UserError

log = logging.getLogger("meshpilot.tensorboard")

# Scalar tags: (event field or derived value, tag), per event kind.
STEP_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "grad_norm": "train/grad_norm",
}
EVAL_TAGS = {"loss": "eval/loss"}


class TensorBoardWriter:
    """``step`` and ``eval`` events -> TensorBoard scalars under ``log_dir`` (driver; a subscriber).

    ``on_event`` is called from the controller's thread; tensorboard's writer queues the records
    and a thread of its own writes them, so a slow disk never stalls the controller.
    """

    def __init__(self, log_dir: str | Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.log_dir = Path(log_dir)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = EventFileWriter(str(self.log_dir), flush_secs=5)
        except OSError as error:
            raise UserError(
                f"metrics.tensorboard_dir={str(log_dir)!r}: cannot write there ({error.strerror or error}); "
                "give a writable directory or null"
            ) from None
        self._warned = False

    def on_event(self, event: dict[str, Any]) -> None:
        name = event.get("event")
        try:
            if name == "step":
                self._write(event, _step_values(event), STEP_TAGS)
            elif name == "eval":
                self._write(event, {"loss": event.get("loss")}, EVAL_TAGS)
            elif name == "done":
                self._writer.flush()
        except (OSError, TypeError, ValueError) as error:  # TensorBoard must never stop training
            if not self._warned:
                self._warned = True
                log.warning("cannot write TensorBoard scalars to %s: %s", self.log_dir, error)

    def _write(self, event: dict[str, Any], values: dict[str, Any], tags: dict[str, str]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(
            value=[
                Summary.Value(tag=tags[key], simple_value=float(value))
                for key, value in values.items()
                if value is not None
            ]
        )
        if summary.value:
            self._writer.add_event(Event(summary=summary, step=int(event["step"]), wall_time=float(event["time"])))

    def close(self) -> None:
        """Write what is queued and close the file; safe to call twice."""
        self._writer.close()


def _step_values(event: dict[str, Any]) -> dict[str, Any]:
    seconds = event.get("step_time_s")
    return {
        "loss": event.get("loss"),
        "lr": event.get("lr"),
        "tokens_per_s": event.get("tokens", 0) / seconds if seconds else None,
        "grad_norm": event.get("grad_norm"),
    }


class NullTensorBoard:
    """No ``metrics.tensorboard_dir``: the same interface, nothing written."""

    def on_event(self, event: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def build_tensorboard(config: Any) -> TensorBoardWriter | NullTensorBoard:
    """The writer the config asks for (driver, before the first event)."""
    if config.metrics.tensorboard_dir is None:
        return NullTensorBoard()
    return TensorBoardWriter(config.metrics.tensorboard_dir)
