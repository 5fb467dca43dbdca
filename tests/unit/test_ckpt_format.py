"""Manifest and shard-header parsing: known versions load, anything malformed is one clear error."""

from __future__ import annotations

import copy
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from checkpointing.errors import CheckpointError, CorruptCheckpointError, ManifestVersionError
from checkpointing.manifest import _digest, parse_manifest
from checkpointing.shardfile import build_header, parse_header

# A version-1 manifest exactly as meshpilot 0.1 wrote it. It must keep loading in every later release.
MANIFEST_V1 = (
    '{"checksum":"sha256:9984774148f4f357654f1ce25df0ecd1fdc2e96971e2efb1da415d1e8a0cf8c5","committed_at":1795000000.5,'
    '"config_hash":"feedc0de","extra":{"data_cursor":96},"files":[{"bytes":200,"header_bytes":152,"header_checksum":'
    '"sha256:1111111111111111111111111111111111111111111111111111111111111111","key":'
    '"step-00000030/rank-00000-0a1b2c3d.safetensors","rank":0}],"format":"meshpilot-checkpoint","mesh":'
    '{"dp_replicate":1,"dp_shard":2,"pp":1,"tp":1},"model":{"dim":4},"step":30,"tensors":{"w":{"chunks":'
    '[{"block_rows":4,"checksums":["sha256:2222222222222222222222222222222222222222222222222222222222222222"],'
    '"end":200,"file":0,"offsets":[0,0],"sizes":[3,4],"start":152}],"dtype":"float32","shape":[3,4]}},'
    '"timings":{"stall_s":0.0,"upload_s":0.0},"version":1,"world_size":2}'
)
KEY = "s3://bucket/run/step-00000030/manifest.json"
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def signed(body: dict) -> bytes:
    body = {k: v for k, v in body.items() if k != "checksum"}
    try:
        body["checksum"] = _digest(body)
    except ValueError:  # NaN: no valid checksum exists; the parser must still answer clearly
        body["checksum"] = "sha256:" + "0" * 64
    return json.dumps(body).encode()


def test_version_1_manifest_keeps_loading():
    manifest = parse_manifest(MANIFEST_V1.encode(), key=KEY)
    assert (manifest.version, manifest.step, manifest.world_size, manifest.config_hash) == (1, 30, 2, "feedc0de")
    assert manifest.extra == {"data_cursor": 96}
    assert manifest.mesh["dp_shard"] == 2
    chunk = manifest.tensors["w"].chunks[0]
    assert (chunk.key, chunk.start, chunk.end, chunk.sizes) == (
        "step-00000030/rank-00000-0a1b2c3d.safetensors",
        152,
        200,
        (3, 4),
    )
    assert manifest.to_json() and parse_manifest(manifest.to_json(), key=KEY) == manifest


def test_newer_version_asks_to_upgrade():
    body = json.loads(MANIFEST_V1)
    body["version"] = 2
    with pytest.raises(
        ManifestVersionError, match="manifest version 2; this meshpilot reads versions up to 1: upgrade"
    ):
        parse_manifest(signed(body), key=KEY)


def test_foreign_json_is_not_a_manifest():
    with pytest.raises(ManifestVersionError, match="is not a meshpilot checkpoint manifest"):
        parse_manifest(b'{"metadata": {}, "weight_map": {}}', key=KEY)


def test_edited_manifest_fails_its_checksum():
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint manifest {KEY} is corrupt: its checksum"):
        parse_manifest(MANIFEST_V1.replace('"data_cursor":96', '"data_cursor":97').encode(), key=KEY)


def test_incomplete_tiling_is_refused():
    body = json.loads(MANIFEST_V1)
    body["tensors"]["w"]["shape"] = [6, 4]
    with pytest.raises(CorruptCheckpointError, match="tensor 'w' is incomplete: its chunks hold 12 of 24 elements"):
        parse_manifest(signed(body), key=KEY)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_random_bytes_never_crash_the_manifest_parser(data):
    with pytest.raises(CheckpointError):
        parse_manifest(data, key=KEY)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, prefix + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, prefix + (index,))


PATHS = [p for p in _paths(json.loads(MANIFEST_V1)) if p and p != ("checksum",)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATHS), JSON_VALUES)
def test_any_field_replaced_by_any_json_gives_a_clear_answer(path, value):
    """Re-signed after the edit, so the structural checks themselves are exercised."""
    body = copy.deepcopy(json.loads(MANIFEST_V1))
    node = body
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    try:
        parse_manifest(signed(body), key=KEY)
    except CheckpointError as error:
        assert KEY in str(error) or "manifest" in str(error)


# ------------------------------------------------------------------------ shard headers
def test_header_is_readable_by_the_safetensors_library(tmp_path):
    tensors = {"a@0,4": torch.randn(2, 3), "b": torch.arange(5, dtype=torch.int64), "c": torch.tensor(1.5)}
    ordered = sorted(tensors, key=lambda n: -tensors[n].element_size())
    header, entries = build_header(
        [(n, str(tensors[n].dtype)[6:], tuple(tensors[n].shape)) for n in ordered], {"rank": "3"}
    )
    assert len(header) % 8 == 0
    data = bytearray(header)
    for name, entry in zip(ordered, entries):
        assert entry.begin == len(data)
        data += tensors[name].numpy().tobytes()
    path = tmp_path / "shard.safetensors"
    path.write_bytes(bytes(data))
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata() == {"rank": "3"}
        for name, value in tensors.items():
            assert torch.equal(handle.get_tensor(name), value)
    parsed, metadata = parse_header(bytes(data), key="k", object_bytes=len(data))
    assert [(e.name, e.begin, e.end) for e in parsed] == [(e.name, e.begin, e.end) for e in entries]


def test_absurd_header_length_is_refused_without_reading_it():
    with pytest.raises(
        CorruptCheckpointError,
        match="shard 'step-1/r.safetensors' has a corrupt safetensors header: "
        "it claims 18446744073709551615 header bytes",
    ):
        parse_header(struct.pack("<Q", 2**64 - 1) + b"{}", key="step-1/r.safetensors", object_bytes=10)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_shard_headers_never_crash(data):
    try:
        parse_header(data, key="shard", object_bytes=len(data) + 64)
    except CorruptCheckpointError as error:
        assert error.key == "shard" and "shard 'shard'" in str(error)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_any_json_header_gives_a_clear_answer(value):
    text = json.dumps(value).encode()
    data = struct.pack("<Q", len(text)) + text
    try:
        parse_header(data, key="shard", object_bytes=len(data))
    except CorruptCheckpointError as error:
        assert "corrupt safetensors header" in str(error)


def test_a_chunk_outside_its_tensor_is_refused():
    body = json.loads(MANIFEST_V1)
    body["tensors"]["w"]["chunks"][0]["offsets"] = [1, 0]
    outside = r"chunks\[0\] \(offsets \(1, 0\), sizes \(3, 4\)\) lies outside shape \(3, 4\)"
    with pytest.raises(CorruptCheckpointError, match=outside):
        parse_manifest(signed(body), key=KEY)


def test_a_manifest_with_a_nan_fails_its_checksum_clearly():
    body = json.loads(MANIFEST_V1)
    body["extra"]["data_cursor"] = float("nan")
    with pytest.raises(CorruptCheckpointError, match="its checksum does not match its content"):
        parse_manifest(signed(body), key=KEY)
