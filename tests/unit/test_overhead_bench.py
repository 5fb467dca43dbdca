"""bench/overhead.py's input checks: a bad override or config file is one line and exit 2,
before any run starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.jobs import REPO


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (
            ["--set", "nosuch.key=1"],
            "bench/overhead.py: invalid config: nosuch: unknown key; known keys: name, model, parallelism, "
            "training, data, eval, checkpoint, elastic, metrics, runtime",
        ),
        (
            ["--set", "novalue"],
            "bench/overhead.py: invalid config: --set 'novalue': expected dotted.key=value, "
            "e.g. --set parallelism.tp=4",
        ),
    ],
)
def test_a_bad_override_exits_2_with_one_line(arguments: list[str], line: str):
    process = subprocess.run(
        [sys.executable, "bench/overhead.py", "--quick", *arguments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [line]
