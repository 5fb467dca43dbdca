"""bench/compile.py's arithmetic, from small synthetic runs: a trainer's first step against its
steady steps (warm-up left out) with what it compiled, the kill runs' medians, and the result
line's ratios and goal."""

from __future__ import annotations

from bench.compile import first_step, medians, summarize


def steps(*times: float, compiled_first: int = 0, hits_first: int = 0) -> list[dict]:
    return [
        {"step_time_s": t, "compiled": compiled_first if i == 0 else 0, "cache_hits": hits_first if i == 0 else 0}
        for i, t in enumerate(times)
    ]


def test_first_step_is_measured_against_the_steps_after_the_warm_up():
    figures = first_step(steps(30.0, 5.0, 1.0, 2.0, 3.0, compiled_first=2))
    assert figures["first_step_s"] == 30.0
    assert figures["steady_step_s"] == 2.0  # the median of steps 3-5
    assert figures["ratio"] == 15.0
    assert (figures["compiled"], figures["cache_hits"], figures["compiled_later"]) == (2, 0, 0)


def test_summary_gives_each_ratio_and_judges_the_kill_goal():
    parts = {
        "step": {"ratio": 0.9},
        "new_mesh": {
            "cold": first_step(steps(30.0, 1.0, 1.0, 1.0, compiled_first=2)),
            "warm": first_step(steps(4.0, 1.0, 1.0, 1.0, hits_first=2)),
        },
        "kill": {"ratio": 1.6, "on": {"lost_steps": 0}, "off": {"lost_steps": 0}},
    }
    summary = summarize(parts)
    assert summary["step_compiled_over_eager"] == 0.9
    assert summary["first_step_over_steady"] == {"cold": 30.0, "warm": 4.0}
    assert summary["compiled_on_seen_layout"] == 0
    assert summary["kill_goal_met"] is False
    assert summary["kill_lost_steps"] == {"on": 0, "off": 0}
    assert summary["grow_on_over_off"] is None  # not measured: no figure, not a failure


def kill_run(fault_to_step_s: float, lost_steps: int = 0, counts: dict | None = None) -> dict:
    return {
        "fault_to_step_s": fault_to_step_s,
        "first_step_s": fault_to_step_s / 2,
        "steady_step_s": 0.3,
        "lost_steps": lost_steps,
        "new_mesh": {"dp_shard": 2},
        "compile_first_step": {"compiled": 8, "cache_hits": 0},
        "compile_on_new_mesh": counts,
    }


def test_kill_runs_give_median_times_the_most_steps_lost_and_every_runs_counts():
    hits = {"compiled": 0, "cache_hits": 4}
    figures = medians(
        [kill_run(1.0, counts=hits), kill_run(3.0, lost_steps=1, counts=hits), kill_run(1.2, counts=hits)]
    )
    assert (figures["fault_to_step_s"], figures["first_step_s"]) == (1.2, 0.6)
    assert figures["lost_steps"] == 1  # a run that lost a step is not hidden by the others
    assert figures["compile_on_new_mesh"] == [hits, hits, hits]
