"""Which checkpoints a LoRA job resumes from: its own adapters on the same base, nothing else.

    python -m pytest tests/unit/test_lora_checkpoints.py -q

The driver's choice (``choose_restore``, as ``DriverCheckpoints.choose_resume`` calls it) over a
directory holding one committed manifest; the ranks check the same again as they restore
(tests/ranks/test_lora_training.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from checkpointing.catalog import choose_restore
from checkpointing.errors import ForeignCheckpointError
from checkpointing.manifest import LORA, LORA_BASE, build_manifest
from checkpointing.spec import manifest_key
from checkpointing.storage import open_storage
from workers.spec.lora import LoraBase, LoraSpec

BASE = LoraBase(source="s3://models/llama-3.2-1b", sha256="a" * 64)


def _commit(directory, extra: dict) -> None:
    manifest = build_manifest([], step=7, world_size=1, mesh={}, model={}, config_hash=None)
    manifest = dataclasses.replace(manifest, extra=extra)
    assert open_storage(str(directory)).put_if_absent(manifest_key(7), manifest.to_json())


def test_a_lora_checkpoint_on_the_same_base_is_chosen(tmp_path):
    _commit(tmp_path, {LORA: LoraSpec().to_dict(), LORA_BASE: BASE.to_dict()})
    chosen = choose_restore(open_storage(str(tmp_path)), lora_base=BASE.to_dict())
    assert chosen is not None and chosen.lora_base == BASE.to_dict() and chosen.lora == LoraSpec().to_dict()


def test_a_lora_checkpoint_on_another_base_is_refused_naming_both(tmp_path):
    _commit(tmp_path, {LORA: LoraSpec().to_dict(), LORA_BASE: BASE.to_dict()})
    other = LoraBase(source="s3://models/llama-3.2-1b-instruct", sha256="b" * 64)
    with pytest.raises(ForeignCheckpointError) as refused:
        choose_restore(open_storage(str(tmp_path)), lora_base=other.to_dict())
    assert str(refused.value) == (
        f"checkpoint {tmp_path} step 7 holds LoRA adapters trained on the base s3://models/llama-3.2-1b (sha256 "
        f"{'a' * 64}), but this job's base s3://models/llama-3.2-1b-instruct has sha256 {'b' * 64}: point "
        "model.init_from at the base the adapters were trained on, or use a fresh checkpoint.uri"
    )


def test_a_checkpoint_of_every_weight_is_refused_by_a_lora_job(tmp_path):
    _commit(tmp_path, {})
    with pytest.raises(ForeignCheckpointError, match="holds every weight, not LoRA adapters"):
        choose_restore(open_storage(str(tmp_path)), lora_base=BASE.to_dict())
    assert choose_restore(open_storage(str(tmp_path))) is not None  # a full job takes it
