"""Export a committed checkpoint as a Hugging Face model directory.

Runs in ``meshpilot ckpt export`` and the demo (one process, no process group). Writes
``config.json``, ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads offline. An ``HfNaming`` (the
model family's, ``workers/hf_transfer.FamilyNaming``) says which parameters are exported under
which Hugging Face names, and writes config.json. The slices of
every tensor are gathered through the same resharding reader as a restore, into whole tensors,
one output shard at a time to bound memory. Tensors keep their stored bytes unless ``dtype``
asks for another dtype.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from checkpointing.catalog import load_manifest
from checkpointing.errors import CheckpointError, ForeignCheckpointError
from checkpointing.hf_format import HfName
from checkpointing.manifest import Manifest
from checkpointing.reader import restore
from checkpointing.spec import OPTIMIZER_PREFIX, itemsize
from checkpointing.storage import StorageBackend


class HfNaming(Protocol):
    """A model family's Hugging Face layout, as export needs it (``workers/models`` has one per family)."""

    def hf_name(self, fqn: str) -> HfName | None:
        """The Hugging Face name of parameter ``fqn``, or None to leave it out (e.g. a tied copy); a
        tuple of names splits it along its first dimension into that many tensors (stacked experts)."""
        ...

    def hf_config(self, model: dict[str, Any], dtype: str) -> dict[str, Any]:
        """``config.json`` for the manifest's model description and the exported dtype."""
        ...


def exported_names(manifest: Manifest, naming: HfNaming) -> dict[str, HfName]:
    """Our FQN -> Hugging Face name(s) of every parameter ``naming`` exports, in FQN order."""
    renamed: dict[str, HfName] = {}
    owner: dict[str, str] = {}
    for fqn in sorted(manifest.tensors):
        name = None if fqn.startswith(OPTIMIZER_PREFIX) else naming.hf_name(fqn)
        if name is None:
            continue
        for one in (name,) if isinstance(name, str) else name:
            if one in owner:
                raise CheckpointError(
                    f"the naming maps both {owner[one]} and {fqn} to {one}: a tied weight is stored once, "
                    "so its naming must return None for all but one of them"
                )
            owner[one] = fqn
        renamed[fqn] = name
    if not renamed:
        raise ForeignCheckpointError(
            f"the naming exports none of the {len(manifest.tensors)} tensors of step {manifest.step}: "
            "the checkpoint belongs to another model family"
        )
    return renamed


def export_hf(
    storage: StorageBackend,
    out_dir: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 2 << 30,
    naming: HfNaming,
) -> Path:
    """Write the HF directory for ``step`` (the newest committed when None); return its path.

    ``dtype`` None keeps every tensor as stored (bitwise).
    """
    check_export_dtype(dtype)
    manifest = load_manifest(storage, step)
    renamed = exported_names(manifest, naming)
    stored = {manifest.tensors[fqn].dtype for fqn in renamed}
    config = naming.hf_config(manifest.model, dtype or (stored.pop() if len(stored) == 1 else "float32"))

    def read(fqns: list[str]) -> dict[str, torch.Tensor]:
        tensors = {
            fqn: torch.empty(manifest.tensors[fqn].shape, dtype=getattr(torch, manifest.tensors[fqn].dtype))
            for fqn in fqns
        }
        restore(storage, manifest, tensors)
        return tensors

    stored_as = {fqn: (tuple(manifest.tensors[fqn].shape), manifest.tensors[fqn].dtype) for fqn in renamed}
    return write_hf_directory(
        out_dir,
        renamed,
        stored_as,
        read,
        config=config,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        metadata={"meshpilot_step": manifest.step},
    )


def check_export_dtype(dtype: str | None) -> None:
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise CheckpointError(f"--dtype {dtype!r}: choose float32, bfloat16 or float16")


def write_hf_directory(
    out_dir: str | os.PathLike,
    renamed: dict[str, HfName],
    stored_as: dict[str, tuple[tuple[int, ...], str]],
    read: Callable[[list[str]], dict[str, torch.Tensor]],
    *,
    config: dict[str, Any],
    dtype: str | None,
    max_shard_bytes: int,
    metadata: dict[str, Any],
) -> Path:
    """Write ``renamed`` (our FQN -> Hugging Face name(s)) as a Hugging Face model directory: the
    safetensors files (at most ``max_shard_bytes`` each, planned from ``stored_as``: FQN -> shape and
    dtype), their index and ``config.json``. ``read`` gives the whole tensors of one file's FQNs, so
    only one output file's tensors are in memory at a time."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(stored_as, list(renamed), dtype, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(read(shard), {fqn: renamed[fqn] for fqn in shard}, dtype, out / filename)
        weight_map.update(dict.fromkeys((one for fqn in shard for one in _split_names(renamed[fqn])), filename))
    (out / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": total, **metadata}, "weight_map": dict(sorted(weight_map.items()))}, indent=2
        )
        + "\n"
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _split_names(name: HfName) -> tuple[str, ...]:
    return (name,) if isinstance(name, str) else name


def _write_shard(tensors: dict[str, torch.Tensor], renamed: dict[str, HfName], dtype: str | None, path: Path) -> int:
    """Save one output file's whole tensors under their Hugging Face names; return their bytes."""
    converted = {}
    for fqn, value in tensors.items():
        value = value if dtype is None else value.to(getattr(torch, dtype))
        name = renamed[fqn]
        # A stacked parameter's slice [i] is its i-th Hugging Face tensor (clone: a file holds no views).
        if isinstance(name, str):
            converted[name] = value.contiguous()
        else:
            converted.update({one: part.clone() for one, part in zip(name, value.unbind(0))})
    save_file(converted, path, metadata={"format": "pt"})
    return sum(value.numel() * value.element_size() for value in converted.values())


def _plan_shards(
    stored_as: dict[str, tuple[tuple[int, ...], str]], names: list[str], dtype: str | None, max_shard_bytes: int
) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        shape, stored_dtype = stored_as[name]
        nbytes = math.prod(shape) * itemsize(dtype or stored_dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards
