"""The exactly-once ledger: ``RUN_DIR/samples.jsonl``, which global samples each applied step consumed.

Runs on the driver, fed by the ``ReportRouter`` as it emits each ``step`` event (so only steps the
run applied appear). With ``data.record_samples: true`` every rank reports, with each step, the
global sample indices its data-parallel slice consumed (``StepReport.sample_indices``); the ledger
writes one line per step and data-parallel rank::

    {"step": 7, "dp_rank": 1, "indices": [100, 101, ...], "mesh": {"dp_replicate": 2, ...}}

A slice whose every rank died between applying the step and reporting it (the step's event is
then ``loss_partial``) is written from the step arithmetic of ``workers/data.py`` instead, with
``"reported": false``. A restore from a checkpoint takes training back to that step: the lines of
the later steps are removed, since their updates are gone and the steps run again. Checking the
ledger: every index in ``[0, last_step * global_batch)`` appears exactly once. Without
``record_samples`` the router holds a ``NoLedger``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from elastic.spec import MeshSpec, samples_per_rank
from workers.spec.messages import StepReport

LEDGER_FILE = "samples.jsonl"


class NoLedger:
    """The null ledger: nothing recorded."""

    def record(self, step: int, reports: Iterable[StepReport], mesh: MeshSpec) -> None:
        return None

    def rewind(self, step: int) -> None:
        return None


class SampleLedger:
    """Appends one line per applied step and data-parallel rank to ``path`` (driver only)."""

    def __init__(self, path: Path, *, global_batch: int) -> None:
        self.path = path
        self.global_batch = global_batch
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()

    def record(self, step: int, reports: Iterable[StepReport], mesh: MeshSpec) -> None:
        """The consumed samples of ``step``, one line per data-parallel rank of ``mesh``."""
        by_slice: dict[int, tuple[int, ...]] = {}
        for report in reports:
            if report.sample_indices is not None:
                by_slice.setdefault(report.dp_rank, report.sample_indices)
        lines = []
        for dp_rank in range(mesh.dp):
            line: dict[str, Any] = {"step": step, "dp_rank": dp_rank}
            if dp_rank in by_slice:
                line["indices"] = list(by_slice[dp_rank])
            else:
                line["indices"] = list(self._slice(step, dp_rank, mesh.dp))
                line["reported"] = False
            line["mesh"] = mesh.as_dict()
            lines.append(json.dumps(line) + "\n")
        with self.path.open("a", encoding="utf-8") as handle:
            handle.writelines(lines)

    def rewind(self, step: int) -> None:
        """Training went back to ``step``: the lines of later steps go."""
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines() if json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def _slice(self, step: int, dp_rank: int, dp: int) -> range:
        per_rank = samples_per_rank(self.global_batch, dp)
        first = (step - 1) * self.global_batch + dp_rank * per_rank
        return range(first, first + per_rank)


def sample_ledger(run_dir: Path | None, *, record_samples: bool, global_batch: int) -> SampleLedger | NoLedger:
    if not record_samples or run_dir is None:
        return NoLedger()
    return SampleLedger(run_dir / LEDGER_FILE, global_batch=global_batch)


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """Every line of a ledger, in order."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
