"""Evaluation while training gives the same loss on any mesh, and leaves the training alone.

The same seeded weights evaluated on 1 rank and on pp=2 x tp=2 x dp_shard=2 (spawned processes
on real gloo, ``tests/ranks/eval_ranks.py``) give the mean cross entropy a plain single-process
model computes over the same evaluation samples; every rank gets the same number, and two
training steps with an evaluation between them end exactly where two steps without one do.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from elastic.spec import MeshSpec
from tests.ranks.eval_ranks import EVAL_BATCHES, GLOBAL_BATCH, MODEL, SEQ_LEN, eval_source, run_rank
from tests.ranks.spawned_ranks import spawn_ranks
from workers.data import Batch
from workers.initial_values import init_weights
from workers.models import resolve_family

LAYOUTS = {"1-rank": MeshSpec(dp_shard=1, tp=1, pp=1), "pp2-tp2-dp_shard2": MeshSpec(dp_shard=2, tp=2, pp=2)}


@functools.cache
def plain_eval_loss() -> float:
    """One process, no mesh: the seeded model's mean token cross entropy over every eval sample."""
    family = resolve_family(MODEL.family)
    model = family.build(MODEL)
    init_weights(model, family, MODEL, seed=0)
    source = eval_source()
    samples = Batch.stack([source.eval_sample(index) for index in range(EVAL_BATCHES * GLOBAL_BATCH)])
    with torch.no_grad():
        logits = model(samples.inputs)
    return F.cross_entropy(logits.flatten(0, 1), samples.labels.flatten()).item()


@functools.cache
def evaluate_on(layout: str, store_dir: str) -> dict[int, tuple]:
    mesh = LAYOUTS[layout]
    return spawn_ranks(
        functools.partial(run_rank, mesh=mesh), world_size=mesh.world_size, store_path=f"{store_dir}/{layout}-store"
    )


@pytest.fixture(scope="module")
def ranks_by_layout(tmp_path_factory) -> dict[str, dict[int, tuple]]:
    store_dir = str(tmp_path_factory.mktemp("eval-stores"))
    return {layout: evaluate_on(layout, store_dir) for layout in LAYOUTS}


@pytest.mark.slow  # four layouts of spawned ranks up to 8, ~50 s on 2 cores
def test_eval_loss_is_the_same_on_one_rank_and_on_eight(ranks_by_layout):
    expected = plain_eval_loss()
    for layout, ranks in ranks_by_layout.items():
        losses = {rank: values[0] for rank, values in ranks.items()}
        assert len(set(losses.values())) == 1, f"{layout}: the ranks disagree: {losses}"
        loss = losses[0]
        assert loss == pytest.approx(expected, rel=1e-5), layout
        assert all(values[1] == EVAL_BATCHES * GLOBAL_BATCH * SEQ_LEN for values in ranks.values()), layout
    one_rank, eight_ranks = (ranks_by_layout[layout][0][0] for layout in LAYOUTS)
    assert eight_ranks == pytest.approx(one_rank, rel=1e-5)


@pytest.mark.slow  # shares the 8-rank fixture above (~18 s); make test evaluates through the pp2 loss-parity run
def test_evaluating_leaves_the_training_as_it_was(ranks_by_layout):
    for layout, ranks in ranks_by_layout.items():
        for rank, (_, _, unchanged, with_eval, without_eval) in ranks.items():
            assert unchanged, f"{layout}: rank {rank}'s state changed while evaluating"
            assert with_eval == without_eval, f"{layout}: rank {rank} trained differently after an evaluation"
