"""The head's dashboard, through Ray's Job Submission SDK (``ray.job_submission.JobSubmissionClient``).

Runs on the user's machine. ``resolve_address`` finds the dashboard, ``job_client`` opens the
SDK client and turns Ray's errors into one-line UserErrors, and the rest submits, follows and
waits for jobs through it. Messages go to stderr prefixed ``meshpilot:``; a job's logs go to stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from orchestrator.errors import UserError
from orchestrator.submission.auth import auth_headers, auth_message
from orchestrator.submission.packaging import METADATA_NAME_KEY, Submission, submission_id_for

TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")


def resolve_address(flag: str | None) -> str:
    """The dashboard URL: the flag, else RAY_API_SERVER_ADDRESS, else an http RAY_ADDRESS."""
    address = flag or os.environ.get("RAY_API_SERVER_ADDRESS")
    if not address:
        env_address = os.environ.get("RAY_ADDRESS", "")
        if env_address.startswith(("http://", "https://")):
            address = env_address
    if not address:
        raise UserError(
            "no Ray cluster address: pass --address http://HEAD:8265 (the head's dashboard) "
            "or set RAY_API_SERVER_ADDRESS"
        )
    if address.startswith("ray://"):
        raise UserError(
            f"--address {address}: that is a Ray Client address; jobs are submitted to the "
            "dashboard, e.g. http://HEAD:8265"
        )
    if "://" not in address:
        address = f"http://{address}"
    if not address.startswith(("http://", "https://")):
        raise UserError(f"--address {address}: expected http://HEAD:8265 or https://HEAD:8265")
    return address.rstrip("/")


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
        raise UserError(auth_message(str(error), address, sent_token=bool(headers))) from None
    except (ConnectionError, requests.exceptions.ConnectionError, requests.exceptions.Timeout):
        raise UserError(
            f"cannot reach the Ray dashboard at {address}: is the head running and its dashboard "
            "port (8265 by default) reachable from here? Pass --address http://HEAD:8265"
        ) from None
    except RuntimeError as error:
        text = str(error)
        if job_id is not None and ("404" in text or "does not exist" in text):
            raise UserError(
                f"no job {job_id!r} on the cluster at {address}; "
                f"list them with: meshpilot jobs list --address {address}"
            ) from None
        raise UserError(f"the Ray cluster at {address} refused the request: {first_line(text)}") from None


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


def submit(client: Any, submission: Submission) -> str:
    """Send ``submission`` under a fresh submission id; returns the id."""
    try:
        return client.submit_job(
            entrypoint=submission.entrypoint,
            submission_id=submission_id_for(submission.name),
            runtime_env=submission.runtime_env,
            metadata=submission.metadata,
        )
    except ValueError as error:  # the SDK's packaging refuses e.g. an oversized working directory
        raise UserError(f"the job was not submitted: {first_line(str(error))}") from None


def refuse_running_duplicate(client: Any, name: str, address: str) -> None:
    """Two running jobs of one name would write one checkpoint prefix: refuse the second."""
    for job in client.list_jobs():
        if (job.metadata or {}).get(METADATA_NAME_KEY) == name and str(job.status) not in TERMINAL_STATUSES:
            raise UserError(
                f"a job named {name!r} is still {job.status} as {job.submission_id}: stop it first "
                f"(meshpilot jobs stop {job.submission_id} --address {address}) or pass another --name"
            )


def follow(client: Any, job_id: str) -> int:
    """Stream the logs until the job ends; exit code 0 only if it succeeded."""

    async def stream() -> None:
        async for chunk in client.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    try:
        asyncio.run(stream())
    except KeyboardInterrupt:
        note(f"stopped following; {job_id} keeps running (meshpilot jobs stop {job_id} ends it)")
        return 130
    except RuntimeError:
        pass  # the stream can close before the final status is written; the status below decides
    status = wait_terminal(client, job_id, timeout_s=30.0)
    note(f"{job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def wait_terminal(client: Any, job_id: str, *, timeout_s: float) -> str:
    """The job's status once it has ended, or its last status when ``timeout_s`` runs out."""
    deadline = time.monotonic() + timeout_s
    status = str(client.get_job_status(job_id))
    while status not in TERMINAL_STATUSES and time.monotonic() < deadline:
        time.sleep(0.5)
        status = str(client.get_job_status(job_id))
    return status


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no reason given"


def note(message: str) -> None:
    print(f"meshpilot: {message}", file=sys.stderr, flush=True)
