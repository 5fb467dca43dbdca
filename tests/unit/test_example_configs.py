"""Every shipped config is a valid job once the files it names exist (the tiny demo runs as is)."""

from __future__ import annotations

import yaml

# The generic key and type checks only: the files and buckets these configs name exist on a user's machine.
from orchestrator.config import JobConfig, _build
from tests.jobs import REPO


def test_every_key_of_every_shipped_config_is_known_and_well_typed():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        problems: list[str] = []
        _build(JobConfig, yaml.safe_load(path.read_text()), "", problems)
        assert problems == [], f"{path.name}: {problems}"
