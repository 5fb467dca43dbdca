"""A meshpilot model saved to real S3, listed, inspected, verified, corrupted, restored and exported.

One process (world size 1, plain tensors); the multi-rank layouts are in test_ckpt_reshard.py.
"""

from __future__ import annotations

import json
from typing import cast

import pytest
import torch

from checkpointing.catalog import choose_restore
from checkpointing.commit import CommitCoordinator
from checkpointing.errors import CorruptCheckpointError
from checkpointing.reader import latest_committed, load_manifest, restore
from checkpointing.spec import FailureReport, ShardReport
from checkpointing.storage import open_storage
from checkpointing.writer import CheckpointWriter
from orchestrator.cli import main
from workers.models import Transformer
from workers.spec import PRESETS, LlamaArgs

SPEC = cast(LlamaArgs, PRESETS["debug"])
MODEL = SPEC.to_dict()


def trained_state(seed: int) -> tuple[Transformer, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = Transformer(SPEC)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, SPEC.vocab_size, (2, 16))
    model(tokens).float().logsumexp(-1).mean().backward()
    optimizer.step()
    state: dict[str, torch.Tensor] = dict(model.named_parameters())
    names: dict[torch.Tensor, str] = {param: name for name, param in model.named_parameters()}  # optimizer.state's keys
    for param, values in optimizer.state.items():
        for key, value in values.items():
            state[f"optim.{names[param]}.{key}"] = value
    return model, state


def save_steps(storage, steps_and_states) -> CommitCoordinator:
    coordinator = CommitCoordinator(
        storage, world_size=1, mesh={"dp_shard": 1}, config_hash="c0ffee", model=MODEL, keep_last=5
    )

    def commit(report: ShardReport | FailureReport) -> None:
        coordinator.on_report(report)  # the writer wants no answer; commits show in the coordinator

    writer = CheckpointWriter(storage, rank=0, report=commit)
    for step, state in steps_and_states:
        writer.save(
            step, {k: v.detach() for k, v in state.items()}, extra={"data_cursor": step * 32}, owns_plain_tensors=True
        )
    writer.close()
    return coordinator


@pytest.fixture
def two_checkpoints(s3_bucket):
    storage = open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url)
    first_model, first = trained_state(0)
    second_model, second = trained_state(1)
    snapshots = {
        10: {k: v.detach().clone() for k, v in first.items()},
        20: {k: v.detach().clone() for k, v in second.items()},
    }
    coordinator = save_steps(storage, [(10, first), (20, second)])
    assert coordinator.committed_steps == [10, 20]
    yield s3_bucket, storage, snapshots, second_model
    storage.close()


def cli(*args: str) -> list[str]:
    return ["ckpt", *args]


def test_ls_inspect_verify(two_checkpoints, capsys):
    bucket, storage, _, _ = two_checkpoints
    assert main(cli("ls", bucket.uri, "--endpoint-url", bucket.endpoint_url)) == 0
    listing = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listing[1:]] == ["10", "20"]
    assert main(cli("inspect", bucket.uri, "--endpoint-url", bucket.endpoint_url, "--step", "10")) == 0
    text = capsys.readouterr().out
    assert "step 10" in text and '"data_cursor": 320' in text and "layers.3.mlp.down_proj.weight" in text
    assert main(cli("verify", bucket.uri, "--endpoint-url", bucket.endpoint_url, "--all")) == 0
    assert capsys.readouterr().out.count("OK ") == 2


def test_round_trip_is_bitwise_equal(two_checkpoints):
    _, storage, snapshots, _ = two_checkpoints
    manifest = load_manifest(storage)
    assert manifest.step == 20 and manifest.extra == {"data_cursor": 640}
    _, fresh = trained_state(7)
    restore(storage, manifest, fresh, model=MODEL, config_hash="c0ffee")
    for name, value in snapshots[20].items():
        assert torch.equal(fresh[name].detach(), value), name


def flip_byte(bucket, storage, key: str, offset: int) -> None:
    client = bucket.server.client()
    full_key = storage._full(key)
    data = bytearray(client.get_object(Bucket=bucket.name, Key=full_key)["Body"].read())
    data[offset] ^= 0xFF
    client.put_object(Bucket=bucket.name, Key=full_key, Body=bytes(data))


def test_flipped_byte_is_named_and_resume_falls_back(two_checkpoints, capsys):
    bucket, storage, snapshots, _ = two_checkpoints
    manifest = load_manifest(storage, 20)
    shard = manifest.files[0].key
    chunk = manifest.tensors["layers.1.self_attn.k_proj.weight"].chunks[0]
    flip_byte(bucket, storage, shard, chunk.start + 5)

    assert main(cli("verify", bucket.uri, "--endpoint-url", bucket.endpoint_url)) == 2
    captured = capsys.readouterr()
    assert f"shard {bucket.uri}/{shard}" in captured.out
    assert "layers.1.self_attn.k_proj.weight" in captured.out
    assert shard in captured.err and "Traceback" not in captured.err

    _, fresh = trained_state(7)
    with pytest.raises(CorruptCheckpointError, match=shard) as raised:
        restore(storage, manifest, fresh)
    assert raised.value.key == shard
    # The driver then skips the bad step and resumes from the previous commit, with a warning.
    warnings = []
    fallback = choose_restore(storage, model=MODEL, skip_steps={20}, warn=warnings.append)
    assert fallback.step == 10
    restore(storage, fallback, fresh)
    assert all(torch.equal(fresh[name].detach(), value) for name, value in snapshots[10].items())
    assert latest_committed(storage) == 20  # nothing deleted: the user decides what to do with step 20


def test_corrupt_manifest_falls_back_with_warning(two_checkpoints):
    bucket, storage, _, _ = two_checkpoints
    flip_byte(bucket, storage, "step-00000020/manifest.json", 40)
    warnings = []
    chosen = choose_restore(storage, model=MODEL, warn=warnings.append)
    assert chosen.step == 10
    assert len(warnings) == 1 and "step 20" in warnings[0] and "manifest.json" in warnings[0]


def test_export_loads_in_transformers_with_same_logits(two_checkpoints, tmp_path, capsys):
    from transformers import LlamaForCausalLM

    bucket, _, _, model = two_checkpoints
    out = tmp_path / "hf"
    assert (
        main(
            cli(
                "export",
                bucket.uri,
                "--endpoint-url",
                bucket.endpoint_url,
                "--out",
                str(out),
                "--max-shard-size-mb",
                "0.25",
            )
        )
        == 0
    )
    capsys.readouterr()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["weight_map"]["lm_head.weight"] and index["weight_map"]["model.embed_tokens.weight"]
    hf = LlamaForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokens = torch.randint(0, SPEC.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
