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
