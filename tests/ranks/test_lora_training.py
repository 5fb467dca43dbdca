"""LoRA trains the same on any mesh, and only the adapters train.

    python -m pytest tests/ranks/test_lora_training.py -q

Spawned gloo ranks (no Ray, ``tests/ranks/lora_ranks.py``): 10 steps of the debug model with
adapters on all seven linear layers of every block, per-step losses of one rank against
pp2 x tp2 x dp_shard2 within 1e-3 relative, then the trained model's logits. On every rank the
frozen base is bit-identical after training and nothing but the adapters has a gradient,
optimizer state or a place in what checkpoints and snapshots save.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest

from elastic.spec import MeshSpec
from tests.ranks import lora_checkpoint_ranks
from tests.ranks.lora_ranks import SPEC, STEPS, run_rank
from tests.ranks.spawned_ranks import commit_step, spawn_ranks
from workers.spec import PRESETS
from workers.spec.lora import LoraBase, LoraSpec


def _run(mesh: dict[str, int], tmp_path, spec: dict | None = None) -> dict[int, tuple]:
    return spawn_ranks(
        functools.partial(run_rank, mesh, spec or {}),
        world_size=math.prod(mesh.values()),
        store_path=str(tmp_path / "store"),
    )


def _losses(outcomes: dict[int, tuple]) -> list[float]:
    reported = [losses for losses, *_ in outcomes.values() if losses is not None]
    return [sum(step) / len(step) for step in zip(*reported)]


def _assert_only_adapters_train(outcomes: dict[int, tuple]) -> None:
    for rank, (_, _, base_unchanged, with_grad, with_state, saved) in outcomes.items():
        assert base_unchanged, f"rank {rank} changed a frozen base weight"
        assert with_grad and all(".lora_" in name for name in with_grad), with_grad
        assert with_state == with_grad  # optimizer state for the adapters, none for the base
        assert saved and all(".lora_" in name for name in saved), saved


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory) -> dict[int, tuple]:
    return _run({"dp_shard": 1}, tmp_path_factory.mktemp("single"))


def test_one_rank_trains_the_adapters_only(single_rank):
    _assert_only_adapters_train(single_rank)
    losses = _losses(single_rank)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    (_, _, _, with_grad, _, saved) = single_rank[0]
    assert len(with_grad) == 2 * 7 * 4  # A and B of 7 layers in each of the debug model's 4 blocks
    assert saved == sorted(
        with_grad + [f"optim.{name}.{key}" for name in with_grad for key in ("exp_avg", "exp_avg_sq", "step")]
    )


def test_pp2_tp2_dp_shard2_trains_like_one_rank(single_rank, tmp_path):
    run = _run({"dp_shard": 2, "tp": 2, "pp": 2}, tmp_path)
    _assert_only_adapters_train(run)
    assert _losses(run) == pytest.approx(_losses(single_rank), rel=1e-3)
    logits = [held for _, held, *_ in run.values() if held is not None]
    assert logits
    for held in logits:
        np.testing.assert_allclose(held, single_rank[0][1], rtol=1e-3, atol=1e-4)


@pytest.mark.slow  # two MoE runs, 6-14 s on 2 cores; CI runs it
def test_moe_attention_adapters_train_alike_under_tp_and_leave_the_experts_frozen(tmp_path):
    """The moe family takes adapters on attention: its experts, router and routing biases stay
    as they were (the biases' own update is skipped too), and tp2 (the experts whole on each tp
    rank, sharded by FSDP2 over both) trains as one rank does."""
    moe = {"model": dataclasses.replace(PRESETS["debug-moe"], router_bias_update_rate=0.01), "lora": LoraSpec(rank=4)}
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = _run({"dp_shard": 1}, tmp_path / "one", moe)
    two = _run({"dp_shard": 1, "tp": 2}, tmp_path / "two", moe)
    _assert_only_adapters_train(one)
    _assert_only_adapters_train(two)
    assert all(".self_attn." in name for name in one[0][3])
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-3)


def _save(mesh: MeshSpec, tmp_path) -> dict[int, tuple]:
    saved = spawn_ranks(
        functools.partial(lora_checkpoint_ranks.save_rank, mesh=mesh, ckpt_dir=str(tmp_path / "ckpt")),
        world_size=mesh.world_size,
        store_path=str(tmp_path / "saving"),
    )
    at = lora_checkpoint_ranks.SAVED_AT
    reports = [report for report, _, _ in saved.values()]
    manifest = commit_step(str(tmp_path / "ckpt"), reports, step=at, mesh=mesh, model=PRESETS["debug"].to_dict())
    # The checkpoint holds what trains and names the rest.
    assert manifest.tensors and all(".lora_" in name for name in manifest.tensors)
    assert SPEC.lora is not None and manifest.lora == SPEC.lora.to_dict()
    assert manifest.lora_base == lora_checkpoint_ranks.BASE.to_dict()
    return saved


def test_a_lora_checkpoint_resumes_on_another_mesh(tmp_path):
    saved = _save(MeshSpec(dp_shard=1, tp=2, pp=2), tmp_path)
    restored = spawn_ranks(
        functools.partial(
            lora_checkpoint_ranks.restore_rank, mesh=MeshSpec(dp_shard=2, tp=1, pp=1), ckpt_dir=str(tmp_path / "ckpt")
        ),
        world_size=2,
        store_path=str(tmp_path / "restoring"),
    )
    by_stage = [state for _, state, _ in saved.values()]
    saved_state = {name: value for state in by_stage for name, value in state.items()}
    for state, _ in restored.values():
        assert sorted(state) == sorted(saved_state)
        assert [name for name in state if not np.array_equal(state[name], saved_state[name])] == []
    # The steps after the restore train as the saving mesh's did (the mean of the data-parallel slices').
    saved_losses = _losses({rank: (losses,) for rank, (_, _, losses) in saved.items() if losses[0] is not None})
    restored_losses = _losses({rank: (losses,) for rank, (_, losses) in restored.items() if losses[0] is not None})
    assert restored_losses == pytest.approx(saved_losses, rel=1e-3)


def test_a_lora_checkpoint_refuses_another_base(tmp_path):
    _save(MeshSpec(dp_shard=2, tp=1, pp=1), tmp_path)
    other = LoraBase(source="s3://bucket/other-model", sha256="1" * 64)
    refused = spawn_ranks(
        functools.partial(
            lora_checkpoint_ranks.restore_rank,
            mesh=MeshSpec(dp_shard=1, tp=1, pp=1),
            ckpt_dir=str(tmp_path / "ckpt"),
            base=other,
        ),
        world_size=1,
        store_path=str(tmp_path / "restoring"),
    )
    message, _ = refused[0]
    assert message == (
        f"ForeignCheckpointError: checkpoint {tmp_path / 'ckpt'} step 5 holds LoRA adapters trained on the base "
        f"random-init:seed=0 (sha256 {'0' * 64}), but this job's base s3://bucket/other-model has sha256 "
        f"{'1' * 64}: point model.init_from at the base the adapters were trained on, or use a fresh checkpoint.uri"
    )
