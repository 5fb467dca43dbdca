"""``meshpilot ckpt export`` of a LoRA run's checkpoint: the PEFT adapter, or the merged model.

Runs in one process (the CLI, the demo), no process group. A LoRA checkpoint holds the adapters and
their optimizer state and names its frozen base (``Manifest.lora``, ``Manifest.lora_base``):

* ``export_adapter`` writes the adapters in PEFT's format (``checkpointing.peft_format``) under the
  Hugging Face names of the base layers they adapt, so ``peft.PeftModel.from_pretrained(base, DIR)``
  loads them onto the released model with no missing or unexpected keys;
* ``export_merged`` reads the base from its source (the released Hugging Face directory the run
  started from) and writes the merged model ``W + scaling * B @ A`` in the family's Hugging Face
  layout, one output file at a time, with the base's config.json, generation config and tokenizer
  files: a model directory ``transformers`` loads and generates with, without PEFT.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from checkpointing.catalog import load_manifest
from checkpointing.errors import CheckpointError, ForeignCheckpointError
from checkpointing.export import check_export_dtype, write_hf_directory
from checkpointing.hf_format import HfName, HfTensor, load_hf_tensors, open_hf_checkpoint
from checkpointing.manifest import Manifest
from checkpointing.peft_format import adapter_config, merged_weight, peft_tensor_name, write_peft_adapter
from checkpointing.reader import restore
from checkpointing.spec import OPTIMIZER_PREFIX
from checkpointing.storage import StorageBackend
from workers.hf_transfer import FamilyNaming
from workers.spec.lora import ADAPTER_SUFFIXES, LoraSpec, is_adapter

# The source a LoRA run without ``model.init_from`` names as its base (``workers.spec.lora.LoraBase``).
RANDOM_BASE_PREFIX = "random-init:"
# Files of a released model directory that a merged export copies as they are: how it generates and
# its tokenizer (the merged weights are the same architecture with the same vocabulary).
BASE_COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


class NotAdapterCheckpointError(ForeignCheckpointError):
    """``--format peft`` on a checkpoint that holds every weight and no adapters."""


def adapter_settings(manifest: Manifest, where: str) -> LoraSpec:
    """The LoRA settings a checkpoint was trained with; ``NotAdapterCheckpointError`` when it has none."""
    if manifest.lora is None:
        raise NotAdapterCheckpointError(
            f"{where} holds no LoRA adapters (it was trained without model.lora: every weight trained); "
            "export it with --format hf"
        )
    return LoraSpec.from_dict(manifest.lora)


def base_layer_weight(adapter_fqn: str) -> str:
    """``layers.0.self_attn.q_proj.lora_A.weight`` -> ``layers.0.self_attn.q_proj.weight``."""
    for suffix in ADAPTER_SUFFIXES:
        if adapter_fqn.endswith(suffix):
            return adapter_fqn.removesuffix(suffix) + ".weight"
    raise ValueError(f"{adapter_fqn} is not an adapter")


def export_adapter(storage: StorageBackend, out_dir: str | os.PathLike, *, step: int | None = None) -> Path:
    """Write ``step``'s adapters (the newest committed when None) as a PEFT adapter directory."""
    manifest = load_manifest(storage, step)
    lora = adapter_settings(manifest, f"{storage.uri} step {manifest.step}")
    naming = FamilyNaming(manifest.model)
    adapters = _read_adapters(storage, manifest)
    tensors = {}
    for fqn, value in adapters.items():
        base_name = naming.hf_name(base_layer_weight(fqn))
        if not isinstance(base_name, str):
            raise ForeignCheckpointError(
                f"{fqn} adapts {base_layer_weight(fqn)}, which has no single Hugging Face name"
            )
        tensors[peft_tensor_name(base_name, fqn[len(base_layer_weight(fqn)) - len(".weight") :])] = value
    base = manifest.lora_base or {}
    source = str(base.get("source", ""))
    config = adapter_config(
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=lora.target_modules,
        base_model=None if not source or source.startswith(RANDOM_BASE_PREFIX) else source,
    )
    return write_peft_adapter(out_dir, tensors, config)


def export_merged(
    storage: StorageBackend,
    base_storage: StorageBackend,
    out_dir: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 2 << 30,
) -> tuple[Path, FamilyNaming]:
    """Write ``step``'s base + adapters merged, in the family's Hugging Face layout.

    ``base_storage`` holds the released weights the run started from (the caller opened
    ``Manifest.lora_base``'s source and checked its fingerprint). Tensors keep the base's dtype
    unless ``dtype`` asks for another; the merge itself is computed in float32.
    """
    check_export_dtype(dtype)
    manifest = load_manifest(storage, step)
    lora = adapter_settings(manifest, f"{storage.uri} step {manifest.step}")
    naming = FamilyNaming(manifest.model)
    adapters = _read_adapters(storage, manifest)
    checkpoint = open_hf_checkpoint(base_storage)
    fqns = sorted(naming.parameters)
    sources = naming.family.hf_source_names(naming.spec, fqns, set(checkpoint.tensors))
    renamed = {fqn: name for fqn in fqns if (name := naming.hf_name(fqn)) is not None}
    base_dtype = {fqn: _stored_dtype(checkpoint.tensors, sources[fqn]) for fqn in renamed}
    stored_as = {fqn: (naming.parameters[fqn], base_dtype[fqn]) for fqn in renamed}

    def read(shard: list[str]) -> dict[str, torch.Tensor]:
        tensors = {fqn: torch.empty(stored_as[fqn][0], dtype=getattr(torch, stored_as[fqn][1])) for fqn in shard}
        load_hf_tensors(base_storage, checkpoint, tensors, {fqn: sources[fqn] for fqn in shard})
        for fqn, value in tensors.items():
            pair = fqn.removesuffix(".weight")
            if f"{pair}.lora_A.weight" in adapters:
                tensors[fqn] = merged_weight(
                    value, adapters[f"{pair}.lora_A.weight"], adapters[f"{pair}.lora_B.weight"], lora.scaling
                )
        return tensors

    config = _base_config(base_storage, dtype)
    out = write_hf_directory(
        out_dir,
        renamed,
        stored_as,
        read,
        config=config,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        metadata={"meshpilot_step": manifest.step, "meshpilot_merged_lora": True},
    )
    for name in BASE_COMPANION_FILES:  # the merged model generates as the base does, with its tokenizer
        if base_storage.exists(name):
            (out / name).write_bytes(base_storage.get(name))
    return out, naming


def _base_config(base_storage: StorageBackend, dtype: str | None) -> dict[str, Any]:
    """The base's own config.json (its token ids and settings stay as released), with ``dtype``
    recorded when the export casts the weights."""
    config = json.loads(base_storage.get("config.json"))
    if dtype is not None:
        for key in ("torch_dtype", "dtype"):
            if key in config:
                config[key] = dtype
    return config


def _read_adapters(storage: StorageBackend, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Every adapter matrix of the checkpoint, whole, as stored (the optimizer's state stays behind)."""
    names = [fqn for fqn in manifest.tensors if is_adapter(fqn) and not fqn.startswith(OPTIMIZER_PREFIX)]
    if not names:
        raise CheckpointError(f"step {manifest.step} names LoRA settings but holds no adapter tensors")
    tensors = {
        fqn: torch.empty(manifest.tensors[fqn].shape, dtype=getattr(torch, manifest.tensors[fqn].dtype))
        for fqn in names
    }
    restore(storage, manifest, tensors)
    return tensors


def _stored_dtype(tensors: Mapping[str, HfTensor], name: HfName) -> str:
    """The dtype of the released tensor(s) a parameter reads (stacked ones share theirs)."""
    return tensors[name if isinstance(name, str) else name[0]].dtype
