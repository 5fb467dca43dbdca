"""The driver's poll of its rank actors (``WorkerGroup.poll``) against a real Ray actor."""

from __future__ import annotations

import time

import ray

from elastic.placement import RankResources
from orchestrator.config import load_config
from orchestrator.driver.train_spec import train_spec
from orchestrator.driver.worker_group import RankSlot, WorkerGroup
from tests.jobs import DEMO_CONFIG


@ray.remote(num_cpus=0)
class SlowToAnswer:
    """A rank whose first poll answers late, as on a loaded machine. A poll drains the rank's
    queued reports, so its answer is the only place they are."""

    def __init__(self) -> None:
        self.queued = ["the report of step 12"]
        self.polls = 0

    def poll(self) -> list[str]:
        self.polls += 1
        drained, self.queued = self.queued, []
        if self.polls == 1:
            time.sleep(3.0)
        return drained

    def polls_run(self) -> int:
        return self.polls


def test_a_poll_answered_too_late_is_waited_for_again_and_its_reports_arrive(ray_cluster):
    config = load_config(DEMO_CONFIG, [])
    group = WorkerGroup(spec=train_spec(config), data=None, per_rank=RankResources(0.5, 0.0, {}), start_timeout_s=60)
    actor = SlowToAnswer.remote()
    try:
        group.active = [RankSlot(actor=actor, placement_group=None, batch_id=0)]
        assert group.poll(timeout=0.2) == {}  # not answered in time
        assert group.poll(timeout=30) == {0: ["the report of step 12"]}
        assert ray.get(actor.polls_run.remote()) == 1
    finally:
        ray.kill(actor)
