"""A LoRA run's checkpoint exports as a PEFT adapter and as a merged model, both giving meshpilot's
logits in the clients users load them with.

    python -m pytest tests/unit/test_lora_export.py -q

Single process, world size 1, real gloo. A random Llama-3-style model saved by ``transformers`` is
the base (``model.init_from``); a Trainer with adapters on all seven linear layers of each block
gets nonzero adapters and saves a checkpoint as a rank does (its extra names the settings and the
base's fingerprint). ``meshpilot ckpt export --format peft`` must load with
``peft.PeftModel.from_pretrained`` onto the released base with no missing or unexpected key;
``--format hf`` (the default) must load with ``transformers`` alone. Float32 logits within 1e-5 of
the Trainer's. The mistakes a user can make get one line each.
"""

from __future__ import annotations

import dataclasses
import json

import peft
import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open

from checkpointing.manifest import build_manifest
from checkpointing.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from checkpointing.spec import manifest_key
from checkpointing.storage import open_storage
from checkpointing.writer import CheckpointWriter
from orchestrator.cli import main
from orchestrator.model_source import released_weights_sha256
from tests.hf_models import reference_logits, save_random_model
from tests.unit.lora_trainers import ONE_RANK, give_adapters_values, lora_trainer_on
from workers.checkpoints import lora_extra, owns_plain_tensors
from workers.runtime import init_generation
from workers.spec.lora import LORA_TARGETS, LoraBase, LoraSpec

LORA = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=LORA_TARGETS)


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    """(base dir, checkpoint dir, the Trainer's float32 logits for TOKENS, TOKENS) of a LoRA run."""
    root = tmp_path_factory.mktemp("lora-export")
    base_dir, ckpt_dir = root / "base", root / "ckpt"
    save_random_model("llama3", base_dir)
    if dist.is_initialized():
        dist.destroy_process_group()
    init_generation(store=dist.HashStore(), generation=0, rank=0, world_size=1, backend="gloo", timeout_s=30)
    try:
        base = LoraBase(source=str(base_dir), sha256=released_weights_sha256(open_storage(str(base_dir))))
        trainer = lora_trainer_on(base_dir, LORA, lora_base=base)
        model, spec = trainer.spec.model, trainer.spec
        give_adapters_values(trainer)
        trainer.ensure_optimizer_state()
        reports: list = []
        writer = CheckpointWriter(open_storage(str(ckpt_dir)), rank=0, report=reports.append, mesh=trainer.world_mesh)
        writer.save_sync(
            3,
            trainer.checkpoint_state(),
            extra={"step": 3, **lora_extra(spec)},
            owns_plain_tensors=owns_plain_tensors(trainer),
        )
        writer.close(wait=True)
        manifest = build_manifest(
            reports, step=3, world_size=1, mesh=ONE_RANK.as_dict(), model=model.to_dict(), config_hash=None
        )
        assert open_storage(str(ckpt_dir)).put_if_absent(manifest_key(3), manifest.to_json())  # the commit
        tokens = torch.randint(0, model.vocab_size, (2, spec.seq_len), generator=torch.Generator().manual_seed(1))
        logits = trainer.logits(tokens)
        assert logits is not None
        yield base_dir, ckpt_dir, logits, tokens
    finally:
        dist.destroy_process_group()


def test_peft_adapter_loads_with_no_missing_or_unexpected_key_and_gives_our_logits(lora_checkpoint, tmp_path):
    base_dir, ckpt_dir, ours, tokens = lora_checkpoint
    out = tmp_path / "adapter"
    assert main(["ckpt", "export", str(ckpt_dir), "--out", str(out), "--format", "peft"]) == 0
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, sorted(LORA_TARGETS))
    assert config["base_model_name_or_path"] == str(base_dir)
    with safe_open(str(out / ADAPTER_WEIGHTS), "pt") as stored:
        names = set(stored.keys())
    # Two matrices for each of the 7 layers of every block, under PEFT's names; no optimizer state.
    layers = json.loads((base_dir / "config.json").read_text())["num_hidden_layers"]
    assert len(names) == layers * 7 * 2
    assert f"base_model.model.model.layers.{layers - 1}.mlp.down_proj.lora_B.weight" in names

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, out)
    # What PEFT would save of the loaded model is exactly what was written: no key missing or unexpected.
    assert set(peft.get_peft_model_state_dict(loaded)) == names
    torch.testing.assert_close(reference_logits(loaded, tokens), ours, rtol=1e-5, atol=1e-5)


def test_merged_export_loads_in_transformers_and_gives_our_logits(lora_checkpoint, tmp_path):
    base_dir, ckpt_dir, ours, tokens = lora_checkpoint
    out = tmp_path / "merged"
    assert main(["ckpt", "export", str(ckpt_dir), "--out", str(out)]) == 0
    # The base's own config (token ids, settings) and generation config travel with the merged weights.
    assert json.loads((out / "config.json").read_text()) == json.loads((base_dir / "config.json").read_text())
    assert (out / "generation_config.json").read_bytes() == (base_dir / "generation_config.json").read_bytes()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(reference_logits(merged, tokens), ours, rtol=1e-5, atol=1e-5)


def test_export_mistakes_get_one_line(lora_checkpoint, tmp_path, capsys):
    base_dir, ckpt_dir, _, _ = lora_checkpoint
    assert (
        main(["ckpt", "export", str(ckpt_dir), "--out", str(tmp_path / "x"), "--format", "peft", "--dtype", "bfloat16"])
        == 2
    )
    assert "--dtype applies to --format hf" in capsys.readouterr().err
    # A checkpoint of every weight has no adapters to export.
    full = tmp_path / "full"
    assert main(["ckpt", "import", str(base_dir), str(full)]) == 0
    capsys.readouterr()
    assert main(["ckpt", "export", str(full), "--out", str(tmp_path / "y"), "--format", "peft"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"meshpilot: {full} step 0 holds no LoRA adapters (it was trained without model.lora: every weight "
        "trained); export it with --format hf"
    )


def test_merged_export_refuses_a_changed_or_random_base(lora_checkpoint, tmp_path, capsys):
    base_dir, ckpt_dir, _, _ = lora_checkpoint
    changed = tmp_path / "changed"
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    model.save_pretrained(changed)
    moved = _checkpoint_naming_base(ckpt_dir, tmp_path / "moved", LoraBase(str(changed), "stale"))
    assert main(["ckpt", "export", str(moved), "--out", str(tmp_path / "m")]) == 2
    assert "is not the one" in capsys.readouterr().err
    seeded = _checkpoint_naming_base(ckpt_dir, tmp_path / "seeded", LoraBase("random-init:seed=0", "0" * 64))
    assert main(["ckpt", "export", str(seeded), "--out", str(tmp_path / "s")]) == 2
    assert "trained beside a seeded random base" in capsys.readouterr().err
    assert main(["ckpt", "export", str(seeded), "--out", str(tmp_path / "p"), "--format", "peft"]) == 0
    assert json.loads((tmp_path / "p" / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] is None


def _checkpoint_naming_base(ckpt_dir, copy_dir, base: LoraBase):
    """A copy of the checkpoint whose manifest names another base (shards copied as they are)."""
    from checkpointing.catalog import load_manifest

    source, dest = open_storage(str(ckpt_dir)), open_storage(str(copy_dir))
    manifest = load_manifest(source)
    for entry in manifest.files:
        data = source.get(entry.key)
        dest.put_stream(entry.key, [data], size=len(data))
    extra = {**manifest.extra, "lora_base": base.to_dict()}
    renamed = dataclasses.replace(manifest, extra=extra)
    dest.put_if_absent(manifest_key(manifest.step), renamed.to_json())
    return copy_dir
