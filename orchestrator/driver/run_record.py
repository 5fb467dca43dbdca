"""Where a run's record goes: a local run directory, and the URI it is mirrored to when it must outlive the job.

Runs on the driver, once, before the run starts (``run_training``). A Ray job submitted with
``ray job submit --working-dir . -- meshpilot train ...`` runs in Ray's copy of the working
directory, which Ray deletes with the job; a ``runs/...`` directory there goes with it. So:

1. ``--run-dir`` (else ``runtime.run_dir``) ``s3://bucket/prefix``: the run writes
   ``runs/<name>-<timestamp>`` and ``RecordMirror`` copies it there.
2. A directory (or ``file://``): the run writes there; nothing is copied.
3. Neither, in a Ray job, with an ``s3://`` ``checkpoint.uri``: mirrored to
   ``<checkpoint.uri>/runs/<name>-<timestamp>`` (beside the checkpoints, never under ``step-``).
4. Otherwise ``runs/<name>-<timestamp>``; in a Ray job, with a warning naming the key to set.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from checkpointing.storage import open_storage
from orchestrator.config import JobConfig
from orchestrator.config_checks import uri_problems
from orchestrator.errors import ConfigError
from orchestrator.observe.record_mirror import NoMirror, RecordMirror

RUNS_UNDER_CHECKPOINTS = "runs"


@dataclass(frozen=True)
class RecordLocation:
    """The local run directory, the URI it is mirrored to (None: not mirrored) and a warning to log."""

    local_dir: Path
    mirror_uri: str | None = None
    warning: str | None = None


def default_run_dir(config: JobConfig) -> Path:
    return Path("runs") / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def record_location(config: JobConfig, run_dir: str | Path | None, *, in_ray_job: bool) -> RecordLocation:
    """Where the record of ``config``'s run goes (see the module docstring for the rules).

    ``run_dir`` is ``--run-dir`` (it wins over ``runtime.run_dir``); ``in_ray_job``: the driver
    runs as a Ray job (``RAY_JOB_ID`` is set). Raises ConfigError for a URI that cannot be used.
    """
    key = "--run-dir" if run_dir is not None else "runtime.run_dir"
    target = str(run_dir) if run_dir is not None else config.runtime.run_dir
    if target is not None:
        problems = uri_problems(target, key)
        if problems:
            raise ConfigError(problems)
        if target.startswith("s3://"):
            return RecordLocation(default_run_dir(config), mirror_uri=target.rstrip("/"))
        local = Path(urlparse(target).path) if target.startswith("file://") else Path(target)
        warning = _working_dir_warning(local) if in_ray_job and not local.is_absolute() else None
        return RecordLocation(local, warning=warning)
    local = default_run_dir(config)
    checkpoint_uri = config.checkpoint.uri
    if in_ray_job and checkpoint_uri is not None and checkpoint_uri.startswith("s3://"):
        return RecordLocation(local, mirror_uri=f"{checkpoint_uri.rstrip('/')}/{RUNS_UNDER_CHECKPOINTS}/{local.name}")
    return RecordLocation(local, warning=_working_dir_warning(local) if in_ray_job else None)


def _working_dir_warning(local: Path) -> str:
    return (
        f"this run's record ({local}: events, logs, config) lies in the Ray job's working directory, which Ray "
        "deletes with the job; to keep it, set runtime.run_dir (or --run-dir) to s3://BUCKET/PREFIX or a shared "
        "absolute directory, or checkpoint.uri to an s3:// URI (the record then goes under it, in runs/)"
    )


def open_record_mirror(config: JobConfig, location: RecordLocation) -> RecordMirror | NoMirror:
    """The mirror of ``location`` (with checkpoint.endpoint_url and region, credentials from the
    AWS chain), not yet started; ``NoMirror`` when the record stays where it is written."""
    if location.mirror_uri is None:
        return NoMirror()
    storage = open_storage(
        location.mirror_uri, endpoint_url=config.checkpoint.endpoint_url, region=config.checkpoint.region
    )
    return RecordMirror(location.local_dir, storage, interval_s=config.runtime.run_dir_sync_s)
