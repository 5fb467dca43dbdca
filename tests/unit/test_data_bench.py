"""bench/data.py's arithmetic: tokens per second from medians without the warm-up, the ratios to the
encode_batch loop, the read fraction of the steady steps with each generation's first step apart,
and the goals judged from those figures."""

from __future__ import annotations

import pytest

from bench.data import read_fractions, summarize, summarize_prepare

TOKENS = 1_000_000


def runs(seconds: dict[str, list[float]]) -> dict[str, list[tuple[float, int, float]]]:
    """Per kind, each run's (seconds, tokens, seconds of the Ray Data pass); the first is the warm-up."""
    return {kind: [(value, TOKENS, value - 0.1) for value in values] for kind, values in seconds.items()}


def step(number: int, data_s: float, step_time_s: float) -> dict:
    return {"event": "step", "step": number, "step_time_s": step_time_s, "phases_s": {"data_s": data_s}}


def test_prepare_throughput_is_tokens_over_the_median_and_the_warm_up_is_apart():
    figures = summarize_prepare(
        runs(
            {
                "ours": [9.0, 2.0, 2.5, 1.0],
                "ours_workers1": [9.0, 4.0, 4.0, 4.0],
                "ours_workers2": [9.0, 2.0, 2.0, 2.0],
                "encode_batch": [3.0, 1.6, 1.6, 1.6],
            }
        ),
        start_up_s=3.25,
    )
    assert figures["tokens_per_s"] == {
        "ours": 500_000,
        "ours_workers1": 250_000,
        "ours_workers2": 500_000,
        "encode_batch": 625_000,
    }
    assert figures["prepare_ratio_vs_encode_batch"] == 0.8
    assert figures["prepare_ratio_workers1_vs_encode_batch"] == 0.4
    assert figures["workers2_vs_workers1"] == 2.0
    assert figures["ray_data_pass_s"]["ours"] == pytest.approx(1.9)
    assert figures["first_run_s"]["ours"] == 9.0 and figures["cluster_start_s"] == 3.25
    assert figures["rounds_s"]["ours"] == [2.0, 2.5, 1.0]


def test_kinds_that_disagree_on_the_tokens_are_refused():
    mismatched = runs({"ours": [1.0, 1.0], "ours_workers1": [1.0, 1.0], "ours_workers2": [1.0, 1.0]})
    mismatched["encode_batch"] = [(1.0, TOKENS - 1, 1.0), (1.0, TOKENS - 1, 1.0)]
    with pytest.raises(SystemExit, match="different token counts"):
        summarize_prepare(mismatched, start_up_s=1.0)


def test_the_first_step_of_each_generation_is_reported_apart():
    events = [
        {"event": "start"},
        step(1, 0.5, 1.0),  # nothing prefetched yet
        step(2, 0.01, 1.0),
        step(3, 0.03, 1.0),
        {"event": "recovered"},
        step(4, 0.2, 0.5),
        step(5, 0.02, 0.5),
    ]
    fractions = read_fractions(events)
    assert (fractions["median"], fractions["max"]) == (0.03, 0.04)
    assert fractions["first_of_generation"] == [0.5, 0.4]
    assert fractions["median_data_ms"] == 20.0 and fractions["steps"] == 5


def test_goals():
    prepare = {"prepare_ratio_vs_encode_batch": 0.79}
    reads = {"tokens": {"max": 0.02}, "synthetic": {"max": 0.001}}
    assert summarize(prepare, reads, quick=True)["goals_met"] == {
        "prepare_vs_encode_batch>=0.8x": False,
        "read_fraction_max<=0.02": True,
    }
