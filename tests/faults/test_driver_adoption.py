"""A driver that can die (``runtime.survive_driver_loss``), on the session's real Ray cluster: a
driver process SIGKILLed by ``driver@K``, a second one adopting its live ranks with no step
redone and the uninterrupted run's losses, nothing left behind; and ranks with no driver exiting
when their lease runs out."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from checkpointing.storage import open_storage
from orchestrator.analysis.invariants import check_run, ray_leftovers
from orchestrator.config import load_config
from orchestrator.driver.adoption import RUN_NAMESPACE_PREFIX
from orchestrator.driver.sample_ledger import LEDGER_FILE, read_ledger
from orchestrator.driver.train_spec import train_spec
from orchestrator.observe.events import read_events
from tests.faults.harness import of_kind
from tests.jobs import DEMO_CONFIG, FIXED_SNAPSHOTS, REPO

pytestmark = pytest.mark.slow

STEPS = 14  # tests/faults/test_checkpoint_faults.py's: the two share the uninterrupted run
LAYOUT = (
    "parallelism.dp_replicate=1",
    "parallelism.dp_shard=2",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "training.seq_len=32",
    f"training.steps={STEPS}",
)
SURVIVING = ("runtime.survive_driver_loss=true", "runtime.driver_lease_s=60")


def _run_actors() -> list[str]:
    """Detached actors of any run's namespace, alive now."""
    import ray

    return [
        f"{entry['namespace']}/{entry['name']}"
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if str(entry.get("namespace", "")).startswith(RUN_NAMESPACE_PREFIX)
    ]


def _driver(*extra: str, checkpoints) -> list[str]:
    overrides = [
        f"data.path={REPO / 'data' / 'sample.txt'}",
        FIXED_SNAPSHOTS,
        *LAYOUT,
        *SURVIVING,
        "data.record_samples=true",
        f"checkpoint.uri={checkpoints}",
        "checkpoint.interval_steps=4",
    ]
    return [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "train",
        str(DEMO_CONFIG),
        "--plain",
        *[f"--set={override}" for override in overrides],
        *extra,
    ]


def test_a_second_driver_adopts_the_live_ranks_of_a_killed_one_with_no_step_lost(uninterrupted, ray_cluster, tmp_path):
    reference = uninterrupted(*LAYOUT)
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address}  # the cluster outlives the drivers
    run_dir, checkpoints = tmp_path / "run", tmp_path / "checkpoints"
    first = subprocess.run(
        _driver("--run-dir", str(run_dir), "--inject", "driver@4", checkpoints=checkpoints),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == -9, first.stdout + first.stderr
    assert len(_run_actors()) == 3, "the store and both ranks outlive the driver"
    second = subprocess.run(
        _driver("--resume-run", str(run_dir), checkpoints=checkpoints),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stdout + second.stderr
    events = read_events(run_dir / "events.jsonl")
    [adopted] = of_kind(events, "adopted")
    assert adopted["lost_steps"] == 0 and adopted["step"] >= 4
    assert not of_kind(events, "restored"), "the adopted run restored nothing"
    assert not of_kind(events, "recovered"), "the adopted generation ran without another pause"
    # One record: the first driver's steps, then the adopted run's, every step once.
    assert [e["step"] for e in of_kind(events, "step")] == list(range(1, STEPS + 1))
    storage = open_storage(str(checkpoints))
    report = check_run(
        events,
        steps=STEPS,
        reference_losses=reference,
        rel=1e-4,
        ledger=read_ledger(run_dir / LEDGER_FILE),
        global_batch=load_config(DEMO_CONFIG, []).training.global_batch,
        storage=storage,
        leftovers=ray_leftovers,
    )
    assert report.ok, report.describe()
    # Saves after the kill (the ranks staged them while no driver was there) commit by the adopter.
    assert {8, 12} <= {e["step"] for e in of_kind(events, "checkpoint_committed")}
    assert _run_actors() == []


def test_ranks_and_the_store_exit_when_no_driver_renews_their_lease(ray_cluster):
    """As a driver with the option leaves them: a detached store, and a detached rank in a
    detached placement group; no driver calls again. Both exit, and the rank's group goes too."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from workers.actor import RankActor
    from workers.rendezvous import StoreHost

    lease_s = 3.0
    config = load_config(DEMO_CONFIG, [*LAYOUT, *SURVIVING, f"runtime.driver_lease_s={lease_s}"])
    namespace = f"{RUN_NAMESPACE_PREFIX}lease-test"
    options = {"lifetime": "detached", "namespace": namespace, "num_cpus": 0}
    store = ray.remote(StoreHost).options(name="store", **options).remote(lease_s=lease_s)
    group = placement_group([{"CPU": 0.1}], lifetime="detached")
    ray.get(group.ready(), timeout=60)
    in_group = {**options, "num_cpus": 0.1, "scheduling_strategy": PlacementGroupSchedulingStrategy(group)}
    spec = train_spec(config)
    rank = ray.remote(RankActor).options(name="rank|lease-test|0|0", **in_group).remote(spec=spec, data=None)
    ray.get([store.address.remote(), rank.info.remote()], timeout=120)
    # The last calls a driver makes (the store's lease ran from its start, the rank's is longer to come).
    ray.get([store.renew_lease.remote(1, 0), rank.renew_lease.remote()], timeout=30)
    started = time.monotonic()
    assert len(_run_actors()) == 2
    # Nobody renews: both go within the lease (plus the watch's half second and Ray's bookkeeping).
    while _run_actors() and time.monotonic() - started < lease_s + 10:
        time.sleep(0.2)
    assert _run_actors() == [], f"still alive {time.monotonic() - started:.1f} s after the last call"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(rank.info.remote(), timeout=10)
    assert placement_group_table(group)["state"] == "REMOVED"
