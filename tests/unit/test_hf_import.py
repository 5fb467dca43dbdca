"""A Hugging Face directory imported as a meshpilot checkpoint reads like any committed step: it
restores, verifies, lists, and exports back to the same bytes; a job resuming from it keeps a
fresh optimizer.

    .venv/bin/python -m pytest tests/unit/test_hf_import.py -q
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from checkpointing.catalog import list_committed, load_manifest
from checkpointing.errors import CheckpointError, HfCheckpointError
from checkpointing.export import export_hf
from checkpointing.hf_import import import_hf
from checkpointing.local import LocalStorage
from checkpointing.reader import restore
from orchestrator.cli import main
from tests.unit.test_hf_format import write_sharded
from workers.checkpoints import RankCheckpoints
from workers.spec import PRESETS, CheckpointTarget, TrainSpec

MODEL = PRESETS["debug"].to_dict()
# our FQN -> HF name, and what a released model stores under it (mixed dtypes, as in the wild)
NAMES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "layers.0.feed_forward.w1.weight": "model.layers.0.mlp.gate_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
SHAPES = {"embed_tokens.weight": (96, 32), "layers.0.feed_forward.w1.weight": (80, 32), "norm.weight": (32,)}
SHAPES["lm_head.weight"] = (96, 32)
DTYPES = {"norm.weight": torch.float32, "layers.0.feed_forward.w1.weight": torch.float16}


def source_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        NAMES[fqn]: torch.randn(shape, generator=generator).to(DTYPES.get(fqn, torch.bfloat16))
        for fqn, shape in SHAPES.items()
    }


class BackToHf:
    """The naming that undoes ``NAMES``: what a model family gives export."""

    def hf_name(self, fqn: str) -> str | None:
        return NAMES.get(fqn)

    def hf_config(self, model: dict[str, Any], dtype: str) -> dict[str, Any]:
        return {"architectures": ["LlamaForCausalLM"], "torch_dtype": dtype}


@pytest.fixture
def imported(tmp_path) -> tuple[dict[str, torch.Tensor], LocalStorage]:
    source = source_tensors()
    folder = write_sharded(tmp_path / "hf", source)
    dest = LocalStorage(tmp_path / "ckpt", fsync=False)
    import_hf(LocalStorage(folder, fsync=False), dest, names=NAMES, model=MODEL)
    return source, dest


def test_import_then_export_gives_back_every_tensor_bitwise(imported, tmp_path):
    source, dest = imported
    out = export_hf(dest, tmp_path / "out", naming=BackToHf())
    exported: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("*.safetensors")):
        exported.update(load_file(file))
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == source.keys()


def test_restore_of_an_import_equals_the_source(imported):
    source, dest = imported
    tensors = {fqn: torch.empty(shape) for fqn, shape in SHAPES.items()}  # float32 parameters
    restore(dest, load_manifest(dest), tensors, model=MODEL)
    for fqn, tensor in tensors.items():
        assert torch.equal(tensor, source[NAMES[fqn]].float()), fqn


def test_an_import_is_a_committed_weights_only_step_0_that_verifies(imported, capsys):
    _, dest = imported
    manifest = load_manifest(dest)
    assert list_committed(dest) == [0] and manifest.weights_only
    assert sorted(manifest.tensors) == sorted(NAMES)  # our names, no optimizer state
    assert main(["ckpt", "verify", dest.uri]) == 0
    assert main(["ckpt", "ls", dest.uri]) == 0
    assert main(["ckpt", "inspect", dest.uri]) == 0
    printed = capsys.readouterr().out
    assert "OK       step 0: 4 files" in printed and '"weights_only": true' in printed


def test_dtype_casts_floating_point_weights(tmp_path):
    folder = write_sharded(tmp_path / "hf", source_tensors())
    dest = LocalStorage(tmp_path / "ckpt", fsync=False)
    manifest = import_hf(LocalStorage(folder, fsync=False), dest, names=NAMES, model=MODEL, dtype="bfloat16")
    assert {index.dtype for index in manifest.tensors.values()} == {"bfloat16"}


def test_an_import_into_a_uri_with_committed_steps_is_refused(imported, tmp_path):
    _, dest = imported
    before = dest.list()
    with pytest.raises(HfCheckpointError) as raised:
        import_hf(LocalStorage(tmp_path / "hf", fsync=False), dest, names=NAMES, model=MODEL)
    assert str(raised.value) == (
        f"{dest.uri} already holds committed checkpoints (steps 0): an import starts a new checkpoint history; "
        "import into a fresh URI"
    )
    assert dest.list() == before


def test_a_name_the_weights_lack_writes_nothing(tmp_path):
    folder = write_sharded(tmp_path / "hf", source_tensors())
    dest = LocalStorage(tmp_path / "ckpt", fsync=False)
    with pytest.raises(HfCheckpointError, match="holds no tensor model.layers.1.mlp.up_proj.weight"):
        import_hf(
            LocalStorage(folder, fsync=False),
            dest,
            names={**NAMES, "layers.1.feed_forward.w3.weight": "model.layers.1.mlp.up_proj.weight"},
            model=MODEL,
        )
    assert dest.list() == []


class FakeTrainer:
    """The part of ``workers.trainer.Trainer`` a restore uses: parameters, and AdamW state on demand."""

    device = torch.device("cpu")
    world_mesh = None
    coords = SimpleNamespace(dp_replicate=0, dp_shard=0, cp=0, tp=0)

    def __init__(self) -> None:
        self.parameters = {fqn: torch.zeros(shape) for fqn, shape in SHAPES.items()}
        self.optimizer_state: dict[str, torch.Tensor] = {}

    def ensure_optimizer_state(self) -> None:
        for fqn, value in self.parameters.items():
            self.optimizer_state[f"optim.{fqn}.exp_avg"] = torch.zeros_like(value)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return {**self.parameters, **self.optimizer_state}


def test_a_job_restoring_an_import_loads_the_weights_and_starts_its_optimizer_fresh(imported):
    source, dest = imported
    spec = TrainSpec(
        model=PRESETS["debug"],
        steps=1,
        global_batch=1,
        seq_len=8,
        microbatch_size=1,
        checkpoint=CheckpointTarget(uri=dest.uri),
    )
    trainer = FakeTrainer()
    checkpoints = RankCheckpoints(
        spec, trainer, rank=0, channel=SimpleNamespace(checkpoint_upload=lambda report, generation: None)
    )
    try:
        extra = checkpoints.restore(0)
    finally:
        checkpoints.close(wait=True)
    assert extra["weights_only"] is True
    assert trainer.optimizer_state == {}
    for fqn, value in trainer.parameters.items():
        assert torch.equal(value, source[NAMES[fqn]].float()), fqn


def test_a_naming_that_exports_a_tied_weight_twice_is_refused(imported, tmp_path):
    _, dest = imported

    class Tied(BackToHf):
        def hf_name(self, fqn: str) -> str | None:
            return "model.embed_tokens.weight" if fqn == "lm_head.weight" else NAMES.get(fqn)

    with pytest.raises(CheckpointError) as raised:
        export_hf(dest, tmp_path / "out", naming=Tied())
    assert str(raised.value) == (
        "the naming maps both embed_tokens.weight and lm_head.weight to model.embed_tokens.weight: a tied weight "
        "is stored once, so its naming must return None for all but one of them"
    )
    assert not (tmp_path / "out").exists()  # refused before anything is written
