"""Hugging Face directories load through the resharding reader: only headers when opened, only
the needed rows when loaded, cast to the parameters' dtype, and every bad directory named.

    .venv/bin/python -m pytest tests/unit/test_hf_format.py -q

Files are written with ``safetensors.torch.save_file``; one case reads from the real S3 server.
Two ranks on real gloo loading their slices: tests/ranks/test_hf_sharded_load.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from checkpointing.errors import HfCheckpointError
from checkpointing.hf_format import load_hf_tensors, open_hf_checkpoint
from checkpointing.local import LocalStorage
from checkpointing.storage import StorageBackend, open_storage
from tests.ranks.hf_ranks import COLUMN_SHARDED, ROW_SHARDED, sharded

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}


def source_tensors() -> dict[str, torch.Tensor]:
    """HF name -> tensor, as a released model stores them (bfloat16 weights, a float32 norm)."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for hf, shape in [*ROW_SHARDED.values(), *COLUMN_SHARDED.values()]:
        dtype = torch.float32 if hf.endswith("norm.weight") else torch.bfloat16
        tensors[hf] = torch.randn(shape, generator=generator).to(dtype)
    return tensors


def write_single(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


def write_sharded(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Two files and model.safetensors.index.json, the layout of every large released model."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for number, part in enumerate((names[::2], names[1::2]), start=1):
        file = f"model-{number:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


class CountingStorage:
    """Any backend, counting the bytes of every GET and refusing whole-object reads of weights."""

    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.bytes_read = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get(self, key: str) -> bytes:
        assert not key.endswith(".safetensors"), f"{key} was downloaded whole"
        return self.inner.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        self.bytes_read += end - start
        return self.inner.get_range(key, start, end)


@pytest.mark.parametrize("write", [write_single, write_sharded])
def test_whole_tensors_load_bitwise_cast_to_the_parameter_dtype(tmp_path, write):
    source = source_tensors()
    folder = write(tmp_path / "hf", source)
    storage = CountingStorage(LocalStorage(folder, fsync=False))
    checkpoint = open_hf_checkpoint(storage)
    assert checkpoint.config == CONFIG
    assert storage.bytes_read < 2048  # headers only
    names = {fqn: hf for fqn, (hf, _) in {**ROW_SHARDED, **COLUMN_SHARDED}.items()}
    as_float32 = {fqn: torch.empty(source[hf].shape) for fqn, hf in names.items()}
    as_stored = {fqn: torch.empty(source[hf].shape, dtype=source[hf].dtype) for fqn, hf in names.items()}
    read = load_hf_tensors(storage, checkpoint, as_float32, names)
    load_hf_tensors(storage, checkpoint, as_stored, names)
    assert read == checkpoint.total_bytes
    for fqn, hf in names.items():
        assert torch.equal(as_float32[fqn], source[hf].float())
        assert as_stored[fqn].dtype == source[hf].dtype and torch.equal(as_stored[fqn], source[hf])


def test_two_parameters_may_read_one_tensor(tmp_path):
    source = source_tensors()
    folder = write_single(tmp_path / "hf", source)
    storage = LocalStorage(folder, fsync=False)
    embedding = "model.embed_tokens.weight"
    tied = {"embed.weight": torch.empty(4096, 512), "output.weight": torch.empty(4096, 512)}
    load_hf_tensors(storage, open_hf_checkpoint(storage), tied, {"embed.weight": embedding, "output.weight": embedding})
    assert torch.equal(tied["embed.weight"], source[embedding].float())
    assert torch.equal(tied["output.weight"], source[embedding].float())


def test_a_rank_reads_its_rows_from_s3_by_ranged_gets(s3_bucket, tmp_path):
    source = source_tensors()
    folder = write_sharded(tmp_path / "hf", source)
    storage = CountingStorage(open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url))
    for path in folder.iterdir():
        storage.put_bytes(path.name, path.read_bytes())
    whole = sum(path.stat().st_size for path in folder.iterdir())
    embedding, shape = ROW_SHARDED["embed.weight"]
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())  # this process is rank 1 of 2
    try:
        mesh = init_device_mesh("cpu", (2,))
        destination = sharded(mesh, shape, Shard(0))
        checkpoint = open_hf_checkpoint(storage)
        read = load_hf_tensors(storage, checkpoint, {"embed.weight": destination}, {"embed.weight": embedding})
    finally:
        dist.destroy_process_group()
        storage.close()
    assert torch.equal(destination.to_local(), source[embedding].float()[shape[0] // 2 :])
    assert read == source[embedding].numel() * 2 // 2  # bfloat16, half the rows
    assert storage.bytes_read < 0.6 * whole


# ----------------------------------------------------------------------------- bad input
def write_raw(path: Path, header: bytes, data: bytes = b"") -> None:
    """A safetensors file with any header bytes, as a broken or foreign writer leaves one."""
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def open_error(folder: Path) -> str:
    with pytest.raises(HfCheckpointError) as raised:
        open_hf_checkpoint(LocalStorage(folder, fsync=False))
    return str(raised.value)


def test_a_directory_without_config_json_is_named(tmp_path):
    folder = write_single(tmp_path / "hf", source_tensors())
    (folder / "config.json").unlink()
    assert open_error(folder) == (
        f"{folder} has no config.json: point at a Hugging Face model directory "
        "(the one holding config.json and model*.safetensors)"
    )


def test_a_directory_without_safetensors_weights_is_named(tmp_path):
    folder = write_single(tmp_path / "hf", source_tensors())
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    assert open_error(folder) == (
        f"{folder} has neither model.safetensors nor model.safetensors.index.json: copy the complete model "
        "directory with its safetensors weights (pytorch_model.bin and other pickled formats are not read)"
    )


def test_a_missing_weight_file_is_named(tmp_path):
    folder = write_sharded(tmp_path / "hf", source_tensors())
    (folder / "model-00002-of-00002.safetensors").unlink()
    assert open_error(folder) == (
        f"{folder}/model.safetensors.index.json names model-00002-of-00002.safetensors, which is missing "
        f"from {folder}: copy the complete model directory"
    )


def test_an_index_entry_absent_from_its_file_is_named(tmp_path):
    folder = write_sharded(tmp_path / "hf", source_tensors())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert open_error(folder) == (
        f"{folder}/model.safetensors.index.json puts tensor lm_head.weight in model-00001-of-00002.safetensors, "
        "whose header has no such tensor: the index and the weight files come from different downloads; "
        "copy the complete model directory again"
    )


def test_an_unsupported_dtype_is_named(tmp_path):
    folder = write_single(tmp_path / "hf", source_tensors())
    header = json.dumps({"scales": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [0, 4]}}).encode()
    write_raw(folder / "model.safetensors", header, b"\0" * 4)
    message = open_error(folder)
    assert message.startswith(
        f"{folder}/model.safetensors: tensor scales has safetensors dtype 'F8_E8M0', which meshpilot cannot load "
        "(it reads F64, F32, F16, BF16,"
    )
    assert message.endswith("): convert the weights to BF16 or F32 first")


@pytest.mark.parametrize(
    "header, data, reason",
    [
        (b"{not json", b"", "the header is not valid JSON (JSONDecodeError)"),
        (b"[]", b"", "the header is not a JSON object"),
        (
            json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode(),
            b"\0" * 8,
            "tensor w: data_offsets [0, 16] do not fit shape [4] of float32 in 78 bytes",
        ),
        (
            json.dumps({"w": {"dtype": "F32", "shape": [4]}}).encode(),
            b"",
            "tensor w lacks dtype, shape or data_offsets",
        ),
    ],
)
def test_a_malformed_header_is_named(tmp_path, header, data, reason):
    folder = write_single(tmp_path / "hf", {})
    write_raw(folder / "model.safetensors", header, data)
    assert open_error(folder) == (
        f"{folder}/model.safetensors has a malformed safetensors header ({reason}): "
        "the file is truncated or not safetensors; download it again"
    )


def test_a_header_longer_than_its_file_is_named(tmp_path):
    folder = write_single(tmp_path / "hf", {})
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    assert open_error(folder) == (
        f"{folder}/model.safetensors has a malformed safetensors header (it claims a 1099511627776-byte header "
        "in a 10-byte file): the file is truncated or not safetensors; download it again"
    )


def test_a_tensor_the_model_needs_but_the_weights_lack_is_named(tmp_path):
    folder = write_sharded(tmp_path / "hf", source_tensors())
    storage = LocalStorage(folder, fsync=False)
    with pytest.raises(HfCheckpointError) as raised:
        load_hf_tensors(
            storage, open_hf_checkpoint(storage), {"lm_head.weight": torch.empty(4, 4)}, {"lm_head.weight": "lm_head"}
        )
    assert str(raised.value) == (
        f"{folder} holds no tensor lm_head (for parameter lm_head.weight; it has 3 tensors): the weights do not "
        "belong to this config.json's architecture; copy the complete model directory of that model"
    )


def test_a_shape_that_does_not_fit_the_config_is_named(tmp_path):
    folder = write_sharded(tmp_path / "hf", source_tensors())
    storage = LocalStorage(folder, fsync=False)
    name = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(HfCheckpointError) as raised:
        load_hf_tensors(storage, open_hf_checkpoint(storage), {"wo.weight": torch.empty(128, 64)}, {"wo.weight": name})
    file = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
    assert str(raised.value) == (
        f"{folder}: tensor {name} in {file} has shape [96, 64], the model built from config.json expects "
        "[128, 64]: the weights do not belong to this config.json"
    )
