"""A Ray cluster started as a long-lived one is, for a benchmark or a test to join by address.

Runs where the benchmark (or test) runs; nothing of it runs on a rank.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import REPO
from orchestrator.driver.cluster import worker_pythonpath


@contextmanager
def running_ray_cluster(num_cpus: int) -> Iterator[str]:
    """A Ray head started by ``ray start --head --block`` (as a long-lived cluster or a KubeRay
    head is; its workers import this checkout), up before it yields its address; every process
    it started is stopped after."""
    head = subprocess.Popen(
        [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--port", "0"]
        + [f"--num-cpus={num_cpus}", "--include-dashboard=false", "--disable-usage-stats"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=worker_pythonpath()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the head and everything it starts
    )
    try:
        assert head.stdout is not None
        output = []
        for line in head.stdout:
            output.append(line)
            if found := re.search(r"--address='([^']+)'", line):  # printed once the head is up
                break
        else:
            raise SystemExit("ray start --head failed:\n" + "".join(output[-40:]))
        yield found.group(1)
    finally:
        # Not SIGTERM: `ray start --block` then drains the node for up to 30 s first.
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=60)


# A driver that connects and keeps one idle actor: what a meshpilot job's driver and its store
# actor add to a running cluster before they do any work.
_IDLE_DRIVER = """
import ray, time

@ray.remote(num_cpus=0)
class Idle:
    def ready(self):
        return True

actor = Idle.remote()
ray.get(actor.ready.remote())
print("ready", flush=True)
time.sleep(24 * 3600)
"""


@contextmanager
def idle_ray_job(num_cpus: int) -> Iterator[None]:
    """A running Ray cluster (``running_ray_cluster``) with a connected driver holding one idle
    actor, up before it yields and stopped after: the reference for what Ray's presence alone
    costs a job that shares the machine with it."""
    with running_ray_cluster(num_cpus):
        driver = subprocess.Popen(
            [sys.executable, "-c", _IDLE_DRIVER],
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=worker_pythonpath(), RAY_ADDRESS="auto"),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert driver.stdout is not None
            if driver.stdout.readline().strip() != "ready":
                raise SystemExit("the idle Ray driver did not start")
            yield
        finally:
            driver.kill()
            driver.wait(timeout=60)
