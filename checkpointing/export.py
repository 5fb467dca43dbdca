"""Export a committed checkpoint as a Hugging Face ``LlamaForCausalLM`` directory.

Runs in ``meshpilot ckpt export`` (one process, no process group). Writes ``config.json``,
``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` that
``transformers.LlamaForCausalLM.from_pretrained(DIR)`` loads offline. meshpilot's parameter names
are Hugging Face's without the ``model.`` prefix (RoPE in the same rotate-half convention), so
the mapping is a rename; the slices of every tensor are gathered through the same resharding
reader as a restore, into whole tensors, one output shard at a time to bound memory.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from checkpointing.catalog import load_manifest
from checkpointing.errors import CheckpointError, ForeignCheckpointError
from checkpointing.manifest import Manifest
from checkpointing.reader import restore
from checkpointing.spec import itemsize
from checkpointing.storage import StorageBackend

_MODEL_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim")


def hf_name(fqn: str) -> str:
    return fqn if fqn == "lm_head.weight" else f"model.{fqn}"


def llama_config(model: dict[str, Any], *, dtype: str) -> dict[str, Any]:
    """``config.json`` of the matching ``LlamaForCausalLM``, from the manifest's model shape."""
    missing = [key for key in _MODEL_KEYS if key not in model]
    if missing:
        raise ForeignCheckpointError(
            f"the checkpoint's model description lacks {', '.join(missing)}: it is not a "
            "meshpilot Llama-style model and cannot be exported"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model["dim"],
        "intermediate_size": model["ffn_dim"],
        "num_hidden_layers": model["n_layers"],
        "num_attention_heads": model["n_heads"],
        "num_key_value_heads": model["n_kv_heads"],
        "head_dim": model["dim"] // model["n_heads"],
        "vocab_size": model["vocab_size"],
        "rms_norm_eps": model.get("norm_eps", 1e-5),
        "rope_theta": model.get("rope_theta", 500000.0),
        "max_position_embeddings": model.get("max_seq_len", 8192),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def model_tensors(manifest: Manifest) -> list[str]:
    """The model's parameter names in the checkpoint (optimizer state and extras left out)."""
    names = sorted(fqn for fqn in manifest.tensors if not fqn.startswith("optim."))
    if "lm_head.weight" not in names or "embed_tokens.weight" not in names:
        raise ForeignCheckpointError(
            "the checkpoint holds no embed_tokens.weight / lm_head.weight: it is not a "
            "meshpilot Llama-style model and cannot be exported"
        )
    return names


def export_hf(
    storage: StorageBackend,
    out_dir: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Write the HF directory for ``step`` (the newest committed when None); return its path."""
    manifest = load_manifest(storage, step)
    names = model_tensors(manifest)
    stored = {manifest.tensors[name].dtype for name in names}
    out_dtype = dtype or (stored.pop() if len(stored) == 1 else "float32")
    if out_dtype not in ("float32", "bfloat16", "float16"):
        raise CheckpointError(f"--dtype {out_dtype!r}: choose float32, bfloat16 or float16")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(manifest, names, out_dtype, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {
            name: torch.empty(manifest.tensors[name].shape, dtype=getattr(torch, manifest.tensors[name].dtype))
            for name in shard
        }
        restore(storage, manifest, tensors)
        converted = {hf_name(name): value.to(getattr(torch, out_dtype)).contiguous() for name, value in tensors.items()}
        save_file(converted, out / filename, metadata={"format": "pt"})
        for name, value in converted.items():
            weight_map[name] = filename
            total += value.numel() * value.element_size()
        del tensors, converted
    (out / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": total, "meshpilot_step": manifest.step},
                "weight_map": dict(sorted(weight_map.items())),
            },
            indent=2,
        )
        + "\n"
    )
    (out / "config.json").write_text(json.dumps(llama_config(manifest.model, dtype=out_dtype), indent=2) + "\n")
    return out


def _plan_shards(manifest: Manifest, names: list[str], dtype: str, max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = math.prod(manifest.tensors[name].shape) * itemsize(dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards
