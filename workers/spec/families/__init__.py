"""The torch-free half of each shipped model family: its args (shape, counts, validation) and
its Hugging Face ``config.json`` reader and writer. The torch half (model, tensor-parallel plan,
init rules, tensor names) is ``workers.models.<family>``.

    llama.py, llama_hf.py   LlamaArgs (Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM) and their config.json
    moe.py, moe_hf.py       MoeArgs (Qwen2-MoE, debug-moe) and their config.json

Kept apart from ``workers.models`` because the planner (``elastic``, which may import only
``workers.spec``) and the driver's config checks read shapes without importing torch. The
lookups here run on the driver (config, ``meshpilot plan``, ``ckpt`` commands).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.spec.families.llama import LlamaArgs, RopeScaling
from workers.spec.families.llama_hf import LLAMA_COMPATIBLE, HfConfigError, architecture_of, llama_spec_from_hf
from workers.spec.families.moe import MoeArgs
from workers.spec.families.moe_hf import MOE_ARCHITECTURE, moe_spec_from_hf
from workers.spec.model import ModelSpec


@dataclass(frozen=True)
class ShippedShape:
    """A shipped family's torch-free half: its args class, and how a config.json becomes its args."""

    args: type[ModelSpec]
    architectures: tuple[str, ...]
    from_hf_config: Callable[[dict[str, Any], str], ModelSpec]


SHIPPED: dict[str, ShippedShape] = {
    "llama": ShippedShape(LlamaArgs, tuple(LLAMA_COMPATIBLE), llama_spec_from_hf),
    "moe": ShippedShape(MoeArgs, (MOE_ARCHITECTURE,), moe_spec_from_hf),
}


def shipped_args(family: str) -> type[ModelSpec]:
    """The args class of a shipped family; a ``ValueError`` naming the family for any other."""
    shipped = SHIPPED.get(family)
    if shipped is None:
        raise ValueError(
            f"model family {family!r} is not shipped with meshpilot ({', '.join(SHIPPED)}): its own args class "
            "reads its shapes"
        )
    return shipped.args


def spec_from_hf_config(config: dict[str, Any], source: str) -> ModelSpec:
    """The shape a config.json of a shipped family's architecture describes (the architecture
    picks the family: ``Qwen2MoeForCausalLM`` is ``moe``); refuses any other architecture."""
    architecture = architecture_of(config, source)
    for shipped in SHIPPED.values():
        if architecture in shipped.architectures:
            return shipped.from_hf_config(config, source)
    supported = sorted(name for shipped in SHIPPED.values() for name in shipped.architectures)
    raise HfConfigError(
        f"{source}: architecture {architecture} is not supported; supported: {', '.join(supported)} "
        "(or bring your own family: model.family: package.module:Class)"
    )


__all__ = [
    "SHIPPED",
    "HfConfigError",
    "LlamaArgs",
    "MoeArgs",
    "RopeScaling",
    "ShippedShape",
    "shipped_args",
    "spec_from_hf_config",
]
