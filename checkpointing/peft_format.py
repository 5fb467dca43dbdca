"""The Hugging Face PEFT adapter format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Written by ``meshpilot ckpt export --format peft`` (one process, no process group) so that
``peft.PeftModel.from_pretrained(base, DIR)`` loads the adapters of a LoRA run onto the released
base model with no missing or unexpected keys. The tensors are PEFT's own: for the layer whose
base weight is ``model.layers.0.self_attn.q_proj.weight`` in the base model, the adapters are
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ([rank, in_features]) and
``...lora_B.weight`` ([out_features, rank]), with the adapter's name left out of the key as PEFT's
``save_pretrained`` leaves it out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT wraps the model (PeftModelForCausalLM.base_model, a LoraModel, whose .model is the base).
PEFT_PREFIX = "base_model.model."


def peft_tensor_name(base_weight_name: str, suffix: str) -> str:
    """PEFT's key of an adapter: ``model.layers.0.self_attn.q_proj.weight`` + ``.lora_A.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return PEFT_PREFIX + base_weight_name.removesuffix(".weight") + suffix


def adapter_config(
    *, rank: int, alpha: float, dropout: float, target_modules: tuple[str, ...], base_model: str | None
) -> dict[str, object]:
    """``adapter_config.json``: the fields of PEFT's ``LoraConfig`` that say what was trained; PEFT
    fills in the rest with its defaults."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }


def write_peft_adapter(
    out_dir: str | os.PathLike, tensors: Mapping[str, torch.Tensor], config: Mapping[str, object]
) -> Path:
    """Write ``tensors`` (PEFT keys -> adapter weights) and ``config`` as a PEFT adapter directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: tensor.contiguous() for name, tensor in tensors.items()},
        out / ADAPTER_WEIGHTS,
        metadata={"format": "pt"},
    )
    (out / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    return out


def merged_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling * B @ A`` in float32, cast back to the base weight's dtype (PEFT's merge)."""
    delta = (lora_b.float() @ lora_a.float()) * scaling
    return (base.float() + delta).to(base.dtype)
