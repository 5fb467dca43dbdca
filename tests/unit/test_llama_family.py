"""The llama family against ``transformers``, in one process: shapes from config.json, logits equal.

The weights are copied by the family's Hugging Face names (no loader involved), so a failure
here is in the model or the config mapping, not in the reading of files.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.hf_models import ARCHITECTURES, reference_logits, save_random_model
from workers.models import LlamaFamily
from workers.spec import PRESETS
from workers.spec.families.llama_hf import HfConfigError, llama_spec_from_hf


@pytest.mark.parametrize(
    "changes",
    [{}, {"qkv_bias": True}, {"attention_head_dim": 32, "n_kv_heads": 4}],
    ids=["debug", "qwen2-biases", "wide-heads"],
)
def test_the_args_count_the_parameters_the_family_builds(changes):
    """What the planner counts is what a rank holds: the args' counts against the model on meta."""
    spec = dataclasses.replace(PRESETS["debug"], **changes)
    with torch.device("meta"):
        model = LlamaFamily().build(spec)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert spec.num_active_params == spec.num_params  # every parameter computes every token
    layer = sum(p.numel() for p in model.layers["0"].parameters())
    assert spec.params_per_layer == layer
    assert spec.head_params == sum(p.numel() for name in ("norm", "lm_head") for p in getattr(model, name).parameters())


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_logits_equal_transformers(name, tmp_path):
    hf_model = save_random_model(name, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    family = LlamaFamily()
    spec = family.spec_from_hf_config(config, "config.json")
    model = family.build(spec)
    hf_state = hf_model.state_dict()
    names = family.hf_source_names(spec, [n for n, _ in model.named_parameters()], set(hf_state))
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            param.copy_(hf_state[names[fqn]])
    tokens = torch.randint(0, spec.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(ours, reference_logits(hf_model, tokens), rtol=0, atol=1e-5)


def test_shapes_read_from_config_json(tmp_path):
    save_random_model("llama3", tmp_path)
    spec = llama_spec_from_hf(json.loads((tmp_path / "config.json").read_text()), "config.json")
    assert (spec.dim, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim) == (48, 4, 4, 2, 16)
    assert spec.rope_scaling is not None and spec.rope_scaling.factor == 8.0
    assert (spec.rope_theta, spec.vocab_size, spec.ffn_dim, spec.tie_embeddings) == (50000.0, 256, 80, False)
    save_random_model("qwen2", tmp_path / "qwen")
    assert llama_spec_from_hf(json.loads((tmp_path / "qwen" / "config.json").read_text()), "c").qkv_bias


def test_older_config_layout_is_read():
    """rope_theta and rope_scaling at the top level, as transformers 4.x wrote them."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "intermediate_size": 128,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    spec = llama_spec_from_hf(config, "config.json")
    assert spec.rope_theta == 500000.0 and spec.rope_scaling is not None and spec.rope_scaling.factor == 32.0
    assert spec.n_kv_heads == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "architecture GPT2LMHeadModel is not supported; supported: "
            "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'; the llama family builds SwiGLU (silu) only"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling of type 'yarn' is not supported"),
        ({"hidden_size": "64"}, "hidden_size must be a positive integer, found '64'"),
        ({"architectures": []}, "'architectures' is []; it must name the one model class"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change, message):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "intermediate_size": 128,
        **change,
    }
    with pytest.raises(HfConfigError) as error:
        llama_spec_from_hf(config, "model/config.json")
    assert message in str(error.value)
    assert str(error.value).startswith("model/config.json")
