"""The docs' "Bring your own model" example (docs/guides/your-model.md), run as written: its two Python blocks become
``my_models.py`` and ``train.py`` in a fresh directory (with the config and text they name),
and ``python train.py`` trains the user's family on pp=2 x dp_shard=2 on its own embedded Ray
cluster (the ranks import ``my_models`` through ``PYTHONPATH``, as from an installed package)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.jobs import REPO


def readme_blocks() -> dict[str, str]:
    """The guide's python blocks that start with a ``# NAME.py`` comment, by that name."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "guides" / "your-model.md").read_text(), flags=re.S)
    named = {}
    for block in blocks:
        first = block.splitlines()[0]
        if match := re.match(r"# (\w+\.py):", first):
            named[match.group(1)] = block
    return named


def test_the_readme_example_trains_a_users_family(tmp_path):
    blocks = readme_blocks()
    assert set(blocks) >= {"my_models.py", "train.py"}
    for name, text in blocks.items():
        (tmp_path / name).write_text(text)
    # The files the example names, where a user running it from a checkout has them.
    for relative in ("configs/tiny-3d.yaml", "data/sample.txt"):
        (tmp_path / relative).parent.mkdir(exist_ok=True)
        (tmp_path / relative).write_bytes((REPO / relative).read_bytes())
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    process = subprocess.run(
        [sys.executable, str(tmp_path / "train.py")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
    )
    assert process.returncode == 0, process.stderr[-3000:]
    exit_code, first_loss, last_loss, run_dir = process.stdout.strip().splitlines()[-1].split(" ", 3)
    assert exit_code == "0"
    assert float(last_loss) < float(first_loss) - 0.5  # it trained
    assert (tmp_path / run_dir / "events.jsonl").exists()
