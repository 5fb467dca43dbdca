"""Stragglers: the pure policy's decisions, the slow fault's spelling, and the driver acting on
them over the fake worker group (replace, exclude, warn)."""

from __future__ import annotations

import pytest

from elastic.spec import MeshSpec
from elastic.straggler import StragglerAction, StragglerPolicy, choose_action
from orchestrator.analysis.timeline import format_summary, summarize
from tests.unit.fake_group import ELASTIC, events_of, fake_group, finish
from workers.faults import SLOW_FACTOR, FaultInjector, FaultKind, FaultSpec

TWO_REPLICAS = MeshSpec(dp_replicate=2, dp_shard=2, tp=1, pp=1)


def feed(policy: StragglerPolicy, mesh: MeshSpec, per_step: list[dict[int, float]], first: int = 1) -> list:
    found = []
    for step, compute in enumerate(per_step, start=first):
        found += policy.observe(step, compute, mesh)
    return found


def test_a_rank_slower_than_factor_x_its_peers_for_the_window_is_found_once() -> None:
    policy = StragglerPolicy(factor=2.0, window_steps=5)
    steps = [{0: 0.1, 1: 0.11, 2: 0.1, 3: 0.4}] * 8
    found = feed(policy, TWO_REPLICAS, steps)
    assert [(s.rank, s.factor, s.step) for s in found] == [(3, 4.0, 5)]  # at the window's end, then never again


def test_hiccups_and_slowness_under_the_factor_are_no_stragglers_but_one_noisy_step_hides_none() -> None:
    slow, fine = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.5}, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}
    policy = StragglerPolicy(factor=2.0, window_steps=5)
    assert feed(policy, TWO_REPLICAS, ([slow] * 3 + [fine] * 2) * 3) == []  # three-step hiccups: fine
    assert feed(policy, TWO_REPLICAS, [{0: 0.1, 1: 0.1, 2: 0.1, 3: 0.19}] * 10, first=16) == []  # 1.9x < 2
    # A loaded machine slows the peers for a step (rank 3 only 1.7x then): the slow rank is still found in time.
    noisy = {0: 0.3, 1: 0.3, 2: 0.3, 3: 0.5}
    policy = StragglerPolicy(factor=2.0, window_steps=5)
    found = feed(policy, TWO_REPLICAS, [slow, slow, noisy, slow, slow])
    assert [(s.rank, s.factor, s.step) for s in found] == [(3, 5.0, 5)]


def test_skipped_steps_start_the_count_again_and_reset_forgets_the_generation() -> None:
    policy = StragglerPolicy(factor=2.0, window_steps=3)
    slow = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.5}
    assert feed(policy, TWO_REPLICAS, [slow] * 2) == []
    assert feed(policy, TWO_REPLICAS, [slow] * 2, first=7) == []  # a skip: 7 does not follow 2
    assert [s.rank for s in feed(policy, TWO_REPLICAS, [slow], first=9)] == [3]
    policy.reset()  # a new generation: its rank 3 may be found again
    assert [s.rank for s in feed(policy, TWO_REPLICAS, [slow] * 3, first=12)] == [3]


def test_ranks_are_judged_against_their_pipeline_stage_only() -> None:
    # pp=2: the last stage computes the output layer and the loss: slower, and no straggler.
    mesh = MeshSpec(dp_replicate=2, dp_shard=1, tp=1, pp=2)
    stages = {rank: mesh.coords(rank).pp for rank in range(4)}
    normal = {rank: 0.1 if stages[rank] == 0 else 0.35 for rank in range(4)}
    policy = StragglerPolicy(factor=2.0, window_steps=2)
    assert feed(policy, mesh, [normal] * 4) == []
    slowed = dict(normal)
    last_stage_rank = next(rank for rank, stage in stages.items() if stage == 1)
    slowed[last_stage_rank] = 1.4
    assert [s.rank for s in feed(policy, mesh, [slowed] * 2, first=5)] == [last_stage_rank]


def test_the_action_is_what_the_job_can_afford() -> None:
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, tp=1, pp=1)
    replace, exclude, warn = StragglerAction.REPLACE, StragglerAction.EXCLUDE, StragglerAction.WARN
    straggler = frozenset({3})
    # Its healthy replica-mate goes warm: one more warm actor makes a whole replica group.
    assert choose_action(replace, mesh, straggler, warm_actors=1, min_replicas=1) == (replace, "")
    action, why = choose_action(replace, mesh, straggler, warm_actors=0, min_replicas=1)
    assert action == warn and why == "too few warm actors to replace it (1 of 2)"
    assert choose_action(exclude, mesh, straggler, warm_actors=0, min_replicas=1) == (exclude, "")
    assert choose_action(exclude, mesh, straggler, warm_actors=0, min_replicas=2)[0] == warn
    assert choose_action(warn, mesh, straggler, warm_actors=8, min_replicas=1) == (warn, "")
    single = MeshSpec(dp_replicate=1, dp_shard=4, tp=1, pp=1)
    assert choose_action(replace, single, straggler, warm_actors=8, min_replicas=1) == (
        warn,
        "no other replica group carries on without it",
    )


def test_slow_faults_parse_with_a_default_factor_and_stay_with_the_process(monkeypatch) -> None:
    assert FaultSpec.parse("slow@3:1:4") == FaultSpec(FaultKind.SLOW, 3, 1, factor=4.0)
    assert FaultSpec.parse("slow@3:1").factor == SLOW_FACTOR and FaultSpec.parse("slow@3:1:2.5").describe() == (
        "slow@3:1:2.5"
    )
    for bad in ("slow@3:1:1", "slow@3:1:0.5", "slow@3:1:fast"):
        with pytest.raises(ValueError, match="FACTOR must be a number > 1"):
            FaultSpec.parse(bad)
    slept: list[float] = []
    synced: list[bool] = []
    monkeypatch.setattr("workers.faults.time.sleep", slept.append)
    monkeypatch.setattr("workers.faults.time.perf_counter", lambda: 10.5)

    def sync() -> None:
        synced.append(True)

    injector = FaultInjector((FaultSpec.parse("slow@3:1:4"),), rank=1)
    injector.before_step(2)
    injector.after_compute(10.0, sync)
    assert slept == [] and synced == []  # not slow yet: no device sync either
    injector.before_step(3)
    injector.after_compute(10.0, sync)
    assert slept == [1.5] and synced == [True]  # from step 3 on: (4 - 1) x the 0.5 s compute
    later = FaultInjector((), rank=0, slowdown=injector.slowdown)  # the process's next generation
    later.after_compute(10.0, sync)
    assert slept == [1.5, 1.5]


def test_bad_straggler_settings_exit_2_with_one_line(capsys) -> None:
    from orchestrator.cli import main

    for override, text in (
        ("elastic.straggler.factor=1", "elastic.straggler.factor=1 must be > 1"),
        ("elastic.straggler.action=kick", "elastic.straggler.action: 'kick' is not one of warn, replace, exclude"),
    ):
        assert main(["train", "configs/tiny-3d.yaml", "--set", override]) == 2
        err = capsys.readouterr().err
        assert text in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["train", "configs/tiny-3d.yaml", "--inject", "slow@3:1:1"]) == 2
    assert "FACTOR must be a number > 1" in capsys.readouterr().err


# ------------------------------------------------------------------ the driver, over the fake group
STRAGGLING = (*ELASTIC, "training.steps=12", "elastic.straggler.window_steps=3")


def straggling_job(make_controller, *overrides: str, held: bool = True):
    """Rank 3 computes 4x as long as its peers from step 1; the ranks report 6 steps, then wait
    for what the driver decides (or, not ``held``, run to the end)."""
    run = {"steps_done": 6, "held": "all"} if held else {}
    return make_controller(*STRAGGLING, *overrides, script={"runs": {1: {**run, "slow": {3: 4.0}}}})


def test_replace_moves_the_stragglers_replica_group_to_a_warm_spare_at_a_step_boundary(make_controller, tmp_path):
    controller = straggling_job(make_controller, "elastic.spare_actors=2")
    final = finish(controller)
    assert final.status == "finished", final.reason
    straggler = events_of(tmp_path, "straggler")
    assert [(e["rank"], e["factor"], e["step"], e["action"]) for e in straggler] == [(3, 4.0, 3, "replace")]
    assert [e["step"] for e in events_of(tmp_path, "step")] == list(range(1, 13))  # every step once, none redone
    assert not events_of(tmp_path, "failure")
    drain = events_of(tmp_path, "drain")
    assert [(e["ranks"], e["reason"]) for e in drain] == [([3], "straggler")]
    recovered = events_of(tmp_path, "recovered")
    assert [(e["cause"], e["lost_steps"]) for e in recovered] == [("drain", 0)]
    group = fake_group(controller)
    assert group.pauses == [(1, False)] and group.aborted == []  # a pause at the step boundary, no abort
    assert 3 in group.removed  # the slow process is gone
    assert group.configured[1]["mesh"] == TWO_REPLICAS  # the same mesh, refilled
    assert group.configured[1]["slots"][:2] == [0, 1] and 3 not in group.configured[1]["slots"]
    assert "stragglers: 1: rank 3 (node None) 4.00x at step 3: replace" in format_summary(
        summarize(events_of(tmp_path))
    )


def test_replace_marks_the_stragglers_node_suspect_and_prefers_other_nodes(make_controller, tmp_path):
    controller = make_controller(
        *STRAGGLING,
        "elastic.spare_actors=2",
        script={
            "nodes": ["n0", "n0", "n1", "n1", "n1", "n1"],  # the spare replica group shares the slow node
            "runs": {1: {"steps_done": 6, "held": "all", "slow": {3: 4.0}}},
        },
    )
    assert finish(controller).status == "finished"
    group = fake_group(controller)
    assert group.suspect_nodes == {"n1"} and not group.avoid_nodes
    assert only_straggler(tmp_path)["node"] == "n1"


def only_straggler(tmp_path) -> dict:
    (event,) = events_of(tmp_path, "straggler")
    return event


def test_exclude_shrinks_away_from_the_straggler_without_a_refill(make_controller, tmp_path):
    controller = straggling_job(make_controller, "elastic.straggler.action=exclude")
    assert finish(controller).status == "finished"
    assert only_straggler(tmp_path)["action"] == "exclude"
    group = fake_group(controller)
    assert group.configured[1]["mesh"].dp_replicate == 1 and group.configured[1]["slots"] == [0, 1]
    assert [e["step"] for e in events_of(tmp_path, "step")] == list(range(1, 13))
    assert [e["lost_steps"] for e in events_of(tmp_path, "recovered")] == [0]


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (("elastic.straggler.action=warn",), None),
        ((), "the run ended first"),  # replace, but the run ended before the next housekeeping
    ],
    ids=["warn", "replace-at-the-end"],
)
def test_warn_only_reports_and_the_mesh_stays(overrides, reason, make_controller, tmp_path):
    controller = straggling_job(make_controller, *overrides, held=False)
    assert finish(controller).status == "finished"
    event = only_straggler(tmp_path)
    assert event["action"] == "warn" and event.get("reason") == reason
    group = fake_group(controller)
    assert len(group.configured) == 1 and group.pauses == [] and not group.suspect_nodes
    assert not events_of(tmp_path, "drain")
    assert [e["step"] for e in events_of(tmp_path, "step")] == list(range(1, 13))


def test_a_straggler_is_replaced_at_the_step_boundary_after_its_window(make_controller, tmp_path):
    """One step per poll, as real ranks report: rank 3 is slow from step 1; with a window of 3 it
    is found at step 3, and the next housekeeping pauses the generation after the step in flight."""
    controller = make_controller(
        *STRAGGLING,
        "elastic.spare_actors=2",
        script={"runs": {1: {"steps_done": 12, "held": "all", "paced": True, "slow": {3: 4.0}}}},
    )
    assert finish(controller).status == "finished"
    assert only_straggler(tmp_path)["step"] == 3
    group = fake_group(controller)
    resumed_after = group.configured[1]["starts"][-1].step  # the spare's peer copy: the last old-mesh step
    assert resumed_after == 3 + 1  # the slow rank ran window_steps + 1 steps: its window and the one in flight
    assert [e["step"] for e in events_of(tmp_path, "step")] == list(range(1, 13))
    assert [e["lost_steps"] for e in events_of(tmp_path, "recovered")] == [0]
