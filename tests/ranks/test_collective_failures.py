"""A rank whose collective fails says why by what the rank knows, never by message text.

Two-rank cases on real gloo in two spawned processes on a FileStore (no Ray,
``tests/ranks/gloo_ranks.py``), classifying the error rank 0 raised with the function the actor
uses (``workers.rank_failures.classify_failure``): a rank whose own collective times out is TIMEOUT
(its own failure), a rank whose peer's connection closes is PEER_FAILURE (an echo of the
peer's failure). The classification of every other error: tests/unit/test_failure_kinds.py.
"""

from __future__ import annotations

import pytest

from tests.ranks.gloo_ranks import run_rank
from tests.ranks.spawned_ranks import rank_context
from workers.rank_failures import classify_failure
from workers.spec.messages import FailureKind


@pytest.fixture(scope="module")
def two_rank_outcomes(tmp_path_factory) -> dict[str, FailureKind | None]:
    """Both scenarios at once (four processes), so the module pays one start-up."""
    context = rank_context()
    results = context.Queue()
    folder = tmp_path_factory.mktemp("stores")
    processes = [
        context.Process(target=run_rank, args=(rank, scenario, str(folder / scenario), results), daemon=True)
        for scenario in ("own_timeout", "peer_dies")
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    errors_seen = dict(results.get(timeout=120) for _ in range(2))
    for process in processes:
        process.join(timeout=30)
    return {
        scenario: None if error is None else classify_failure(error, aborted=False)
        for scenario, error in errors_seen.items()
    }


def test_a_rank_whose_own_collective_times_out_fails_with_timeout(two_rank_outcomes):
    assert two_rank_outcomes["own_timeout"] == FailureKind.TIMEOUT


def test_a_rank_whose_peer_connection_closes_is_an_echo_of_the_peer(two_rank_outcomes):
    assert two_rank_outcomes["peer_dies"] == FailureKind.PEER_FAILURE
