"""A driver that can die (``runtime.survive_driver_loss``): the lease on a fake clock, the adoption
decision on plain values, the controller continuing an adopted run on the fake worker group, and
the refusals (an embedded cluster, another config), each one line and exit 2."""

from __future__ import annotations

import pytest

from elastic.spec import MeshSpec
from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.driver import cluster
from orchestrator.driver.adoption import (
    Adopt,
    Adopted,
    AwaitBoundary,
    Decline,
    NoAdoption,
    decide,
    differing_keys,
    run_namespace,
)
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.driver.states import NextGeneration
from orchestrator.errors import ConfigError
from tests.jobs import DEMO_CONFIG
from tests.unit.fake_group import ONE_REPLICA, FakeGroup, events_of, fake_group, finish, starts_of
from workers.driver_lease import DriverLease, LeaseEvent, LeaseWatch, silence_for
from workers.spec.messages import LiveRank, Phase, RunOutcome, RunStatus, StartFrom, StartMode

MESH = MeshSpec(dp_replicate=1, dp_shard=2, tp=1, pp=1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_lease_pauses_once_per_silence_and_expires_once():
    clock = Clock()
    lease = DriverLease(10.0, clock=clock)
    watch = LeaseWatch(lease, silence_s=silence_for(10.0))
    assert watch.silence_s == 2.0  # short: the ranks stop committing steps the driver cannot record
    clock.now = 1.9
    assert watch.check() is None
    clock.now = 2.5
    assert watch.check() == LeaseEvent.SILENT
    clock.now = 3.0
    assert watch.check() is None  # noted once
    lease.renew()  # a driver came back (an adopting one)
    clock.now = 4.0
    assert watch.check() is None
    clock.now = 5.5
    assert watch.check() == LeaseEvent.SILENT  # a new silence is noted anew
    clock.now = 13.1
    assert watch.check() == LeaseEvent.EXPIRED
    clock.now = 30.0
    assert watch.check() is None  # the holder has exited by now


def test_a_short_lease_pauses_well_before_it_expires():
    assert silence_for(1.0) == 0.5
    assert silence_for(600.0) == 2.0


def _rank(
    rank: int, *, generation: int = 2, step: int = 9, phase: Phase = Phase.PAUSED, holds: bool = True
) -> LiveRank:
    return LiveRank(
        rank=rank, generation=generation, mesh=MESH.as_dict(), last_step=step, phase=phase, holds_state=holds
    )


def test_every_rank_paused_at_one_step_is_adopted():
    assert decide([_rank(1), _rank(0)]) == Adopt(generation=2, mesh=MESH, step=9)


def test_ranks_that_finished_the_run_without_a_driver_are_adopted():
    finished = [_rank(0, step=40, phase=Phase.FINISHED), _rank(1, step=40, phase=Phase.FINISHED)]
    assert decide(finished) == Adopt(generation=2, mesh=MESH, step=40)


def test_ranks_configured_but_never_run_are_adopted():
    # The driver died while the generation configured: the ranks filled their state, then waited.
    ready = [_rank(0, phase=Phase.READY), _rank(1, phase=Phase.READY)]
    assert decide(ready) == Adopt(generation=2, mesh=MESH, step=9)


@pytest.mark.parametrize("phase", [Phase.STEP, Phase.EVAL, Phase.CHECKPOINT, Phase.CONFIGURING])
def test_a_rank_between_boundaries_is_awaited(phase):
    assert decide([_rank(0), _rank(1, phase=phase, holds=False)]) == AwaitBoundary(generation=2)


def test_ranks_of_an_older_generation_do_not_count():
    stale = _rank(1, generation=1, step=3)
    assert decide([_rank(0), _rank(1), stale]) == Adopt(generation=2, mesh=MESH, step=9)


@pytest.mark.parametrize(
    ("ranks", "reason"),
    [
        ([], "no rank of the run is alive"),
        ([_rank(0)], "ranks [1] of generation 2 are gone"),
        ([_rank(0), _rank(1, step=8)], "stopped at different steps [8, 9]"),
        ([_rank(0), _rank(1, phase=Phase.ABORTED, holds=False)], "ranks [1] of generation 2 hold no state"),
        ([_rank(0, generation=0), _rank(1, generation=0)], "never joined a generation"),
    ],
)
def test_live_ranks_that_cannot_carry_the_run_are_declined(ranks, reason):
    decision = decide(ranks)
    assert isinstance(decision, Decline) and reason in decision.reason


class StubAdoption:
    """The live run a dead driver left: generation 3, stopped after step 2 (as ``Adoption`` finds it)."""

    def __init__(self, group: FakeGroup, router: ReportRouter, mesh: MeshSpec) -> None:
        self.group = group
        self.router = router
        self.mesh = mesh
        self.closed = False

    def adopt(self, resume_step: int | None) -> Adopted | None:
        # What ``WorkerGroup.take_over`` does: the live actors become the active slots.
        self.group.start(self.mesh)
        self.group.applied = 2
        self.router.rewind(2)  # the dead driver recorded steps 1 and 2
        starts = (StartFrom(StartMode.KEPT, 2),) * self.mesh.world_size
        return Adopted(generation=3, next=NextGeneration(self.mesh, starts))

    def close(self) -> None:
        self.closed = True


def test_the_controller_continues_an_adopted_run_as_its_next_generation(make_controller, tmp_path):
    controller = make_controller(*ONE_REPLICA, committed_steps=[])
    group = fake_group(controller)
    controller.adoption = StubAdoption(group, controller.router, controller.config.mesh)
    final = finish(controller)
    assert final.exit_code == 0
    [configured] = group.configured
    # The next generation on the adopted actors, every rank from its kept slices: nothing restored.
    assert configured["generation"] == 4
    assert starts_of(configured) == [("kept", None)] * 4
    assert [e["step"] for e in events_of(tmp_path, "step")] == [3, 4]
    assert not events_of(tmp_path, "restored")
    assert controller.adoption.closed


def test_recorded_config_that_differs_names_the_keys():
    config = load_config(DEMO_CONFIG, ["training.steps=4"])
    recorded = config.to_dict()
    recorded["training"]["lr"] = 1.0
    recorded["parallelism"]["tp"] = 1
    recorded["runtime"]["address"] = "ray://elsewhere:10001"  # where the driver connects may change
    assert differing_keys(recorded, config) == ["parallelism.tp", "training.lr"]


def test_resume_run_with_another_config_is_one_line_and_exit_2(tmp_path, capsys):
    record = tmp_path / "run"
    record.mkdir()
    (record / "config.yaml").write_text(load_config(DEMO_CONFIG, ["training.lr=0.5"]).to_yaml(), encoding="utf-8")
    code = main(["train", str(DEMO_CONFIG), "--resume-run", str(record)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"the run at {record} was started with another config (training.lr differ)" in err


def test_survive_driver_loss_on_an_embedded_cluster_is_refused(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    config = load_config(DEMO_CONFIG, ["runtime.survive_driver_loss=true"])
    with pytest.raises(ConfigError) as refused:
        cluster.connect(config)
    message = str(refused.value)
    assert "\n" not in message
    assert "runtime.survive_driver_loss=true needs a Ray cluster that outlives the driver" in message
    assert "`ray start --head` and set RAY_ADDRESS" in message


def test_a_lease_of_no_time_is_refused():
    with pytest.raises(ConfigError, match=r"runtime.driver_lease_s=0 must be > 0"):
        load_config(DEMO_CONFIG, ["runtime.driver_lease_s=0"])


def test_a_pause_the_store_made_while_the_driver_lived_is_gone_on_from(make_controller, tmp_path):
    """The store pauses the ranks when the lease lapses; a driver alive but late to renew it finds
    its ranks paused at a step boundary and goes on with them, instead of failing the run."""
    controller = make_controller(*ONE_REPLICA, "runtime.survive_driver_loss=true")
    controller.adoption = NoAdoption()  # nothing live to adopt (and no Ray here)
    paused = {rank: RunOutcome(RunStatus.PAUSED, 2) for rank in range(4)}
    FakeGroup.script = {"runs": {1: {"steps_done": 2, "outcomes": paused}}}
    final = finish(controller)
    assert final.exit_code == 0, final.reason
    group = fake_group(controller)
    assert starts_of(group.configured[-1]) == [("kept", None)] * 4
    assert [e["step"] for e in events_of(tmp_path, "step")] == [1, 2, 3, 4]


def test_a_retried_job_finds_its_run_by_its_config_alone():
    """A KubeRay job's retry runs the same config with no record at hand: the run's namespace is
    named by the config, not by where the driver runs or writes."""
    config = load_config(DEMO_CONFIG, ["training.steps=4"])
    retried = load_config(DEMO_CONFIG, ["training.steps=4", "runtime.address=ray://head:10001", "runtime.run_dir=x"])
    other = load_config(DEMO_CONFIG, ["training.steps=4", "training.lr=0.5"])
    assert run_namespace(config) == run_namespace(retried) == f"meshpilot-tiny-3d-{config.config_hash()[:12]}"
    assert run_namespace(other) != run_namespace(config)


def test_resume_run_without_a_record_is_one_line_and_exit_2(tmp_path, capsys):
    code = main(["train", str(DEMO_CONFIG), "--resume-run", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"--resume-run {tmp_path}: no config.yaml there" in err
