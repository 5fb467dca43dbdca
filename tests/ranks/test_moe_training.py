"""The ``moe`` family on meshes of spawned ranks: a Qwen2-MoE written by ``transformers`` loads
with equal logits, the ``debug-moe`` preset trains alike on any mesh with the load-balancing loss
or the routing bias, and a checkpoint saved under expert parallelism restores bitwise into
another mesh.

Spawned processes on real gloo (``tests/ranks/moe_ranks.py``, ``tests/ranks/moe_checkpoint_ranks.py``,
``tests/ranks/pretrained_ranks.py``); the family in one process: tests/unit/test_moe_family.py.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
import transformers

from elastic.spec import MeshSpec
from tests.hf_models import reference_logits, save_random_model
from tests.marks import slow_when_named
from tests.ranks import moe_checkpoint_ranks, moe_ranks, pretrained_ranks
from tests.ranks.spawned_ranks import commit_step, spawn_ranks
from workers.spec import PRESETS

HF_LAYOUTS = {
    "1-rank": (MeshSpec(dp_shard=1, tp=1, pp=1), 1),
    "pp2-dp_shard2": (MeshSpec(dp_shard=2, tp=1, pp=2), 1),
    # Each rank loads its own experts (2 of the 4 per layer) from the per-expert tensors, and computes
    # the tokens routed to them.
    "ep2-dp_shard2": (MeshSpec(dp_shard=2, tp=1, pp=1), 2),
    # Each tp rank loads the whole MoE block's slice FSDP gives it over dp_shard x tp.
    "tp2-ep2-dp_shard2": (MeshSpec(dp_shard=2, tp=2, pp=1), 2),
}
TRAIN_LAYOUTS = {
    "dp_shard2": (MeshSpec(dp_shard=2, tp=1, pp=1), False, 1),
    "pp2-dp_shard2": (MeshSpec(dp_shard=2, tp=1, pp=2), False, 1),
    # Recomputation routes every token again: the same experts, the same auxiliary gradient.
    "dp_shard2-activation_checkpointing": (MeshSpec(dp_shard=2, tp=1, pp=1), True, 1),
    # Expert parallelism: each of the two dp_shard ranks holds 4 of the 8 experts and computes
    # the other rank's tokens routed to them (all-to-all); the step must not change.
    "ep2-dp_shard2": (MeshSpec(dp_shard=2, tp=1, pp=1), False, 2),
    "ep2-pp2-dp_shard2": (MeshSpec(dp_shard=2, tp=1, pp=2), False, 2),
    # Context parallelism: each rank holds half of every sequence; the load-balancing loss counts
    # the experts' tokens over the whole microbatch (the cp ranks' counts summed).
    "cp2": (MeshSpec(dp_shard=1, cp=2, tp=1, pp=1), False, 1),
    # ... and with expert parallelism: the experts' FSDP spans the cp ranks (dp_shard / ep x cp).
    "cp2-ep2-dp_shard2": (MeshSpec(dp_shard=2, cp=2, tp=1, pp=1), False, 2),
    # Tensor parallelism: the MoE block takes each rank's sequence-parallel tokens through whole
    # weights, sharded by FSDP over dp_shard x tp with their gradients summed over tp.
    "tp2": (MeshSpec(dp_shard=1, tp=2, pp=1), False, 1),
    "tp2-ep2-dp_shard2": (MeshSpec(dp_shard=2, tp=2, pp=1), False, 2),
    # All three on 8 ranks: every sequence over two cp ranks, experts over two ep ranks, two stages.
    "cp2-ep2-pp2-dp_shard2": (MeshSpec(dp_shard=2, cp=2, tp=1, pp=2), False, 2),
}


@pytest.mark.parametrize("layout", list(HF_LAYOUTS))
def test_qwen2_moe_logits_equal_transformers(layout, tmp_path):
    save_random_model("qwen2_moe", tmp_path / "model")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    mesh, ep = HF_LAYOUTS[layout]
    ranks = spawn_ranks(
        functools.partial(pretrained_ranks.run_rank, model_dir=str(tmp_path / "model"), mesh=mesh, ep=ep),
        world_size=mesh.world_size,
        store_path=str(tmp_path / "store"),
    )
    expected = reference_logits(hf_model, pretrained_ranks.fixed_tokens(hf_model.config.vocab_size))
    last_stage = [rank for rank in range(mesh.world_size) if mesh.coords(rank).pp == mesh.pp - 1]
    for rank in last_stage:
        torch.testing.assert_close(torch.from_numpy(ranks[rank][0]), expected, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def single_rank_run(tmp_path_factory):
    mesh = MeshSpec(dp_shard=1, tp=1, pp=1)
    store = tmp_path_factory.mktemp("single") / "store"
    return spawn_ranks(functools.partial(moe_ranks.run_rank, mesh=mesh), world_size=1, store_path=str(store))[0]


@pytest.mark.parametrize("layout", slow_when_named(TRAIN_LAYOUTS, {"cp2-ep2-pp2-dp_shard2"}))
def test_debug_moe_losses_match_single_rank(layout, single_rank_run, tmp_path):
    mesh, activation_checkpointing, ep = TRAIN_LAYOUTS[layout]
    ranks = spawn_ranks(
        functools.partial(moe_ranks.run_rank, mesh=mesh, activation_checkpointing=activation_checkpointing, ep=ep),
        world_size=mesh.world_size,
        store_path=str(tmp_path / "s"),
    )
    expected, _, _, expected_norms, *_ = single_rank_run
    # Each data-parallel slice reports its own mean loss: the step's loss is their mean.
    reported = [losses for losses, *_ in ranks.values() if losses[0] is not None]
    assert len(reported) == mesh.dp
    assert [sum(step) / mesh.dp for step in zip(*reported)] == pytest.approx(expected, rel=1e-3)
    assert expected[-1] < expected[0]
    # Each rank computes (and holds, once gathered for its forward) n_experts / ep experts per layer.
    assert {held for _, _, held, *_ in ranks.values()} == {8 // ep}
    # Every rank clips by the norm of the whole model's gradient, the one process's norm (its
    # experts' gradients live on other ranks under ep: the norm reduces over their mesh).
    for _, _, _, norms, *_ in ranks.values():
        assert norms == pytest.approx(expected_norms, rel=1e-3)


def test_expert_parallel_replica_groups_stay_bitwise_equal_and_train_as_one_process(tmp_path):
    # dp_replicate=2 x dp_shard=2 with ep=2: the experts' FSDP is HSDP over (dp_replicate, dp_shard / ep).
    single = functools.partial(moe_ranks.run_rank, mesh=MeshSpec(dp_shard=1, tp=1, pp=1), global_batch=16)
    expected, *_ = spawn_ranks(single, world_size=1, store_path=str(tmp_path / "one"))[0]
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, tp=1, pp=1)
    ranks = spawn_ranks(
        functools.partial(moe_ranks.run_rank, mesh=mesh, ep=2, global_batch=16),
        world_size=4,
        store_path=str(tmp_path / "s"),
    )
    assert [sum(step) / 4 for step in zip(*(losses for losses, *_ in ranks.values()))] == pytest.approx(
        expected, rel=1e-3
    )
    # Ranks that hold the same slices in the two replica groups hold the same bits (replica sync,
    # peer snapshots and drops rely on it).
    digests = {rank: digest for rank, (*_, digest) in ranks.items()}
    for rank in range(4):
        twin = mesh.rank(dataclasses.replace(mesh.coords(rank), dp_replicate=1 - mesh.coords(rank).dp_replicate))
        assert digests[rank] == digests[twin]


def test_expert_load_is_reported_per_layer(single_rank_run):
    _, load, *_ = single_rank_run
    assert sorted(load) == [f"layer{i}" for i in range(4)]
    # max over mean lies between 1 (even) and n_experts (every token on one expert).
    assert all(1.0 <= value <= 8.0 for value in load.values())


# Auxiliary-loss-free balancing alone (no auxiliary loss), with a rate that shows within 10 steps.
BIAS_BALANCING = {"router_aux_loss_coef": 0.0, "router_bias_update_rate": 0.001}  # DeepSeek-V3's rate
BIAS_LAYOUTS = {
    "dp_shard2": (MeshSpec(dp_shard=2, tp=1, pp=1), 1),
    "pp2-dp_shard2": (MeshSpec(dp_shard=2, tp=1, pp=2), 1),
    # counts summed over the tp pair and the dp_shard pair; the bias sharded over dp_shard x tp
    "tp2-ep2-dp_shard2": (MeshSpec(dp_shard=2, tp=2, pp=1), 2),
}


@pytest.fixture(scope="module")
def bias_balanced_single_rank(tmp_path_factory):
    store = tmp_path_factory.mktemp("bias") / "store"
    run = functools.partial(moe_ranks.run_rank, mesh=MeshSpec(dp_shard=1, tp=1, pp=1), balancing=BIAS_BALANCING)
    return spawn_ranks(run, world_size=1, store_path=str(store))[0]


def test_routing_bias_balances_the_experts_load(bias_balanced_single_rank, tmp_path):
    unbalanced = spawn_ranks(
        functools.partial(
            moe_ranks.run_rank, mesh=MeshSpec(dp_shard=1, tp=1, pp=1), balancing={"router_aux_loss_coef": 0.0}
        ),
        world_size=1,
        store_path=str(tmp_path / "s"),
    )[0]
    # The busiest expert's load over the mean, last step, per layer: lower once the biases moved.
    _, balanced_load, *_ = bias_balanced_single_rank
    _, unbalanced_load, *_ = unbalanced
    assert sum(balanced_load.values()) < sum(unbalanced_load.values())
    # The first step routes alike (every bias starts at zero); the losses then differ.
    balanced_losses, unbalanced_losses = bias_balanced_single_rank[0], unbalanced[0]
    assert balanced_losses[0] == unbalanced_losses[0] and balanced_losses != unbalanced_losses


@pytest.mark.parametrize("layout", list(BIAS_LAYOUTS))
def test_routing_bias_updates_alike_on_any_mesh(layout, bias_balanced_single_rank, tmp_path):
    mesh, ep = BIAS_LAYOUTS[layout]
    ranks = spawn_ranks(
        functools.partial(moe_ranks.run_rank, mesh=mesh, ep=ep, balancing=BIAS_BALANCING),
        world_size=mesh.world_size,
        store_path=str(tmp_path / "s"),
    )
    expected, _, _, _, expected_biases, _ = bias_balanced_single_rank
    reported = [losses for losses, *_ in ranks.values() if losses[0] is not None]
    assert [sum(step) / mesh.dp for step in zip(*reported)] == pytest.approx(expected, rel=1e-3)
    # Every rank's biases (of the layers its stage holds) are the one process's, bit for bit: the
    # counts are summed over every rank of the stage (a pipeline's shape inference not counted).
    assert all(any(value != 0 for value in bias) for bias in expected_biases.values())
    for *_, biases, _ in ranks.values():
        assert biases and biases == {name: expected_biases[name] for name in biases}


# (mesh, ep) a checkpoint is saved under, and the (mesh, ep)s it is restored into (one save each).
CHECKPOINT_MOVES = {
    "ep2-dp_shard2 -> ep1-1_rank": ((MeshSpec(dp_shard=2, tp=1, pp=1), 2), [(MeshSpec(dp_shard=1, tp=1, pp=1), 1)]),
    # into one rank, and the same checkpoint into another data-parallel degree, experts whole on each rank
    "ep2-cp2-dp_shard2 -> ep1-1_rank, ep1-dp_shard2": (
        (MeshSpec(dp_shard=2, cp=2, tp=1, pp=1), 2),
        [(MeshSpec(dp_shard=1, tp=1, pp=1), 1), (MeshSpec(dp_shard=2, tp=1, pp=1), 1)],
    ),
    "ep2-tp2-dp_shard2 -> ep1-1_rank": ((MeshSpec(dp_shard=2, tp=2, pp=1), 2), [(MeshSpec(dp_shard=1, tp=1, pp=1), 1)]),
}


# Every move, and one whose model balances by routing bias (a parameter without optimizer state).
MOVES = [(move, False) for move in CHECKPOINT_MOVES] + [("ep2-tp2-dp_shard2 -> ep1-1_rank", True)]
# 17-21 s a restore on 2 cores; make test keeps the plain move and the routing-bias one (which
# saves under ep2-tp2), CI runs every move (make test-all).
SLOW_MOVES = {"ep2-cp2-dp_shard2 -> ep1-1_rank, ep1-dp_shard2", "ep2-tp2-dp_shard2 -> ep1-1_rank"}


@pytest.mark.parametrize(
    ("move", "biased"),
    [
        pytest.param(move, biased, marks=pytest.mark.slow, id=move)
        if move in SLOW_MOVES and not biased
        else pytest.param(move, biased, id=f"{move}{' routing_bias' if biased else ''}")
        for move, biased in MOVES
    ],
)
def test_a_checkpoint_saved_under_ep_restores_into_another_mesh_bitwise_and_trains_on_alike(move, biased, tmp_path):
    (saved_mesh, saved_ep), targets = CHECKPOINT_MOVES[move]
    balancing = BIAS_BALANCING if biased else None
    ckpt = tmp_path / "ckpt"
    saved = spawn_ranks(
        functools.partial(
            moe_checkpoint_ranks.save_rank, mesh=saved_mesh, ep=saved_ep, ckpt_dir=str(ckpt), balancing=balancing
        ),
        world_size=saved_mesh.world_size,
        store_path=str(tmp_path / "saving"),
    )
    at = moe_checkpoint_ranks.SAVED_AT
    reports = [report for report, _, _ in saved.values()]
    commit_step(str(ckpt), reports, step=at, mesh=saved_mesh, model=PRESETS["debug-moe"].to_dict())
    _, saved_state, _ = saved[0]
    # The steps after the restore train as the saving mesh's did (each loss-reporting rank's mean).
    saved_losses = _reported_mean(rank_losses for _, _, rank_losses in saved.values())
    for index, (mesh, ep) in enumerate(targets):
        restored = spawn_ranks(
            functools.partial(
                moe_checkpoint_ranks.restore_rank, mesh=mesh, ep=ep, ckpt_dir=str(ckpt), balancing=balancing
            ),
            world_size=mesh.world_size,
            store_path=str(tmp_path / f"restoring-{index}"),
        )
        for state, _ in restored.values():
            assert "layers.0.mlp.experts.gate_proj" in state and "optim.layers.0.mlp.experts.down_proj.exp_avg" in state
            assert sorted(state) == sorted(saved_state)
            # A routing bias is saved like a parameter (moved off zero), with no optimizer state.
            assert ("layers.0.mlp.expert_bias" in state) == biased
            assert not any(name.startswith("optim.") and "expert_bias" in name for name in state)
            assert not biased or np.any(state["layers.0.mlp.expert_bias"] != 0)
            assert [name for name in state if not np.array_equal(state[name], saved_state[name])] == []
        assert _reported_mean(losses for _, losses in restored.values()) == pytest.approx(saved_losses, rel=1e-3)


def _reported_mean(per_rank) -> list[float]:
    reported = [losses for losses in per_rank if losses[0] is not None]
    return [sum(step) / len(reported) for step in zip(*reported)]
