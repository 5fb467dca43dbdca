"""``meshpilot submit`` and ``meshpilot jobs``: run a job on an existing Ray cluster as a Ray job.

Runs on the user's machine (never on the cluster). It talks to the head's dashboard through
Ray's Job Submission SDK (``ray.job_submission.JobSubmissionClient``):

    meshpilot submit configs/tiny-3d.yaml --address http://HEAD:8265 [--name NAME] [--follow]
    meshpilot jobs status|logs|stop|list [ID] --address http://HEAD:8265

``submit`` validates the config here, before anything is uploaded, then ships the working
directory (without .venv, runs, .git, caches and files over ``--max-file-mb``) as the job's
``working_dir`` and starts ``meshpilot train CFG --set ...`` there. Inside a Ray job Ray sets
``RAY_ADDRESS``, so the train command joins the cluster instead of starting its own.

Resuming: the job *name* (``--name``, else the config's ``name``) fixes where checkpoints go,
``{checkpoint.uri}/{name}``, with ``checkpoint.resume=true``. Submitting again under the same
name therefore continues from the latest committed checkpoint of the earlier attempts; each
attempt still gets its own submission id (``{name}-{utc time}-{random}``), since Ray refuses a
submission id it has seen. A second attempt is refused while one of the same name still runs
(two writers on one checkpoint prefix).

Token authentication (on by default since Ray 2.52 clusters): the token is read the way Ray
reads it (``RAY_AUTH_TOKEN``, the file named by ``RAY_AUTH_TOKEN_PATH``, or
``~/.ray/auth_token``) and sent as a bearer header, unless ``RAY_AUTH_MODE=disabled``. The
token is never printed: it is registered with orchestrator.observe.redact, and every message here
names where a token is looked for, never its value.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import secrets
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from orchestrator.config import JobConfig, load_config, resolve_data_path
from orchestrator.errors import UserError
from orchestrator.observe.redact import register_secret

# Never shipped to the cluster: environments, outputs, VCS data and caches.
DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".venv", "venv", "runs", ".git", "__pycache__", "*.pyc", "*.egg-info", "build", "dist",
    ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache",
)
DEFAULT_MAX_FILE_MB = 64.0
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
METADATA_NAME_KEY = "meshpilot_name"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``submit`` and ``jobs`` to the ``meshpilot`` parser."""
    submit = subparsers.add_parser(
        "submit", help="run a job on a Ray cluster (Ray Job Submission API)",
        description="Validate CFG here, ship the working directory and run `meshpilot train CFG` as a Ray job.")
    submit.add_argument("config", metavar="CFG", help="job config (YAML), inside the working directory")
    _add_address(submit)
    submit.add_argument("--name", help="job name: fixes the checkpoint location {checkpoint.uri}/{name}, "
                                       "so submitting again under the same name resumes (default: the config's name)")
    submit.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set parallelism.tp=4 (repeatable)")
    submit.add_argument("--follow", action="store_true", help="stream the job's logs until it ends; exit 0 only if it succeeded")
    submit.add_argument("--working-dir", default=".", help="directory shipped to the cluster (default: the current one)")
    submit.add_argument("--max-file-mb", type=float, default=DEFAULT_MAX_FILE_MB,
                        help=f"leave out files larger than this (default {DEFAULT_MAX_FILE_MB:g}); "
                             "the config and the data file are always shipped")
    submit.set_defaults(handler=submit_command)

    jobs = subparsers.add_parser("jobs", help="status, logs, stop and list of submitted jobs")
    actions = jobs.add_subparsers(dest="jobs_action", metavar="ACTION")
    actions.required = True
    status = actions.add_parser("status", help="print a job's status")
    status.add_argument("job_id", metavar="ID")
    logs = actions.add_parser("logs", help="print a job's logs")
    logs.add_argument("job_id", metavar="ID")
    logs.add_argument("--follow", action="store_true", help="stream until the job ends")
    stop = actions.add_parser("stop", help="stop a job")
    stop.add_argument("job_id", metavar="ID")
    stop.add_argument("--wait", action="store_true", help="return once the job has stopped")
    listing = actions.add_parser("list", help="list the cluster's jobs")
    for action in (status, logs, stop, listing):
        _add_address(action)
    status.set_defaults(handler=status_command)
    logs.set_defaults(handler=logs_command)
    stop.set_defaults(handler=stop_command)
    listing.set_defaults(handler=list_command)


def _add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="the head's dashboard, http://HEAD:8265 "
                                          "(default: RAY_API_SERVER_ADDRESS, or RAY_ADDRESS when it is an http:// address)")


# ------------------------------------------------------------------------------ commands
@dataclass(frozen=True)
class Submission:
    """What ``submit`` sends: everything checked locally before the cluster is contacted."""

    name: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str]


def submit_command(args: argparse.Namespace) -> int:
    address = resolve_address(args.address)
    submission = prepare_submission(args)
    with job_client(address) as client:
        _refuse_running_duplicate(client, submission.name, address)
        try:
            submission_id = client.submit_job(
                entrypoint=submission.entrypoint, submission_id=submission_id_for(submission.name),
                runtime_env=submission.runtime_env, metadata=submission.metadata)
        except ValueError as error:  # the SDK's packaging refuses e.g. an oversized working directory
            raise UserError(f"the job was not submitted: {_first_line(str(error))}") from None
        print(submission_id, flush=True)
        _note(f"submitted {submission.name!r} as {submission_id}; follow it with: "
              f"meshpilot jobs logs {submission_id} --follow --address {address}")
        return _follow(client, submission_id) if args.follow else 0


def prepare_submission(args: argparse.Namespace) -> Submission:
    """Validate the config and the working directory here; build the entrypoint and runtime env."""
    working_dir = Path(args.working_dir).resolve()
    if not working_dir.is_dir():
        raise UserError(f"--working-dir {args.working_dir!r} is not a directory")
    config_path = Path(args.config)
    if not config_path.is_file():
        raise UserError(f"config file {args.config!r} does not exist; pass the path of a YAML job file")
    config = load_config(config_path, args.overrides)
    name = args.name if args.name is not None else config.name
    check_job_name(name)
    shipped_config = _inside(config_path.resolve(), working_dir, what=f"config {args.config!r}")
    _check_data_is_shipped(config, working_dir)
    excludes, left_out = working_dir_excludes(
        working_dir, max_file_bytes=int(args.max_file_mb * 2**20),
        keep=[config_path.resolve(), resolve_data_path(config)])
    if left_out:
        shown = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
        _note(f"not shipping {len(left_out)} file(s) over {args.max_file_mb:g} MiB: {shown} (see --max-file-mb)")
    _note_checkpoint_location(config)
    return Submission(
        name=name,
        entrypoint=train_entrypoint(shipped_config, job_overrides(config, name=name, user_overrides=args.overrides)),
        runtime_env={
            "working_dir": str(working_dir),
            "excludes": excludes,
            # Logs reach `meshpilot jobs logs --follow` as they are written.
            "env_vars": {"PYTHONUNBUFFERED": "1"},
        },
        metadata={METADATA_NAME_KEY: name, "meshpilot_config": shipped_config.as_posix()},
    )


def _note_checkpoint_location(config: JobConfig) -> None:
    uri = config.checkpoint.uri
    if uri is None:
        _note("checkpoint.uri is not set: this job writes no checkpoints, so submitting it again starts over")
    elif "://" not in uri or uri.startswith("file://"):
        _note(f"checkpoint.uri={uri!r} is a local path: each node writes its own disk, and resuming across "
              "submissions needs storage that every node shares (s3://...)")


def status_command(args: argparse.Namespace) -> int:
    address = resolve_address(args.address)
    with job_client(address, job_id=args.job_id) as client:
        info = client.get_job_info(args.job_id)
    fields = [f"{args.job_id}: {info.status}"]
    name = (info.metadata or {}).get(METADATA_NAME_KEY)
    if name:
        fields.append(f"name={name}")
    print("  ".join(fields))
    if info.message:
        print(f"  {info.message}")
    return 0


def logs_command(args: argparse.Namespace) -> int:
    address = resolve_address(args.address)
    with job_client(address, job_id=args.job_id) as client:
        if args.follow:
            return _follow(client, args.job_id)
        sys.stdout.write(client.get_job_logs(args.job_id))
        sys.stdout.flush()
    return 0


def stop_command(args: argparse.Namespace) -> int:
    address = resolve_address(args.address)
    with job_client(address, job_id=args.job_id) as client:
        if not client.stop_job(args.job_id):
            status = client.get_job_status(args.job_id)
            print(f"{args.job_id}: already {status}, nothing to stop")
            return 0
        print(f"{args.job_id}: stop requested")
        if args.wait:
            status = _wait_terminal(client, args.job_id, timeout_s=120.0)
            print(f"{args.job_id}: {status}")
    return 0


def list_command(args: argparse.Namespace) -> int:
    address = resolve_address(args.address)
    with job_client(address) as client:
        jobs = [job for job in client.list_jobs() if job.submission_id]
    for job in sorted(jobs, key=lambda job: job.start_time or 0):
        name = (job.metadata or {}).get(METADATA_NAME_KEY, "-")
        print(f"{job.submission_id}  {job.status}  {name}")
    return 0


# --------------------------------------------------------------------- pure helpers
def check_job_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise UserError(f"job name {name!r}: use 1-63 letters, digits, '.', '_' or '-', starting with a letter "
                        "or digit (it becomes part of the checkpoint path); pass --name")


def checkpoint_uri_for(base_uri: str, name: str) -> str:
    """Where the job called ``name`` keeps its checkpoints: stable across submissions."""
    return f"{base_uri.rstrip('/')}/{name}"


def submission_id_for(name: str, *, now: datetime.datetime | None = None) -> str:
    """A fresh submission id per attempt (Ray refuses one it has seen), readable by job name."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
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


def resolve_address(flag: str | None) -> str:
    """The dashboard URL: the flag, else RAY_API_SERVER_ADDRESS, else an http RAY_ADDRESS."""
    address = flag or os.environ.get("RAY_API_SERVER_ADDRESS")
    if not address:
        env_address = os.environ.get("RAY_ADDRESS", "")
        if env_address.startswith(("http://", "https://")):
            address = env_address
    if not address:
        raise UserError("no Ray cluster address: pass --address http://HEAD:8265 (the head's dashboard) "
                        "or set RAY_API_SERVER_ADDRESS")
    if address.startswith("ray://"):
        raise UserError(f"--address {address}: that is a Ray Client address; jobs are submitted to the "
                        "dashboard, e.g. http://HEAD:8265")
    if "://" not in address:
        address = f"http://{address}"
    if not address.startswith(("http://", "https://")):
        raise UserError(f"--address {address}: expected http://HEAD:8265 or https://HEAD:8265")
    return address.rstrip("/")


def auth_headers() -> dict[str, str]:
    """The bearer header for a token-protected cluster, looked up the way Ray looks it up.

    Nothing is sent with ``RAY_AUTH_MODE=disabled`` or when no token exists (the cluster then
    says whether it wanted one).
    """
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return {}
    token_path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if token_path and not os.environ.get("RAY_AUTH_TOKEN"):
        path = Path(token_path).expanduser()
        if not path.is_file() or not path.read_text(encoding="utf-8", errors="replace").strip():
            raise UserError(f"RAY_AUTH_TOKEN_PATH={token_path} is not a readable, non-empty file; point it at "
                            "the cluster's token file (the head's ~/.ray/auth_token)")
    from ray._raylet import AuthenticationTokenLoader  # the loader Ray's own clients use

    loader = AuthenticationTokenLoader.instance()
    if not loader.has_token(ignore_auth_mode=True):
        return {}
    headers = dict(loader.get_token_for_http_header(ignore_auth_mode=True))
    for value in headers.values():
        register_secret(value)
        register_secret(value.split(" ", 1)[-1])
    return headers


# ------------------------------------------------------------------- cluster access
@contextlib.contextmanager
def job_client(address: str, *, job_id: str | None = None) -> Iterator[Any]:
    """A JobSubmissionClient for ``address``; Ray's errors become one-line UserErrors.

    Our ``--address`` wins over RAY_ADDRESS: the SDK prefers the environment, so the address
    is handed to it through RAY_API_SERVER_ADDRESS (its first choice) while it is built.
    """
    import requests
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    headers = auth_headers()
    try:
        with _environment(RAY_API_SERVER_ADDRESS=address):
            client = JobSubmissionClient(address, headers=headers)
        yield client
    except AuthenticationError as error:
        raise UserError(_auth_message(str(error), address, sent_token=bool(headers))) from None
    except (ConnectionError, requests.exceptions.ConnectionError, requests.exceptions.Timeout):
        raise UserError(f"cannot reach the Ray dashboard at {address}: is the head running and its dashboard "
                        "port (8265 by default) reachable from here? Pass --address http://HEAD:8265") from None
    except RuntimeError as error:
        text = str(error)
        if job_id is not None and ("404" in text or "does not exist" in text):
            raise UserError(f"no job {job_id!r} on the cluster at {address}; "
                            f"list them with: meshpilot jobs list --address {address}") from None
        raise UserError(f"the Ray cluster at {address} refused the request: {_first_line(text)}") from None


def _auth_message(text: str, address: str, *, sent_token: bool) -> str:
    if "required" in text.lower() or not sent_token:
        return (f"the Ray cluster at {address} requires a token (token authentication is on) and none was "
                "found: copy the head's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN")
    return (f"the Ray cluster at {address} rejected the token (from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
            "~/.ray/auth_token): use the token the cluster was started with")


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _refuse_running_duplicate(client: Any, name: str, address: str) -> None:
    for job in client.list_jobs():
        if (job.metadata or {}).get(METADATA_NAME_KEY) == name and str(job.status) not in TERMINAL_STATUSES:
            raise UserError(f"a job named {name!r} is still {job.status} as {job.submission_id}: stop it first "
                            f"(meshpilot jobs stop {job.submission_id} --address {address}) or pass another --name")


def _follow(client: Any, job_id: str) -> int:
    """Stream the logs until the job ends; exit code 0 only if it succeeded."""
    async def stream() -> None:
        async for chunk in client.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    try:
        asyncio.run(stream())
    except KeyboardInterrupt:
        _note(f"stopped following; {job_id} keeps running (meshpilot jobs stop {job_id} ends it)")
        return 130
    except RuntimeError:
        pass  # the stream can close before the final status is written; the status below decides
    status = _wait_terminal(client, job_id, timeout_s=30.0)
    _note(f"{job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def _wait_terminal(client: Any, job_id: str, *, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    status = str(client.get_job_status(job_id))
    while status not in TERMINAL_STATUSES and time.monotonic() < deadline:
        time.sleep(0.5)
        status = str(client.get_job_status(job_id))
    return status


def _inside(path: Path, root: Path, *, what: str) -> Path:
    try:
        return path.relative_to(root)
    except ValueError:
        raise UserError(f"{what} lies outside the working directory {root} that is shipped to the cluster; "
                        "run from a directory that contains it or pass --working-dir") from None


def _check_data_is_shipped(config: JobConfig, working_dir: Path) -> None:
    if config.data.source != "text":
        return
    data_path = resolve_data_path(config)
    if data_path is not None and not data_path.is_relative_to(working_dir):
        if Path(config.data.path).is_absolute():
            _note(f"data.path={config.data.path!r} is not shipped; it must exist at that path on the cluster")
        else:
            raise UserError(f"data.path={config.data.path!r} resolves to {data_path}, outside the working directory "
                            f"{working_dir} that is shipped to the cluster; move it inside or pass --working-dir")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no reason given"


def _note(message: str) -> None:
    print(f"meshpilot: {message}", file=sys.stderr, flush=True)
