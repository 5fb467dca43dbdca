"""Exactly-once data for any mesh, the batch plan, and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from workers.data import Batch, SyntheticSource, TextSource, local_batch, step_samples
from workers.spec import PRESETS, TrainSpec
from workers.spec.train import BatchPlan


def _rows(batch: Batch) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for row in torch.cat([batch.inputs, batch.labels], dim=1)]


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_any_dp_split_sees_the_same_samples(dp):
    source = SyntheticSource(vocab_size=256, seq_len=16, seed=3)
    whole = _rows(local_batch(source, step=5, global_batch=16, dp_rank=0, dp=1))
    pieces = []
    for dp_rank in range(dp):
        pieces += _rows(local_batch(source, step=5, global_batch=16, dp_rank=dp_rank, dp=dp))
    assert pieces == whole


def test_steps_never_overlap_and_a_mesh_change_neither_skips_nor_repeats():
    source = TextSource(bytes(range(256)) * 40, seq_len=32, seed=0)
    seen = []
    for step in range(1, 31):
        dp = 4 if step <= 10 else (2 if step <= 20 else 4)  # shrink, then grow
        for dp_rank in range(dp):
            seen += list(step_samples(step, 8))[dp_rank * (8 // dp) : (dp_rank + 1) * (8 // dp)]
        batch = torch.cat([local_batch(source, step=step, global_batch=8, dp_rank=r, dp=dp).inputs for r in range(dp)])
        assert batch.shape == (8, 32)
    assert seen == list(range(30 * 8))


def test_text_windows_cover_each_epoch_once():
    data = bytes(range(256)) * 10
    source = TextSource(data, seq_len=64, seed=1)
    starts = [bytes(source.sample(i).inputs[:4].to(torch.uint8).tolist()) for i in range(source.windows)]
    expected = [data[j * 64 : j * 64 + 4] for j in range(source.windows)]
    assert sorted(starts) == sorted(expected)
    # the next epoch is another permutation of the same windows
    second = [
        bytes(source.sample(source.windows + i).inputs[:4].to(torch.uint8).tolist()) for i in range(source.windows)
    ]
    assert sorted(second) == sorted(expected) and second != starts


def test_text_too_short_for_seq_len():
    with pytest.raises(ValueError, match="training.seq_len=128 needs at least 130"):
        TextSource(b"tiny", seq_len=128, seed=0)


def test_warmup_then_cosine_to_floor():
    spec = TrainSpec(
        model=PRESETS["debug"],
        steps=100,
        global_batch=8,
        seq_len=8,
        microbatch_size=1,
        lr=1.0,
        warmup_steps=10,
        min_lr_ratio=0.1,
    )
    assert spec.lr_at(1) == pytest.approx(0.1)
    assert spec.lr_at(10) == pytest.approx(1.0)
    assert spec.lr_at(55) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert spec.lr_at(100) == pytest.approx(0.1)
    assert all(spec.lr_at(s) >= spec.lr_at(s + 1) for s in range(10, 100))


def test_accumulation_keeps_the_global_batch():
    spec = TrainSpec(model=PRESETS["debug"], steps=1, global_batch=16, seq_len=8, microbatch_size=2, microbatches=2)
    assert spec.accumulation(4) == 1
    assert spec.accumulation(2) == 2
    assert spec.accumulation(1) == 4
    with pytest.raises(ValueError, match="not a multiple of dp=3"):
        spec.accumulation(3)


def test_the_configured_mesh_runs_one_round_and_a_smaller_one_accumulates():
    plan = BatchPlan.for_mesh(32, dp=4, microbatches=2)
    assert (plan.microbatch_size, plan.rank_round_samples, plan.round_samples(4)) == (4, 8, 32)
    assert [plan.accumulation(dp) for dp in (4, 2, 1)] == [1, 2, 4]
    assert [plan.fits(dp) for dp in (1, 2, 3, 4, 8)] == [True, True, False, True, False]
    assert plan.samples_per_rank(4) == 8 and plan.samples_per_rank(2) == 16
    with pytest.raises(
        ValueError,
        match=r"^global_batch=32 is not a multiple of dp=3 x microbatches=2 x "
        r"microbatch_size=4$",
    ):
        plan.accumulation(3)


def test_the_train_spec_s_batch_is_the_plan_of_its_fields():
    spec = TrainSpec(model=PRESETS["debug"], steps=1, global_batch=16, seq_len=8, microbatch_size=2, microbatches=2)
    assert spec.batch == BatchPlan(global_batch=16, microbatch_size=2, microbatches=2)
