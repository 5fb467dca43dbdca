"""An OOM while a rank configures a generation: a typed failure of that rank, whose actor the
driver replaces (a checkpoint restore onto new actors) instead of ending the run."""

from __future__ import annotations

import torch

from orchestrator.driver.states import AwaitingActors, Configuring
from orchestrator.observe.events import read_events
from tests.unit.fake_group import FakeGroup, fake_group
from workers.spec.messages import FailureKind, failure_kind_of


def test_torchs_out_of_memory_error_is_its_own_failure_kind():
    assert failure_kind_of(torch.OutOfMemoryError("CUDA out of memory")) == FailureKind.OUT_OF_MEMORY
    assert failure_kind_of(RuntimeError("a bug")) == FailureKind.OWN_ERROR


def test_an_out_of_memory_configure_replaces_the_rank_instead_of_ending_the_run(make_controller, tmp_path):
    controller = make_controller(committed_steps=[3])
    FakeGroup.script = {"corrupt": {3}, "corrupt_kind": FailureKind.OUT_OF_MEMORY}
    controller.step()
    assert isinstance(controller.state, Configuring)
    slots = list(fake_group(controller).active)
    controller.step()
    assert isinstance(controller.state, AwaitingActors) and controller.state.step == 3
    group = fake_group(controller)
    assert group.aborted == [(1, 1)]  # the other ranks are released from the generation
    assert slots[0] not in group.active and not group.active  # rank 0's actor is gone, the rest wait warm
    failures = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "failure"]
    assert len(failures) == 1
