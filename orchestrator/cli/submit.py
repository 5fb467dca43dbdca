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

This module holds the flags and their handlers only. What is sent is built and checked in
``orchestrator/submission/packaging.py``, the dashboard is reached through ``client.py`` there,
and a token-protected cluster's token (never printed) is ``auth.py``'s.
"""

from __future__ import annotations

import argparse
import sys

from orchestrator.submission.client import (
    follow,
    job_client,
    note,
    refuse_running_duplicate,
    resolve_address,
    submit,
    wait_terminal,
)
from orchestrator.submission.packaging import DEFAULT_MAX_FILE_MB, METADATA_NAME_KEY, prepare_submission


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``submit`` and ``jobs`` to the ``meshpilot`` parser."""
    submit = subparsers.add_parser(
        "submit",
        help="run a job on a Ray cluster (Ray Job Submission API)",
        description="Validate CFG here, ship the working directory and run `meshpilot train CFG` as a Ray job.",
    )
    submit.add_argument("config", metavar="CFG", help="job config (YAML), inside the working directory")
    _add_address(submit)
    submit.add_argument(
        "--name",
        help="job name: fixes the checkpoint location {checkpoint.uri}/{name}, "
        "so submitting again under the same name resumes (default: the config's name)",
    )
    submit.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set parallelism.tp=4 (repeatable)",
    )
    submit.add_argument(
        "--follow", action="store_true", help="stream the job's logs until it ends; exit 0 only if it succeeded"
    )
    submit.add_argument(
        "--working-dir", default=".", help="directory shipped to the cluster (default: the current one)"
    )
    submit.add_argument(
        "--max-file-mb",
        type=float,
        default=DEFAULT_MAX_FILE_MB,
        help=f"leave out files larger than this (default {DEFAULT_MAX_FILE_MB:g}); "
        "the config and the data file are always shipped",
    )
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
    parser.add_argument(
        "--address",
        help="the head's dashboard, http://HEAD:8265 "
        "(default: RAY_API_SERVER_ADDRESS, or RAY_ADDRESS when it is an http:// address)",
    )


# ------------------------------------------------------------------------------ commands
def submit_command(args: argparse.Namespace) -> int:
    address = resolve_address(args.address)
    submission = prepare_submission(
        args.config,
        working_dir=args.working_dir,
        name=args.name,
        overrides=args.overrides,
        max_file_mb=args.max_file_mb,
    )
    for message in submission.notes:
        note(message)
    with job_client(address) as client:
        refuse_running_duplicate(client, submission.name, address)
        submission_id = submit(client, submission)
        print(submission_id, flush=True)
        note(
            f"submitted {submission.name!r} as {submission_id}; follow it with: "
            f"meshpilot jobs logs {submission_id} --follow --address {address}"
        )
        return follow(client, submission_id) if args.follow else 0


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
            return follow(client, args.job_id)
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
            status = wait_terminal(client, args.job_id, timeout_s=120.0)
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
