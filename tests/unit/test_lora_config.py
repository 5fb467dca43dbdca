"""``model.lora``: the settings reach the ranks, and bad ones are one clear line with exit 2.

python -m pytest tests/unit/test_lora_config.py -q
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from orchestrator.api.training import build_config
from orchestrator.cli import main
from orchestrator.driver.train_spec import train_spec
from orchestrator.errors import ConfigError
from tests.hf_models import save_random_model
from tests.jobs import DEMO_CONFIG, REPO
from workers.spec.lora import DEFAULT_TARGETS, LoraSpec

CASES = [
    (["--set", "model.lora.rank=0"], "model.lora.rank=0 must be a positive integer, e.g. 16"),
    (["--set", "model.lora.rank=-4"], "model.lora.rank=-4 must be a positive integer, e.g. 16"),
    (
        ["--set", "model.lora.target_modules=[q_proj,qkv_proj]"],
        "model.lora.target_modules=['q_proj', 'qkv_proj']: qkv_proj: no linear layer of the llama model has that "
        "name; name some of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
    ),
    (
        ["--set", "model.preset=debug-moe", "--set", "model.lora.target_modules=[q_proj,down_proj]"],
        "model.lora.target_modules=['q_proj', 'down_proj']: down_proj: the moe family's feed-forward is its "
        "experts, which take no adapters; name some of q_proj, k_proj, v_proj, o_proj",
    ),
    (["--set", "model.lora.target_modules=7"], "model.lora.target_modules: expected a list of names, got int 7"),
    (["--set", "model.lora.dropout=1.5"], "model.lora.dropout=1.5 must be in [0, 1)"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[c[1][:50] for c in CASES])
def test_bad_lora_setting_is_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code = main(["train", str(DEMO_CONFIG), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_lora_reaches_the_ranks_from_the_python_api():
    config = build_config(
        {"data": {"source": "synthetic"}, "model": {"lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj"]}}}
    )
    spec = train_spec(config)
    assert spec.lora == LoraSpec(rank=8, alpha=16.0, dropout=0.0, target_modules=("q_proj",))
    assert spec.lora_base is not None and spec.lora_base.source == "random-init:seed=0"


def test_lora_defaults_to_the_attention_projections_and_null_turns_it_off():
    on = build_config({"data": {"source": "synthetic"}}, overrides={"model.lora": {}})
    assert train_spec(on).lora == LoraSpec(target_modules=DEFAULT_TARGETS)
    off = build_config({"data": {"source": "synthetic"}, "model": {"lora": None}})
    assert train_spec(off).lora is None and train_spec(off).lora_base is None


def test_lora_changes_the_config_hash_and_round_trips_through_yaml(tmp_path):
    plain = build_config({"data": {"source": "synthetic"}})
    lora = build_config({"data": {"source": "synthetic"}, "model": {"lora": {"rank": 4}}})
    assert plain.config_hash() != lora.config_hash()
    written = tmp_path / "job.yaml"
    written.write_text(lora.to_yaml())
    assert build_config(str(written)).model.lora == lora.model.lora


def test_the_seeded_base_is_named_by_family_shape_and_seed():
    one = train_spec(build_config({"data": {"source": "synthetic"}, "model": {"lora": {}}}))
    seeded = {"data": {"source": "synthetic"}, "model": {"lora": {}}, "training": {"seed": 3}}
    other_seed = train_spec(build_config(seeded))
    assert one.lora_base is not None and other_seed.lora_base is not None
    assert other_seed.lora_base.source == "random-init:seed=3"
    assert one.lora_base.sha256 != other_seed.lora_base.sha256


def test_a_family_the_user_brings_names_its_own_linear_layers(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = ["--set", "model.family=tests.families.gpt2:Gpt2Family", "--set", "model.lora.target_modules=[q_proj]"]
    code = main(["train", str(DEMO_CONFIG), *argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (
        "model.lora.target_modules=['q_proj']: q_proj: no linear layer of the tests.families.gpt2:Gpt2Family model "
        "has that name; name some of q, k, v, out, fc, proj" in err
    )


def test_released_weights_are_named_by_their_directory_and_a_hash_of_their_contents(tmp_path):
    """The base of ``model.init_from``: its URI, and a hash that a changed weight changes."""
    save_random_model("llama3", tmp_path)
    job = {"data": {"source": "synthetic"}, "model": {"init_from": str(tmp_path), "lora": {}}}
    base = train_spec(build_config(job)).lora_base
    assert base is not None and base.source == str(tmp_path.resolve())
    assert train_spec(build_config(job)).lora_base == base  # read again: the same
    header = _safetensors_header(tmp_path / "model.safetensors")
    weights = load_file(tmp_path / "model.safetensors")
    name = "model.layers.2.self_attn.v_proj.weight"
    weights[name] = weights[name] + torch.full_like(weights[name], 1e-3)  # another fine-tune, same layout
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert _safetensors_header(tmp_path / "model.safetensors") == header  # names, dtypes, shapes, offsets alike
    changed = train_spec(build_config(job)).lora_base
    assert changed is not None and changed.sha256 != base.sha256


def _safetensors_header(path) -> bytes:
    data = path.read_bytes()
    return data[8 : 8 + int.from_bytes(data[:8], "little")]


def test_the_snapshot_memory_check_prices_the_adapters_only(monkeypatch):
    """A limit full training's snapshots exceed (1 MiB: the demo model's need 1.3 MiB a rank) holds a
    LoRA run's, whose snapshots are the adapters and their optimizer state."""
    monkeypatch.chdir(REPO)
    limit = "elastic.snapshot_memory_limit_mb=1"
    with pytest.raises(ConfigError, match="too small for peer-memory snapshots"):
        build_config(DEMO_CONFIG, overrides=[limit])
    config = build_config(DEMO_CONFIG, overrides=[limit, "model.lora.rank=8"])
    assert config.model.lora is not None and config.elastic.snapshot_memory_limit_mb == 1
