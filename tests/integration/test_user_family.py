"""A family from outside meshpilot, named in the config, trains on every parallelism at once.

    python -m pytest tests/integration/test_user_family.py -q

``model.family=tests.families.gpt2:Gpt2Family`` (learned positions, LayerNorm, GELU MLP,
biases: nothing of the shipped llama family) on the demo's pp=2 x dp_shard=2 x tp=2 against
one process, real Ray and gloo: the ranks import the family from the path the driver gave
them, and the per-step losses agree within 1e-3 relative (which needs the initial weights to
be the same on both meshes). And a family that does not import is one line and exit 2.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.jobs import REPO, losses, single_rank, train

FAMILY = "model.family=tests.families.gpt2:Gpt2Family"
STEPS = 10


@pytest.mark.slow  # 8 ranks, ~35 s on 2 cores; make test trains a user family through docs/guides/your-model.md
def test_a_user_family_on_8_ranks_trains_like_one_process(ray_cluster, tmp_path):
    reference_result, reference_events = train(tmp_path / "one", f"training.steps={STEPS}", FAMILY, *single_rank())
    assert reference_result.exit_code == 0, reference_result.reason
    result, events = train(tmp_path / "eight", f"training.steps={STEPS}", FAMILY)
    assert result.exit_code == 0, result.reason
    start = next(e for e in events if e["event"] == "start")
    assert start["mesh"] == {"dp_replicate": 1, "pp": 2, "dp_shard": 2, "cp": 1, "tp": 2} and start["world_size"] == 8
    parallel, reference = losses(events), losses(reference_events)
    assert sorted(parallel) == sorted(reference) == list(range(1, STEPS + 1))
    for step, expected in reference.items():
        assert parallel[step] == pytest.approx(expected, rel=1e-3), f"step {step}"
    assert parallel[STEPS] < parallel[1] - 0.5  # it learned the text


@pytest.mark.parametrize(
    ("family", "says"),
    [
        ("nope.mod:X", "module nope.mod does not import (No module named 'nope'); install the package"),
        ("tests.families.gpt2:Gpt2", "has no ModelFamily subclass named Gpt2; name a class that subclasses"),
    ],
)
def test_a_family_that_cannot_be_loaded_is_one_line_and_exit_2(family, says):
    finished = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "train", "--set", f"model.family={family}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 2, finished.stderr
    assert finished.stdout == ""
    assert finished.stderr.startswith(f"meshpilot: invalid config: model.family {family!r}: ")
    assert says in finished.stderr
    assert finished.stderr.count("\n") == 1 and "Traceback" not in finished.stderr
