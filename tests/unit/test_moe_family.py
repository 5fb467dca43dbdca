"""The ``moe`` family in one process: the load-balancing loss reaches the gradient, the Hugging
Face config round-trips and unbuilt ones are refused by name, and ``ckpt import`` then ``ckpt
export`` gives ``transformers`` the same model back.

Loading, training and checkpoints on meshes of spawned ranks: tests/ranks/test_moe_training.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from orchestrator.cli import main
from orchestrator.config import load_config
from tests.hf_models import reference_logits, save_random_model
from tests.jobs import DEMO_CONFIG, REPO
from tests.ranks import pretrained_ranks
from workers.models import resolve_family
from workers.models.moe.model import AttachAuxiliaryLoss, MixtureOfExperts
from workers.spec import PRESETS, MoeArgs
from workers.spec.families.llama_hf import HfConfigError
from workers.spec.families.moe_hf import moe_hf_config, moe_spec_from_hf


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
