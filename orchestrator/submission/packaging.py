"""What ``meshpilot submit`` sends, built and checked before the cluster is contacted.

Runs on the user's machine. The config is validated here; the working directory is shipped as
the job's ``working_dir`` without .venv, runs, .git, caches and files over the size limit; the
entrypoint is ``python -m orchestrator.cli train CFG --set ...`` in that directory (inside a Ray
job Ray sets ``RAY_ADDRESS``, so the train command joins the cluster instead of starting its own).

Resuming: the job *name* fixes where checkpoints go, ``{checkpoint.uri}/{name}``, with
``checkpoint.resume=true``, so submitting again under the same name continues from the latest
committed checkpoint of the earlier attempts; each attempt still gets its own submission id
(``{name}-{utc time}-{random}``), since Ray refuses a submission id it has seen.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.config import JobConfig, load_config
from orchestrator.config_checks import resolve_data_path
from orchestrator.errors import UserError

# Never shipped to the cluster: environments, outputs, VCS data and caches.
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".venv",
    "venv",
    "runs",
    ".git",
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    "build",
    "dist",
    ".pytest_cache",
    ".hypothesis",
    ".mypy_cache",
    ".ruff_cache",
)
DEFAULT_MAX_FILE_MB = 64.0
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# The job's metadata key holding its meshpilot name (``jobs list`` shows it; duplicates are refused by it).
METADATA_NAME_KEY = "meshpilot_name"


@dataclass(frozen=True)
class Submission:
    """What ``submit`` sends: everything checked locally before the cluster is contacted."""

    name: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str]
    # What the user should know about it (printed before sending, never sent).
    notes: tuple[str, ...] = ()


def prepare_submission(
    config_file: str, *, working_dir: str, name: str | None, overrides: list[str], max_file_mb: float
) -> Submission:
    """Validate the config and the working directory here; build the entrypoint and runtime env."""
    root = Path(working_dir).resolve()
    if not root.is_dir():
        raise UserError(f"--working-dir {working_dir!r} is not a directory")
    config_path = Path(config_file)
    if not config_path.is_file():
        raise UserError(f"config file {config_file!r} does not exist; pass the path of a YAML job file")
    config = load_config(config_path, overrides)
    name = name if name is not None else config.name
    check_job_name(name)
    shipped_config = _inside(config_path.resolve(), root, what=f"config {config_file!r}")
    notes = _check_data_is_shipped(config, root)
    excludes, left_out = working_dir_excludes(
        root, max_file_bytes=int(max_file_mb * 2**20), keep=[config_path.resolve(), resolve_data_path(config)]
    )
    if left_out:
        shown = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
        notes.append(f"not shipping {len(left_out)} file(s) over {max_file_mb:g} MiB: {shown} (see --max-file-mb)")
    notes.extend(_checkpoint_location_notes(config))
    return Submission(
        name=name,
        entrypoint=train_entrypoint(shipped_config, job_overrides(config, name=name, user_overrides=overrides)),
        runtime_env={
            "working_dir": str(root),
            "excludes": excludes,
            # Logs reach `meshpilot jobs logs --follow` as they are written.
            "env_vars": {"PYTHONUNBUFFERED": "1"},
        },
        metadata={METADATA_NAME_KEY: name, "meshpilot_config": shipped_config.as_posix()},
        notes=tuple(notes),
    )


def _checkpoint_location_notes(config: JobConfig) -> list[str]:
    uri = config.checkpoint.uri
    if uri is None:
        return ["checkpoint.uri is not set: this job writes no checkpoints, so submitting it again starts over"]
    if "://" not in uri or uri.startswith("file://"):
        return [
            f"checkpoint.uri={uri!r} is a local path: each node writes its own disk, and resuming across "
            "submissions needs storage that every node shares (s3://...)"
        ]
    return []


def check_job_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise UserError(
            f"job name {name!r}: use 1-63 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit (it becomes part of the checkpoint path); pass --name"
        )


def checkpoint_uri_for(base_uri: str, name: str) -> str:
    """Where the job called ``name`` keeps its checkpoints: stable across submissions."""
    return f"{base_uri.rstrip('/')}/{name}"


def submission_id_for(name: str, *, now: datetime.datetime | None = None) -> str:
    """A fresh submission id per attempt (Ray refuses one it has seen), readable by job name."""
    now = now or datetime.datetime.now(datetime.UTC)
    return f"{name}-{now:%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def job_overrides(config: JobConfig, *, name: str, user_overrides: list[str]) -> list[str]:
    """The ``--set`` flags the train command gets on the cluster: the user's, then name and checkpoint.

    Values are written as JSON, which YAML reads back as the same string whatever it holds
    ("1e3", "true" and "null" stay strings).
    """
    overrides = list(user_overrides)
    overrides.append(f"name={json.dumps(name)}")
    if config.checkpoint.uri is not None:
        overrides.append(f"checkpoint.uri={json.dumps(checkpoint_uri_for(config.checkpoint.uri, name))}")
        overrides.append("checkpoint.resume=true")
    return overrides


def train_entrypoint(config_path: Path, overrides: list[str]) -> str:
    """The shell command Ray runs on the cluster, in the unpacked working directory.

    ``python -m orchestrator.cli`` is the ``meshpilot`` console script; run as a module it
    takes the shipped sources when the working directory holds them (Ray also puts the working
    directory first on PYTHONPATH) and the installed package otherwise, and it needs no
    console script on the cluster's PATH.
    """
    argv = ["python", "-m", "orchestrator.cli", "train", config_path.as_posix()]
    for override in overrides:
        argv += ["--set", override]
    return shlex.join(argv)


def working_dir_excludes(root: Path, *, max_file_bytes: int, keep: list[Path | None]) -> tuple[list[str], list[str]]:
    """Ray ``excludes`` patterns for ``root``: the defaults, plus every file over the size limit.

    Returns (patterns, large files left out, relative to root). Files in ``keep`` are always
    shipped. Walks only what would be shipped (excluded directories are not entered).
    """
    kept = {path.resolve() for path in keep if path is not None}
    default_dirs = {pattern for pattern in DEFAULT_EXCLUDES if "*" not in pattern}
    left_out: list[str] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in default_dirs and not d.endswith(".egg-info"))
        for filename in sorted(files):
            path = Path(directory) / filename
            if path.is_symlink() or path.resolve() in kept:
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size > max_file_bytes:
                left_out.append(path.relative_to(root).as_posix())
    patterns = list(DEFAULT_EXCLUDES) + ["/" + _escape_wildmatch(relative) for relative in left_out]
    return patterns, left_out


def _escape_wildmatch(path: str) -> str:
    return re.sub(r"([\\*?\[\]!#])", r"\\\1", path)


def _inside(path: Path, root: Path, *, what: str) -> Path:
    try:
        return path.relative_to(root)
    except ValueError:
        raise UserError(
            f"{what} lies outside the working directory {root} that is shipped to the cluster; "
            "run from a directory that contains it or pass --working-dir"
        ) from None


def _check_data_is_shipped(config: JobConfig, working_dir: Path) -> list[str]:
    """Refuse a relative data path outside the shipped directory; returns a note for an absolute one."""
    if config.data.source != "text":
        return []
    data_path = resolve_data_path(config)
    if data_path is None or data_path.is_relative_to(working_dir):
        return []
    if Path(config.data.path).is_absolute():
        return [f"data.path={config.data.path!r} is not shipped; it must exist at that path on the cluster"]
    raise UserError(
        f"data.path={config.data.path!r} resolves to {data_path}, outside the working directory "
        f"{working_dir} that is shipped to the cluster; move it inside or pass --working-dir"
    )
