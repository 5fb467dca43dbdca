"""Network faults (partition, throttle, netem): their spelling, where they are refused, and the
driver's decision when a node stops answering on the network (on the fake worker group).

The same partition on real separate-network nodes: tests/faults/test_separate_networks.py.
"""

from __future__ import annotations

import pytest

from orchestrator.api.training import parse_faults
from orchestrator.driver.detector import UNREACHABLE_SILENT_S, Detector, LossKind
from orchestrator.errors import UserError
from tests.unit.fake_group import ELASTIC, events_of, fake_group, finish, replicas_on
from workers.faults import PARTITION_S, DriverFaults, FaultKind, FaultSpec, NetworkFault, NetworkFaultKind

ELASTIC_LAYOUT = (*ELASTIC, "elastic.hang_timeout_s=8", "elastic.heartbeat_timeout_s=10")


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("partition@6:1", NetworkFault(NetworkFaultKind.PARTITION, 1, seconds=PARTITION_S)),
        ("partition@6:0:4.5", NetworkFault(NetworkFaultKind.PARTITION, 0, seconds=4.5)),
        ("throttle@3:1:5", NetworkFault(NetworkFaultKind.THROTTLE, 1, mbit=5)),
        ("netem@3:1:50:2", NetworkFault(NetworkFaultKind.NETEM, 1, delay_ms=50, loss_percent=2)),
    ],
)
def test_network_faults_parse_to_what_the_cluster_is_asked(text, fault):
    spec = FaultSpec.parse(text)
    assert spec.network() == fault
    assert FaultSpec.parse(spec.describe()) == spec  # the schedule a run records replays


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("partition@x:1", "expected partition@STEP:NODE[:SECONDS]"),
        ("partition@5", "expected partition@STEP:NODE[:SECONDS]"),
        ("partition@5:1:10:3", "expected partition@STEP:NODE[:SECONDS]"),
        ("partition@5:1:0", "SECONDS must be > 0"),
        ("partition@0:1", "STEP must be >= 1 and NODE"),
        ("partition@5:-1", "STEP must be >= 1 and NODE"),
        ("throttle@5:1", "expected throttle@STEP:NODE:MBIT"),
        ("throttle@5:1:-2", "MBIT must be > 0"),
        ("netem@5:1:20:101", "LOSS a percentage from 0 to 100"),
    ],
)
def test_malformed_network_faults_are_refused_in_one_line_naming_the_form(text, says):
    with pytest.raises(ValueError, match="--inject") as refused:
        FaultSpec.parse(text)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_meshpilot_train_refuses_network_faults_it_has_no_separate_networks_for():
    with pytest.raises(UserError, match="separate-network test cluster"):
        parse_faults(["partition@5:1"])


def test_a_network_fault_fires_once_after_its_step_through_the_harness_callable():
    fired: list[NetworkFault] = []
    faults = DriverFaults([FaultSpec.parse("partition@4:1:3")], network_fault=fired.append)
    faults.fire(3)
    assert not fired
    faults.fire(4)
    faults.fire(5)
    assert fired == [NetworkFault(NetworkFaultKind.PARTITION, 1, seconds=3)]
    assert FaultSpec.parse("throttle@4:1:5").kind == FaultKind.THROTTLE


def test_only_silent_ranks_on_a_node_that_does_not_answer_are_lost_with_it():
    """A loaded machine's late answer is not a partition: the node's kernel still answers."""
    now = [0.0]
    unreachable = {"n1"}
    detector = Detector(
        heartbeat_timeout_s=10,
        hang_timeout_s=8,
        node_of=lambda rank: "n0" if rank < 2 else "n1",
        unreachable_nodes=lambda nodes: nodes & unreachable,
        clock=lambda: now[0],
    )
    detector.reset(4)
    now[0] = UNREACHABLE_SILENT_S + 0.5
    detector.heard(0, True, None)  # ranks 1 (node n0, reachable) and 2, 3 (node n1) are silent
    lost = detector.losses({}, hangs=True)
    assert sorted(lost) == [2, 3] and {loss.kind for loss in lost.values()} == {LossKind.NODE_LOST}
    assert lost[2].node == "n1"


def test_a_partitioned_node_is_lost_at_once_its_ranks_killed_and_the_job_recovers_in_place(
    make_controller, fake_cluster, tmp_path
):
    """tests/faults/test_separate_networks.py: partition@5:1 cuts replica 1's node off after step
    5. Its ranks answer nothing, not even the abort; the node refuses connections. The driver
    declares them node_lost within seconds (not after the 10 s heartbeat timeout), kills their
    actors (fenced: they may come back with the network), shrinks in place with 0 steps lost and
    grows back once a replica group's worth of actors is warm."""
    fake_cluster.hosts = {"n0", "n1"}
    fake_cluster.capacity = ["n2"]
    controller = make_controller(
        *ELASTIC_LAYOUT,
        "training.steps=12",
        faults=("partition@5:1",),
        script={
            "nodes": replicas_on("n0", "n1", size=2),
            "runs": {1: {"steps_done": 5, "held": "all"}, 2: {"steps_done": 8, "held": "all"}},
        },
    )
    final = finish(controller)
    assert final.status == "finished", final.reason
    assert [event["step"] for event in events_of(tmp_path, "step")] == list(range(1, 13))
    [failure] = events_of(tmp_path, "failure")
    assert (failure["kind"], failure["ranks"], failure["node"]) == ("node_lost", [2, 3], "n1")
    assert "stopped answering on the network" in failure["message"]
    [recovered] = events_of(tmp_path, "recovered")
    assert recovered["lost_steps"] == 0 and recovered["new_mesh"]["dp_replicate"] == 1
    # seconds of driver time, well inside the heartbeat timeout
    assert recovered["mttr_s"] < 5
    assert sorted(fake_group(controller).killed)[:2] == [2, 3]
    [grow] = events_of(tmp_path, "grow")
    assert grow["new_mesh"]["dp_replicate"] == 2


def test_chaos_draws_partitions_and_slow_links_only_on_separate_networks_and_on_the_run_nodes():
    from orchestrator.driver.chaos import chaos_kinds, chaos_schedule

    assert not set(chaos_kinds(storage=True, nodes=True)) & {FaultKind.PARTITION, FaultKind.THROTTLE}
    kinds = chaos_kinds(storage=True, nodes=True, network=True)
    schedule = chaos_schedule(5, 30, steps=200, world_size=4, replica_size=2, kinds=kinds)
    network = [fault for fault in schedule if fault.kind in (FaultKind.PARTITION, FaultKind.THROTTLE)]
    assert {fault.kind for fault in network} == {FaultKind.PARTITION, FaultKind.THROTTLE}
    assert all(fault.rank in (0, 1) and len(fault.values) == 1 for fault in network)
    # what the run records replays as --inject
    assert all(FaultSpec.parse(fault.describe()) == fault for fault in network)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--inject", "partition@3:5"], "no worker node 5; the nodes are 0 to 1"),
        (["--nodes", "1", "--inject", "partition@3:0"], "a partition needs at least two worker nodes"),
        (["--inject", "netem@3:1:50"], "netem needs the kernel's sch_netem module"),
        (["--inject", "partition@3:1:0"], "SECONDS must be > 0"),
    ],
)
def test_the_separate_network_job_refuses_what_its_cluster_cannot_do_in_one_line_exit_2(
    argv, says, monkeypatch, tmp_path, capsys
):
    from tests.faults import separate_networks_job
    from tests.fixtures import netns_nodes

    monkeypatch.setattr(netns_nodes, "netem_available", lambda: False)  # this machine's kernel
    assert separate_networks_job.main([str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before any cluster started
