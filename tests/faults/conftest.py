"""Uninterrupted runs shared by the fault modules: a job's reference losses are computed once
per session, whichever module asks first (modules whose references are the same job share it)."""

from __future__ import annotations

import pytest

from orchestrator.config import load_config
from tests.faults.harness import run_job
from tests.jobs import DEMO_CONFIG, losses


@pytest.fixture(scope="session")
def uninterrupted(ray_cluster, tmp_path_factory):
    """``uninterrupted(*overrides)``: the per-step losses of the demo job with ``overrides``, run
    without faults (on the driver, once per distinct resolved config)."""
    cache: dict[str, dict[int, float]] = {}

    def of(*overrides: str) -> dict[int, float]:
        key = repr(load_config(DEMO_CONFIG, list(overrides)))  # the same job however it is spelled
        if key not in cache:
            result, events = run_job(tmp_path_factory.mktemp("uninterrupted"), *overrides)
            assert result.exit_code == 0, result.reason
            cache[key] = losses(events)
        return cache[key]

    return of
