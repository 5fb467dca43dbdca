"""``meshpilot ckpt import`` and ``export`` with model families: a model saved by ``transformers``
comes back out of a meshpilot checkpoint with the same bytes and the same logits.

    .venv/bin/python -m pytest tests/integration/test_ckpt_hf.py -q
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from checkpointing.catalog import load_manifest
from checkpointing.local import LocalStorage
from checkpointing.storage import open_storage
from orchestrator.cli import main

TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


def save_released_model(folder: Path, *, tied: bool) -> dict[str, torch.Tensor]:
    """A tiny ``LlamaForCausalLM`` saved as a release is (bfloat16 safetensors, several files); returns its tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, tie_word_embeddings=tied)).bfloat16()
    model.save_pretrained(folder, max_shard_size="100KB")
    tensors: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["ckpt", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def exported_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_import_then_export_gives_back_the_released_bytes_and_logits(tmp_path, capsys):
    from transformers import LlamaForCausalLM

    released = save_released_model(tmp_path / "hf", tied=False)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    code, text = run_cli(capsys, "import", str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert code == 0, text
    assert "(llama family, " in text and "as step 0 of" in text
    manifest = load_manifest(LocalStorage(tmp_path / "ckpt", fsync=False))
    # The default family is recorded by its absence, as in checkpoints written before families existed.
    assert manifest.weights_only and "family" not in manifest.model and manifest.model["dim"] == 64
    code, text = run_cli(capsys, "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"))
    assert code == 0, text
    exported = exported_tensors(tmp_path / "out")
    assert exported.keys() == released.keys()
    assert all(
        exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], released[name]) for name in released
    )
    tokens = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        original = LlamaForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()(tokens).logits
        round_trip = LlamaForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()(tokens).logits
    assert torch.equal(round_trip, original)


def test_a_tied_release_imports_its_embedding_as_the_output_projection(tmp_path, capsys):
    released = save_released_model(tmp_path / "hf", tied=True)
    assert "lm_head.weight" not in released  # stored once, as the embedding
    assert run_cli(capsys, "import", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--dtype", "float32")[0] == 0
    assert run_cli(capsys, "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"))[0] == 0
    exported = exported_tensors(tmp_path / "out")
    embedding = released["model.embed_tokens.weight"].float()
    assert exported["lm_head.weight"].dtype == torch.float32 and torch.equal(exported["lm_head.weight"], embedding)
    assert torch.equal(exported["model.embed_tokens.weight"], embedding)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False


def test_import_from_s3_to_s3(s3_bucket, tmp_path, capsys):
    released = save_released_model(tmp_path / "hf", tied=False)
    source = open_storage(f"s3://{s3_bucket.name}/models/tiny", endpoint_url=s3_bucket.endpoint_url)
    for path in (tmp_path / "hf").iterdir():
        source.put_bytes(path.name, path.read_bytes())
    flags = ("--endpoint-url", s3_bucket.endpoint_url)
    code, text = run_cli(capsys, "import", f"s3://{s3_bucket.name}/models/tiny", s3_bucket.uri, *flags)
    assert code == 0, text
    assert run_cli(capsys, "verify", s3_bucket.uri, *flags)[0] == 0
    assert run_cli(capsys, "export", s3_bucket.uri, *flags, "--out", str(tmp_path / "out"))[0] == 0
    exported = exported_tensors(tmp_path / "out")
    assert all(torch.equal(exported[name], released[name]) for name in released)


@pytest.mark.parametrize(
    "change, flags, message",
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            (),
            "config.json: no model family loads architecture GPT2LMHeadModel (registered: llama, moe); name one with "
            "--family NAME or --family package.module:Class",
        ),
        ({}, ("--family", "nosuch"), "model.family 'nosuch' is not a registered family (llama, moe)"),
        (
            {"hidden_size": 32, "head_dim": 16},
            (),
            "tensor model.embed_tokens.weight in {embedding_file} has shape [128, 64], the model "
            "built from config.json expects [128, 32]: the weights do not belong to this config.json",
        ),
    ],
)
def test_an_import_that_does_not_fit_is_refused_before_writing(tmp_path, capsys, change, flags, message):
    save_released_model(tmp_path / "hf", tied=False)
    config_path = tmp_path / "hf" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **change}))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    message = message.format(embedding_file=index["weight_map"]["model.embed_tokens.weight"])
    code, text = run_cli(capsys, "import", str(tmp_path / "hf"), str(tmp_path / "ckpt"), *flags)
    assert code == 2 and message in text and "Traceback" not in text
    assert not (tmp_path / "ckpt").exists() or LocalStorage(tmp_path / "ckpt").list() == []


def test_an_import_into_a_used_uri_is_refused(tmp_path, capsys):
    save_released_model(tmp_path / "hf", tied=False)
    assert run_cli(capsys, "import", str(tmp_path / "hf"), str(tmp_path / "ckpt"))[0] == 0
    code, text = run_cli(capsys, "import", str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert code == 2 and "already holds committed checkpoints (steps 0)" in text and "a fresh URI" in text
