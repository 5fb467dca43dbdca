"""The ``moe`` family: a Qwen2-MoE written by ``transformers`` loads with equal logits, the
``debug-moe`` preset trains alike on any mesh, the load-balancing loss reaches the gradient, and
``ckpt import`` then ``ckpt export`` gives ``transformers`` the same model back.

Spawned processes on real gloo (``tests/unit/moe_ranks.py``, ``tests/unit/pretrained_ranks.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from checkpointing.manifest import build_manifest
from checkpointing.spec import manifest_key
from checkpointing.storage import open_storage
from elastic.spec import MeshSpec
from orchestrator.cli import main
from orchestrator.config import load_config
from tests.hf_models import reference_logits, save_random_model
from tests.jobs import DEMO_CONFIG, REPO
from tests.marks import slow_when_named
from tests.unit import moe_checkpoint_ranks, moe_ranks, pretrained_ranks
from tests.unit.spawned_ranks import spawn_ranks
from workers.models import resolve_family
from workers.models.moe.model import AttachAuxiliaryLoss, MixtureOfExperts
from workers.spec import PRESETS, MoeArgs
from workers.spec.families.llama_hf import HfConfigError
from workers.spec.families.moe_hf import moe_hf_config, moe_spec_from_hf

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


def test_a_routing_bias_has_no_hugging_face_equivalent():
    spec = dataclasses.replace(PRESETS["debug-moe"], router_bias_update_rate=0.001)
    with pytest.raises(HfConfigError, match="Qwen2MoeForCausalLM has no routing bias"):
        moe_hf_config(spec, dtype="float32")


def _moe_block(coef: float) -> MixtureOfExperts:
    spec = PRESETS["debug-moe"]
    assert isinstance(spec, MoeArgs)
    spec = dataclasses.replace(spec, router_aux_loss_coef=coef)
    torch.manual_seed(0)
    block = MixtureOfExperts(spec)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.1)
    return block


def test_load_balancing_loss_gradient_is_added_to_the_training_loss():
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    block = _moe_block(coef=0.5)
    block.auxiliary_loss_scale = 0.25
    block(x).square().mean().backward()
    attached = block.gate.weight.grad.clone()

    plain = _moe_block(coef=0.0)
    out = plain(x)
    assert plain.tokens_per_expert is not None
    aux = plain.load_balancing_loss(plain.gate(x.reshape(-1, 64)).float().softmax(-1), plain.tokens_per_expert)
    (out.square().mean() + 0.5 / 4 * 0.25 * aux).backward()
    torch.testing.assert_close(attached, plain.gate.weight.grad)
    assert not torch.equal(attached, _router_grad_without_aux(x))


def _router_grad_without_aux(x: torch.Tensor) -> torch.Tensor:
    block = _moe_block(coef=0.0)
    block(x).square().mean().backward()
    assert block.gate.weight.grad is not None
    return block.gate.weight.grad


def test_every_token_reaches_its_top_k_experts():
    block = _moe_block(coef=0.0)
    with torch.no_grad():
        block(torch.randn(3, 10, 64))
    assert block.tokens_per_expert is not None and int(block.tokens_per_expert.sum()) == 3 * 10 * 2


def test_attach_auxiliary_loss_leaves_the_output_unchanged():
    out, aux = torch.randn(4, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    attached = AttachAuxiliaryLoss.apply(out, aux, 0.3)
    assert torch.equal(attached, out)
    attached.sum().backward()
    assert aux.grad == pytest.approx(0.3) and torch.equal(out.grad, torch.ones(4))


def test_parameter_counts_are_total_and_active():
    spec = PRESETS["debug-moe"]
    with torch.device("meta"):
        model = resolve_family("moe").build(spec)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    expert = 3 * spec.dim * spec.expert_ffn_dim
    assert spec.num_params - spec.num_active_params == spec.n_layers * (spec.n_experts - 2) * expert
    assert spec.flops_per_token(32) < dataclasses.replace(spec, top_k_experts=8).flops_per_token(32)


def test_hf_config_round_trips():
    spec = dataclasses.replace(PRESETS["debug-moe"], qkv_bias=True, normalize_top_k=True)
    assert moe_spec_from_hf(moe_hf_config(spec, dtype="float32"), "config.json") == spec


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decoder_sparse_step": 2}, "the moe family builds a mixture of experts in every layer"),
        ({"mlp_only_layers": [0]}, "set decoder_sparse_step=1 and mlp_only_layers=[]"),
        ({"num_experts": 0}, "num_experts must be a positive integer, found 0"),
    ],
)
def test_unbuilt_qwen2_moe_configs_are_refused_by_name(change, message):
    config = {**moe_hf_config(PRESETS["debug-moe"], dtype="float32"), **change}
    with pytest.raises(HfConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        moe_spec_from_hf(config, "config.json")


def test_debug_moe_preset_selects_the_moe_family(monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config(DEMO_CONFIG, ["model.preset=debug-moe", "parallelism.tp=1"])
    assert config.model_spec.family == "moe" and config.model_spec.n_experts == 8


def test_the_moe_family_on_a_dense_preset_takes_its_experts_from_the_keys(monkeypatch):
    """``family: moe`` gives a dense preset's width and depth to MoeArgs, and the keys set its experts."""
    monkeypatch.chdir(REPO)
    keys = ["model.family=moe", "model.n_experts=4", "model.top_k_experts=1", "parallelism.tp=1"]
    spec = load_config(DEMO_CONFIG, keys).model_spec
    assert isinstance(spec, MoeArgs) and spec.family == "moe"
    assert (spec.dim, spec.n_layers, spec.n_experts, spec.expert_ffn_dim) == (64, 4, 4, spec.ffn_dim)


def test_qwen2_moe_import_then_export_loads_in_transformers_with_equal_logits(tmp_path, capsys):
    source = save_random_model("qwen2_moe", tmp_path / "hf")
    checkpoints = tmp_path / "ckpt"
    assert main(["ckpt", "import", str(tmp_path / "hf"), str(checkpoints)]) == 0, capsys.readouterr()
    assert main(["ckpt", "export", str(checkpoints), "--out", str(tmp_path / "out")]) == 0, capsys.readouterr()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert type(exported).__name__ == "Qwen2MoeForCausalLM"
    tokens = pretrained_ranks.fixed_tokens(source.config.vocab_size)
    torch.testing.assert_close(reference_logits(exported, tokens), reference_logits(source, tokens), rtol=0, atol=0)


# (mesh, ep) a checkpoint is saved under, and (mesh, ep) it is restored into.
CHECKPOINT_MOVES = {
    "ep2-dp_shard2 -> ep1-1_rank": ((MeshSpec(dp_shard=2, tp=1, pp=1), 2), (MeshSpec(dp_shard=1, tp=1, pp=1), 1)),
    "ep2-cp2-dp_shard2 -> ep1-1_rank": (
        (MeshSpec(dp_shard=2, cp=2, tp=1, pp=1), 2),
        (MeshSpec(dp_shard=1, tp=1, pp=1), 1),
    ),
    "ep2-tp2-dp_shard2 -> ep1-1_rank": ((MeshSpec(dp_shard=2, tp=2, pp=1), 2), (MeshSpec(dp_shard=1, tp=1, pp=1), 1)),
    # the same checkpoint into another data-parallel degree, experts whole on each rank
    "ep2-cp2-dp_shard2 -> ep1-dp_shard2": (
        (MeshSpec(dp_shard=2, cp=2, tp=1, pp=1), 2),
        (MeshSpec(dp_shard=2, tp=1, pp=1), 1),
    ),
}


# Every move, and one whose model balances by routing bias (a parameter without optimizer state).
MOVES = [(move, False) for move in CHECKPOINT_MOVES] + [("ep2-tp2-dp_shard2 -> ep1-1_rank", True)]
# 17-21 s each on 2 cores; make test keeps the plain move and the routing-bias one (which saves
# under ep2-tp2), CI runs every move (make test-all).
SLOW_MOVES = {
    "ep2-cp2-dp_shard2 -> ep1-1_rank",
    "ep2-tp2-dp_shard2 -> ep1-1_rank",
    "ep2-cp2-dp_shard2 -> ep1-dp_shard2",
}


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
    (saved_mesh, saved_ep), (mesh, ep) = CHECKPOINT_MOVES[move]
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
    manifest = build_manifest(
        [report for report, _, _ in saved.values()],
        step=at,
        world_size=saved_mesh.world_size,
        mesh=saved_mesh.as_dict(),
        model=PRESETS["debug-moe"].to_dict(),
        config_hash=None,
    )
    assert open_storage(str(ckpt)).put_if_absent(manifest_key(at), manifest.to_json())
    restored = spawn_ranks(
        functools.partial(moe_checkpoint_ranks.restore_rank, mesh=mesh, ep=ep, ckpt_dir=str(ckpt), balancing=balancing),
        world_size=mesh.world_size,
        store_path=str(tmp_path / "restoring"),
    )
    _, saved_state, _ = saved[0]
    for state, _ in restored.values():
        assert "layers.0.mlp.experts.gate_proj" in state and "optim.layers.0.mlp.experts.down_proj.exp_avg" in state
        assert sorted(state) == sorted(saved_state)
        # A routing bias is saved like a parameter (moved off zero), with no optimizer state.
        assert ("layers.0.mlp.expert_bias" in state) == biased
        assert not any(name.startswith("optim.") and "expert_bias" in name for name in state)
        assert not biased or np.any(state["layers.0.mlp.expert_bias"] != 0)
        assert [name for name in state if not np.array_equal(state[name], saved_state[name])] == []
    # The steps after the restore train as the saving mesh's did (each loss-reporting rank's mean).
    saved_losses = _reported_mean(rank_losses for _, _, rank_losses in saved.values())
    assert _reported_mean(losses for _, losses in restored.values()) == pytest.approx(saved_losses, rel=1e-3)


def _reported_mean(per_rank) -> list[float]:
    reported = [losses for losses in per_rank if losses[0] is not None]
    return [sum(step) / len(reported) for step in zip(*reported)]


def test_training_released_weights_with_a_routing_bias_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    save_random_model("qwen2_moe", tmp_path / "hf")
    monkeypatch.chdir(REPO)
    argv = ["--set", f"model.init_from={tmp_path / 'hf'}", "--set", "model.router_bias_update_rate=0.001"]
    assert main(["train", str(DEMO_CONFIG), *argv]) == 2
    err = capsys.readouterr().err
    assert "model.router_bias_update_rate=0.001 with model.init_from: released Hugging Face MoE weights" in err
    assert "Traceback" not in err


def test_importing_a_model_that_lacks_one_experts_tensor_names_it(tmp_path, capsys):
    save_random_model("qwen2_moe", tmp_path / "hf")
    (weights_file,) = (tmp_path / "hf").glob("*.safetensors")
    weights = load_file(weights_file)
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(weights, weights_file, metadata={"format": "pt"})
    assert main(["ckpt", "import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert (
        "holds no tensor model.layers.1.mlp.experts.3.up_proj.weight (for parameter layers.1.mlp.experts.up_proj;"
        in err
    )
    assert "Traceback" not in err
