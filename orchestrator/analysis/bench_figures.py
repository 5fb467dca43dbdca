"""Measured figures the benchmarks leave behind for ``meshpilot simulate``: bench/results/latest.json.

Runs on the driver. Benchmarks call ``record_figure`` after they measure; the simulator calls
``load_figures`` and uses a measured figure instead of its documented default, saying which.

The file (``FORMAT`` below), one entry per figure, all times in seconds::

    {
      "format": "meshpilot-bench-figures/1",
      "figures": {
        "inplace_recovery_s": {"value": 1.9, "bench": "bench/recovery.py", "world_size": 8,
                               "measured_at": "2026-11-23T10:00:00Z", "note": "kill one rank, CPU gloo"},
        ...
      }
    }

Known figures (``FIGURES``): what the simulator reads each one as.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from orchestrator.errors import UserError

FORMAT = "meshpilot-bench-figures/1"
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "bench" / "results" / "latest.json"
FIGURES: dict[str, str] = {
    "checkpoint_stall_s": "time a checkpoint blocks the training loop (copy to host)",
    "checkpoint_upload_s": "time from the end of the stall until the checkpoint is committed",
    "restart_recovery_s": "failure to first step after restarting everything from a checkpoint",
    "inplace_recovery_s": "failure to first step after dropping the failed replica group in place",
    "drain_recovery_s": "spot notice to first step on the smaller mesh",
    "grow_s": "pause while new replica groups join at a step boundary",
}


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    bench: str
    measured_at: str | None = None
    world_size: int | None = None
    note: str | None = None

    def source(self) -> str:
        where = f"{self.bench}"
        if self.world_size:
            where += f", {self.world_size} ranks"
        if self.measured_at:
            where += f", {self.measured_at}"
        return f"measured ({where})"


def load_figures(path: str | Path = DEFAULT_PATH) -> dict[str, Figure]:
    """The figures in ``path``; {} when it does not exist. A malformed file is the user's to fix."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(
            f"bench results {path} cannot be read as JSON ({error}); re-run the benchmark or pass --bench-results none"
        ) from None
    if (
        not isinstance(document, dict)
        or document.get("format") != FORMAT
        or not isinstance(document.get("figures"), dict)
    ):
        raise UserError(
            f'bench results {path} is not a {FORMAT} file (want {{"format": "{FORMAT}", '
            '"figures": {...}}); re-run the benchmark or pass --bench-results none'
        )
    figures = {}
    for name, entry in document["figures"].items():
        if name not in FIGURES:
            continue  # figures for other readers
        value = entry.get("value") if isinstance(entry, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise UserError(f"bench results {path}: figures.{name}.value={value!r} must be a number >= 0")
        figures[name] = Figure(
            name=name,
            value=float(value),
            bench=str(entry.get("bench", "unknown bench")),
            measured_at=entry.get("measured_at"),
            world_size=entry.get("world_size"),
            note=entry.get("note"),
        )
    return figures


def record_figure(
    path: str | Path, name: str, value: float, *, bench: str, world_size: int | None = None, note: str | None = None
) -> None:
    """Add or replace one figure in ``path`` (created if absent), atomically."""
    if name not in FIGURES:
        raise ValueError(f"unknown figure {name!r}; known: {', '.join(FIGURES)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {"format": FORMAT, "figures": {}}
    if path.is_file():
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict) and loaded.get("format") == FORMAT and isinstance(loaded.get("figures"), dict):
                document = loaded
        except ValueError:
            pass  # a broken file is replaced by a good one
    entry = {"value": float(value), "bench": bench, "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if world_size is not None:
        entry["world_size"] = int(world_size)
    if note:
        entry["note"] = note
    document["figures"][name] = entry
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".latest-", suffix=".json")
    with os.fdopen(handle, "w", encoding="utf-8") as stream:
        json.dump(document, stream, indent=2, sort_keys=True)
        stream.write("\n")
    os.replace(temporary, path)
