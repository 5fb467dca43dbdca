"""The step votes only after the device has finished it, and a rank says when it waits on peers.

    python -m pytest tests/unit/test_device_sync.py -q

Single process, world size 1, real gloo: a Trainer built as a rank builds it, with a device
that records its syncs (a no-op on the CPU, as on any gloo rank) and a committer that records
its votes, so the order a GPU run follows is visible here.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.distributed as dist

from elastic.spec import MeshSpec
from workers.actor import RankActor
from workers.device import PeerWait, PeerWaitMarker, RankDevice
from workers.runtime import init_generation, make_source
from workers.spec import PRESETS, StepDecision, TrainSpec, Verdict
from workers.trainer import StepAborted, Trainer


class RecordingDevice(RankDevice):
    """The CPU device, noting each sync and cache release with what the thread was marked as."""

    def __init__(self, events: list[tuple[str, PeerWait | None]], marker: PeerWaitMarker) -> None:
        super().__init__(torch.device("cpu"))
        self.events = events
        self.marker = marker

    def sync(self) -> None:
        self.events.append(("sync", self.marker.of(threading.get_ident())))
        super().sync()

    def empty_cache(self) -> None:
        self.events.append(("empty_cache", None))
        super().empty_cache()


class RecordingCommitter:
    def __init__(self, events: list[tuple[str, PeerWait | None]], marker: PeerWaitMarker, decision: Verdict) -> None:
        self.events = events
        self.marker = marker
        self.decision = decision

    def vote(self, step: int) -> StepDecision:
        self.events.append(("vote", self.marker.of(threading.get_ident())))
        return StepDecision(self.decision)


@pytest.fixture
def one_rank_world():
    if dist.is_initialized():
        dist.destroy_process_group()
    init_generation(store=dist.HashStore(), generation=0, rank=0, world_size=1, backend="gloo", timeout_s=30)
    yield
    dist.destroy_process_group()


def build_trainer(decision: Verdict) -> tuple[Trainer, list[tuple[str, PeerWait | None]]]:
    spec = TrainSpec(model=PRESETS["debug"], steps=2, global_batch=2, seq_len=8, microbatch_size=1)
    events: list[tuple[str, PeerWait | None]] = []
    marker = PeerWaitMarker()
    trainer = Trainer(
        spec,
        MeshSpec(),
        0,
        device=RecordingDevice(events, marker),
        source=make_source(spec, None),
        committer=RecordingCommitter(events, marker, decision),
        peer_waits=marker,
    )
    trainer.init_weights()
    return trainer, events


def test_the_vote_follows_a_device_sync_and_both_are_marked_as_waiting(one_rank_world):
    trainer, events = build_trainer(Verdict.COMMIT)
    result = trainer.train_step(1)
    assert events == [("sync", PeerWait.DEVICE_SYNC), ("vote", PeerWait.COMMIT_VOTE)]
    assert result.loss is not None and result.loss > 0
    # Outside the step the loop thread is not marked as waiting.
    assert trainer.peer_waits.of(threading.get_ident()) is None


def test_an_aborted_step_syncs_before_it_raises_and_applies_nothing(one_rank_world):
    trainer, events = build_trainer(Verdict.ABORT)
    before = {name: value.detach().clone() for name, value in trainer.local_shards().items()}
    with pytest.raises(StepAborted):
        trainer.train_step(1)
    assert [name for name, _ in events] == ["sync", "vote"]
    after = trainer.local_shards()
    assert all(torch.equal(before[name], after[name]) for name in before)


def bare_actor(device: RankDevice | None) -> RankActor:
    """A RankActor with only what leaving a generation and answering a poll read (no Ray)."""
    actor = RankActor.__new__(RankActor)
    actor.checkpoints = None
    actor.snapshots = None
    actor.trainer = None
    actor.source = None
    actor.committer = None
    actor.generation = 3
    actor._group_sockets = set()
    actor._loop_thread = None
    actor._peer_waits = PeerWaitMarker()
    actor.device = device
    return actor


def test_leaving_a_generation_syncs_then_empties_the_device():
    events: list[tuple[str, PeerWait | None]] = []
    actor = bare_actor(RecordingDevice(events, PeerWaitMarker()))
    actor._drop_process_groups(keep_shards=False)
    assert [name for name, _ in events] == ["sync", "empty_cache"]


class BrokenDevice(RecordingDevice):
    """A device whose sync raises, as a CUDA context can after its NCCL communicators were aborted."""

    def sync(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_device_error_after_an_abort_does_not_stop_the_rank_leaving(caplog):
    events: list[tuple[str, PeerWait | None]] = []
    actor = bare_actor(BrokenDevice(events, PeerWaitMarker()))
    with caplog.at_level(logging.DEBUG, logger="meshpilot.rank"):
        actor._drop_process_groups(keep_shards=False)
    assert "illegal memory access" in caplog.text
    assert [name for name, _ in events] == ["empty_cache"]  # the cache is still handed back


def test_a_rank_marked_waiting_counts_as_waiting_wherever_its_frame_is():
    actor = bare_actor(None)
    entered, release = threading.Event(), threading.Event()

    def loop(mark: bool) -> None:
        if mark:
            with actor._peer_waits.waiting(PeerWait.RESULT_READ):
                entered.set()
                release.wait(10)  # stands for .item() on a GPU: no torch/distributed frame
        else:
            entered.set()
            release.wait(10)

    for mark, expected in ((True, True), (False, False)):
        entered.clear()
        release.clear()
        thread = threading.Thread(target=loop, args=(mark,))
        thread.start()
        entered.wait(10)
        actor._loop_thread = thread.ident
        waiting, where = actor._peer_waits.position(actor._loop_thread)
        release.set()
        thread.join()
        assert waiting is expected
        assert where is not None and where.startswith("result read (") is mark
