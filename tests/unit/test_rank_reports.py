"""Typed rank reports on their way to the run's events (driver side, no Ray, no torch)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from checkpointing.spec import ShardReport
from elastic.spec import MeshSpec
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.observe.events import EventLog, read_events
from workers.reporting import ReportChannel
from workers.spec.messages import CheckpointUploadReport, DrainNoticeReport, ReportKind, StepReport


def step_report(rank: int, step: int, *, loss: float | None, stall: float | None = None) -> StepReport:
    return StepReport(
        rank=rank,
        time=100.0 + step + rank,
        step=step,
        loss=loss,
        dp_rank=rank,
        step_time_s=0.1 * (rank + 1),
        lr=0.001,
        grad_norm=1.0,
        phases={"compute": 0.05 * (rank + 1)},
        checkpoint_stall_s=stall,
    )


def test_a_step_event_waits_for_every_rank_and_takes_the_slowest(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    router = ReportRouter(events, mesh=MeshSpec(dp_shard=2), tokens_per_step=256)
    router.route([step_report(0, 1, loss=2.0, stall=0.25)])
    assert router.last_emitted_step == 0  # rank 1 has not reported step 1 yet
    router.route([step_report(1, 1, loss=4.0)])
    events.close()
    step, staged = read_events(tmp_path / "events.jsonl")
    assert step["event"] == "step" and step["loss"] == 3.0 and step["step_time_s"] == 0.2
    assert step["rank_step_time_s"] == {"0": 0.1, "1": 0.2} and step["completed_at"] == 102.0
    assert step["phases_s"] == {"compute": 0.1}
    assert staged == {"event": "checkpoint_staged", "time": staged["time"], "step": 1, "stall_s": 0.25}


def test_a_mesh_change_can_tell_whether_the_survivors_reports_of_every_step_are_in():
    """Before the mesh changes, the driver drains until the survivors reported every step they
    applied: a step of the old mesh left without an event would hold back every later one."""
    router = ReportRouter(EventLog(None), mesh=MeshSpec(dp_shard=2), tokens_per_step=1)
    router.route([step_report(0, 1, loss=2.0), step_report(0, 2, loss=2.0)])
    assert router.reported(2, [0]) and not router.reported(2, [0, 1]) and not router.reported(3, [0])
    router.route([step_report(1, 1, loss=2.0)])
    assert router.last_emitted_step == 1 and router.reported(1, [0, 1]) and not router.reported(2, [1])


def test_other_kinds_go_to_their_handler_as_typed_reports():
    router = ReportRouter(EventLog(None), mesh=MeshSpec(), tokens_per_step=1)
    seen = []
    router.on(ReportKind.CHECKPOINT_UPLOAD, seen.append)
    router.on("drain_notice", seen.append)  # a StrEnum value names the kind as well
    channel = ReportChannel(rank=0)
    channel.checkpoint_upload(ShardReport(step=4, rank=0), generation=1)
    channel.drain_notice("spot instance reclaimed")
    router.route(channel.drain())
    upload, notice = seen
    assert isinstance(upload, CheckpointUploadReport) and upload.upload == ShardReport(step=4, rank=0)
    assert isinstance(notice, DrainNoticeReport) and (notice.rank, notice.reason) == (0, "spot instance reclaimed")


def test_reports_cross_a_process_boundary_intact():
    channel = ReportChannel(rank=3)
    channel.step(step=2, loss=None, dp_rank=1, step_time_s=0.5)
    channel.log(level="info", logger="meshpilot.rank", message="hello")
    reports = channel.drain()
    assert pickle.loads(pickle.dumps(reports)) == reports
    assert [report.kind for report in reports] == [ReportKind.STEP, ReportKind.LOG]
    assert all(report.rank == 3 for report in reports) and channel.drain() == []


def test_an_event_without_a_required_field_is_refused_with_its_name():
    events = EventLog(None)
    with pytest.raises(ValueError, match=r"event 'checkpoint_committed' lacks required field\(s\) 'upload_s'"):
        events.emit("checkpoint_committed", step=4, uri="s3://bucket/run", bytes=10)
    with pytest.raises(ValueError, match="unknown event 'checkpoint_done'"):
        events.emit("checkpoint_done", step=4)
    events.emit("checkpoint_staged", step=4, stall_s=0.1)  # complete: accepted


def test_a_mixture_of_experts_step_reports_the_most_uneven_load_per_layer(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    router = ReportRouter(events, mesh=MeshSpec(dp_shard=2), tokens_per_step=256)
    loads = [{"layer0": 1.5, "layer1": 1.1}, {"layer0": 1.2, "layer1": 2.0}]
    router.route(
        [
            StepReport(rank=r, time=1.0, step=1, loss=2.0, dp_rank=r, step_time_s=0.1, expert_load=loads[r])
            for r in (0, 1)
        ]
    )
    router.route([step_report(0, 2, loss=2.0), step_report(1, 2, loss=2.0)])  # a dense model reports none
    events.close()
    moe_step, dense_step = read_events(tmp_path / "events.jsonl")
    assert moe_step["expert_load_max_over_mean"] == {"layer0": 1.5, "layer1": 2.0}
    assert "expert_load_max_over_mean" not in dense_step


def test_a_step_event_says_how_many_labels_trained(tmp_path):
    """Masked data: the step's trained labels, as the ranks counted them, beside its tokens."""
    events = EventLog(tmp_path / "events.jsonl")
    router = ReportRouter(events, mesh=MeshSpec(dp_shard=2), tokens_per_step=256)
    router.route([dataclasses.replace(step_report(rank, 1, loss=2.0), trained_tokens=97) for rank in range(2)])
    router.route([step_report(rank, 2, loss=2.0) for rank in range(2)])  # a rank that does not count them
    events.close()
    first, second = read_events(tmp_path / "events.jsonl")
    assert (first["tokens"], first["trained_tokens"]) == (256, 97)
    assert second["trained_tokens"] == 256
