"""The model section: families, shapes from a Hugging Face config.json, the Python API's config.

Bad input gets one clear error naming the file or key and the fix, exit code 2, no traceback.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import meshpilot
from orchestrator.cli import main
from orchestrator.config import load_config
from tests.hf_models import save_random_model
from tests.jobs import DEMO_CONFIG, REPO


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama3")
    save_random_model("llama3", directory)
    return directory


def _train_error(capsys, *overrides: str) -> str:
    code = main(["train", str(DEMO_CONFIG), *[arg for o in overrides for arg in ("--set", o)]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err


def test_hf_config_fills_every_shape_field_and_keys_override_it(llama_dir, monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config(DEMO_CONFIG, [f"model.hf_config={llama_dir}", "model.rope_theta=1000.0"])
    spec = config.model_spec
    assert (spec.dim, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.vocab_size) == (48, 4, 4, 2, 256)
    assert spec.head_dim == 16 and spec.rope_scaling is not None and spec.family == "llama"
    assert spec.rope_theta == 1000.0  # the explicit key wins
    by_file = load_config(DEMO_CONFIG, [f"model.hf_config={llama_dir / 'config.json'}"]).model_spec
    assert by_file.dim == 48


def test_config_hash_follows_the_shape_not_the_path(llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    (copy / "config.json").write_text((llama_dir / "config.json").read_text())
    first = load_config(DEMO_CONFIG, [f"model.hf_config={llama_dir}"]).config_hash()
    assert load_config(DEMO_CONFIG, [f"model.hf_config={copy}"]).config_hash() == first
    assert load_config(DEMO_CONFIG, [f"model.hf_config={copy}", "model.rope_theta=7.0"]).config_hash() != first


def test_unsupported_architecture_is_refused_naming_the_supported(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    err = _train_error(capsys, f"model.hf_config={tmp_path}")
    assert f"{tmp_path}/config.json: architecture GPT2LMHeadModel is not supported; supported: LlamaForCausalLM" in err
    assert "model.family: package.module:Class" in err


def test_shapes_that_do_not_divide_the_mesh_name_the_config_json(llama_dir, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    err = _train_error(capsys, f"model.hf_config={llama_dir}", "parallelism.tp=4", "parallelism.dp_shard=1")
    assert f"parallelism (model shape from {llama_dir}): " in err
    assert "n_kv_heads=2" in err and "tp=4" in err
    err = _train_error(capsys, f"model.hf_config={llama_dir}", "parallelism.pp=8", "parallelism.microbatches=8")
    assert "n_layers=4" in err and "pp=8" in err


def test_a_family_path_that_does_not_import(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    err = _train_error(capsys, "model.family=my_pkg.models:MyFamily")
    assert "model.family 'my_pkg.models:MyFamily': module my_pkg.models does not import" in err
    assert "install the package that holds it on every node, or fix the path" in err


def test_a_family_path_naming_something_else(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    err = _train_error(capsys, "model.family=json:JSONDecoder")
    assert "json has no ModelFamily subclass named JSONDecoder" in err


def test_missing_model_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    err = _train_error(capsys, f"model.init_from={tmp_path / 'nowhere'}")
    assert "nowhere: no such file or directory; give a Hugging Face model directory or its config.json" in err


def test_sequence_longer_than_a_sliding_window_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    save_random_model("mistral", tmp_path)  # sliding_window 128
    err = _train_error(capsys, f"model.hf_config={tmp_path}", "training.seq_len=200")
    assert "training.seq_len=200 exceeds the model's sliding_window=128" in err


def test_python_api_builds_the_same_config_as_the_cli(monkeypatch):
    monkeypatch.chdir(REPO)
    from_yaml = meshpilot.build_config(DEMO_CONFIG, overrides={"parallelism.tp": 1, "training.lr": 0.001})
    assert from_yaml.parallelism.tp == 1 and from_yaml.training.lr == 0.001
    in_code = meshpilot.JobConfig()
    in_code.training = dataclasses.replace(in_code.training, steps=7)
    built = meshpilot.build_config(in_code, overrides=["parallelism.pp=1"])
    assert built.training.steps == 7 and built.parallelism.pp == 1 and in_code.parallelism.pp == 2
    as_mapping = meshpilot.build_config({"training": {"steps": 3}}, model_family=meshpilot.ModelFamily)
    assert as_mapping.model.family == "workers.models.family:ModelFamily"


def test_python_api_raises_the_config_error(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(meshpilot.ConfigError) as error:
        meshpilot.build_config(DEMO_CONFIG, overrides={"parallelism.tpp": 2})
    assert "parallelism.tpp: unknown key; did you mean 'parallelism.tp'?" in str(error.value)

    class Local(meshpilot.ModelFamily):
        name = "local"

    with pytest.raises(meshpilot.ConfigError) as error:
        meshpilot.build_config(None, model_family=Local)
    assert "rank processes cannot import it; move it to a module of an installed package" in str(error.value)


def _sharded_copy(source, destination):
    """``source``'s model re-saved in two safetensors files with an index, by transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    model.save_pretrained(destination, max_shard_size="200KB")
    return sorted(p.name for p in destination.glob("model-*.safetensors"))


def test_a_shard_named_in_the_index_but_missing(llama_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    files = _sharded_copy(llama_dir, tmp_path)
    assert len(files) >= 2
    (tmp_path / files[-1]).unlink()
    err = _train_error(capsys, f"model.init_from={tmp_path}")
    assert f"model.init_from: {tmp_path}" in err
    assert f"model.safetensors.index.json names {files[-1]}, which is missing" in err
    assert "copy the complete model directory" in err


def test_a_tensor_whose_shape_does_not_match_the_config(llama_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    (tmp_path / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes())
    config = json.loads((llama_dir / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    err = _train_error(capsys, f"model.init_from={tmp_path}")
    assert f"model.init_from: {tmp_path}: tensor model.layers.0.mlp." in err
    assert "in model.safetensors has shape [80, 48], the model built from config.json expects [96, 48]" in err
    assert "the weights do not belong to this config.json" in err


def test_checkpoints_written_before_model_families_still_match():
    """A Llama preset is described exactly as before the new fields existed; a new field is recorded once set."""
    from workers.spec import PRESETS, ModelSpec

    before = {
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "vocab_size",
        "ffn_dim",
        "norm_eps",
        "rope_theta",
        "max_seq_len",
    }
    assert set(PRESETS["debug"].to_dict()) == before
    qwen = dataclasses.replace(PRESETS["debug"], qkv_bias=True)
    assert qwen.to_dict()["qkv_bias"] is True
    assert ModelSpec.from_dict(qwen.to_dict()) == qwen
    assert ModelSpec.from_dict(PRESETS["debug"].to_dict()) == PRESETS["debug"]


def test_a_moe_description_names_its_family_and_reads_back_as_its_args():
    """A checkpoint of the moe family records ``family`` and its set expert fields, and loads as MoeArgs."""
    from workers.spec import PRESETS, ModelSpec, MoeArgs

    described = PRESETS["debug-moe"].to_dict()
    assert described["family"] == "moe" and described["n_experts"] == 8
    assert "router_score" not in described and "normalize_top_k" not in described  # still their defaults
    loaded = ModelSpec.from_dict(described)
    assert isinstance(loaded, MoeArgs) and loaded == PRESETS["debug-moe"]
