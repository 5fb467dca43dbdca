"""Reading back what W&B wrote for a run: the records of its ``run-<id>.wandb`` file.

An offline run (``wandb.init(mode="offline", dir=RUN_DIR)``) keeps everything it was given in
``RUN_DIR/wandb/offline-run-*/run-*.wandb``, the file ``wandb sync`` uploads. Its format is W&B's
datastore: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then LevelDB's log format (32 KiB
blocks; each record a 7-byte header, crc32, length, type, then its bytes, split FIRST / MIDDLE /
LAST across blocks), each record a ``wandb_internal_pb2.Record`` protobuf. wandb >= 0.19 reads it
in its Go core only, so the tests read it here with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = b":W&B\xe1\xbe\x00"
BLOCK = 32 * 1024
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class WandbRun:
    """What one offline run holds: logged rows (``run.log``), the summary, config, saved files, artifacts."""

    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    # Logged artifacts: (type, name) -> the paths in it.
    artifacts: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    exit_code: int | None = None


def offline_run_file(run_dir: Path) -> Path:
    """The one ``.wandb`` file under ``RUN_DIR/wandb``."""
    found = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(found) == 1, f"expected one offline W&B run under {run_dir}/wandb, found {found}"
    return found[0]


def read_finished_wandb_run(run_dir: Path, timeout_s: float = 30.0) -> WandbRun:
    """The offline run under ``RUN_DIR/wandb`` once its exit record is written.

    ``run.finish()`` returns once W&B's core process has the run's end; the core writes the file's
    last records a moment later.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        run = read_wandb_run(offline_run_file(run_dir))
        if run.exit_code is not None or time.monotonic() > deadline:
            return run
        time.sleep(0.2)


def read_wandb_run(path: Path) -> WandbRun:
    from wandb.proto import wandb_internal_pb2

    run = WandbRun()
    for data in _records(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated protobuf class
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            run.history.append({_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            run.summary.update({_key(item): json.loads(item.value_json) for item in record.summary.update})
        elif kind == "run":
            run.config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "files":
            run.files.extend(file.path for file in record.files.files)
        elif kind == "artifact":
            artifact = record.artifact
            run.artifacts[(artifact.type, artifact.name)] = [entry.path for entry in artifact.manifest.contents]
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def _records(raw: bytes) -> Iterator[bytes]:
    assert raw[: len(HEADER)] == HEADER, "not a W&B datastore file"
    position, pieces = len(HEADER), b""
    while position + RECORD_HEADER <= len(raw):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < RECORD_HEADER:  # a block's tail too short for a header is padding
            position += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[position : position + RECORD_HEADER])
        data = raw[position + RECORD_HEADER : position + RECORD_HEADER + length]
        position += RECORD_HEADER + length
        if kind == FULL:
            yield data
        elif kind == FIRST:
            pieces = data
        elif kind == MIDDLE:
            pieces += data
        elif kind == LAST:
            yield pieces + data
        else:  # zeros: the end of what was written
            return
