"""LoRA adapters on a stage's linear layers: a frozen base, trainable low-rank pairs beside it.

Runs on every rank, inside ``Trainer`` construction, collective-free: ``attach_adapters`` after
tensor parallelism and before FSDP2 (``Trainer._build_module``), so the adapters are sharded by
FSDP2 with the rest of their block and follow their layer into its pipeline stage.

A targeted ``nn.Linear`` (``spec.targets``: by its Hugging Face name, ``q_proj`` ...) gets two
children, ``lora_A`` [rank, in_features] and ``lora_B`` [out_features, rank] (bias-free
``nn.Linear``: the parameters are ``<layer>.lora_A.weight`` and ``<layer>.lora_B.weight``, PEFT's
names), and a forward hook that adds ``scaling * lora_B(lora_A(dropout(x)))`` to the layer's
output. A hook and not a subclass: tensor parallelism's styles partition every submodule of the
layer they are applied to, so the adapters are added once the base is placed, and they are placed
here to match it (``adapter_placements``). The hook runs before the style's output hook, so the
adapter's output joins the base's before any redistribution: for a row-wise layer both are partial
sums, reduced together by the one reduce-scatter the base needs anyway.

Every other parameter is frozen (``requires_grad=False``): no gradient, no optimizer state.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed import tensor as dtensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from workers.models import ModelFamily, StageModel, TensorParallelPlan
from workers.spec import ModelSpec
from workers.spec.lora import LoraSpec, is_adapter

# The submodules a targeted layer gets (PEFT's names; the dropout has no parameters).
ADAPTER_MODULES = ("lora_A", "lora_B", "lora_dropout")


def attach_adapters(
    module: StageModel, spec: LoraSpec, *, tp_mesh: DeviceMesh | None = None, tp_plan: TensorParallelPlan | None = None
) -> list[str]:
    """Give every targeted linear layer of the stage its adapters, freeze everything else, and
    return the adapted layers' names. With ``tp_mesh`` (tp > 1) the adapters are placed as the
    layer's style in ``tp_plan`` says (``adapter_placements``); the module is on the meta device."""
    adapted = []
    for layer_id, block in module.layers.items():
        for name, layer in list(block.named_modules()):
            if type(layer) is not nn.Linear or not spec.targets(name):
                continue
            device = layer.weight.device
            layer.lora_A = nn.Linear(layer.in_features, spec.rank, bias=False, device=device)
            layer.lora_B = nn.Linear(spec.rank, layer.out_features, bias=False, device=device)
            layer.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
            if tp_mesh is not None:
                assert tp_plan is not None, "tensor parallelism places adapters by the layer's style"
                _place(layer, tp_plan.layer.get(name), tp_mesh, f"layers.{layer_id}.{name}")
            layer.register_forward_hook(_adapter_hook(spec.scaling), prepend=True)
            adapted.append(f"layers.{layer_id}.{name}")
    for fqn, param in module.named_parameters():
        param.requires_grad_(is_adapter(fqn))
    return adapted


def adapter_placements(style: ParallelStyle | None) -> tuple[dtensor.Placement, dtensor.Placement]:
    """How lora_A and lora_B are split over the tp ranks for a layer of ``style``.

    Column-wise (q/k/v, gate/up): the input is replicated, so A is whole on every rank and B is
    split by output rows like the base weight. Row-wise (o_proj, down_proj): the input is split by
    features, so A is split by its input columns like the base weight, its output is a partial sum
    over the tp ranks, and B (whole) keeps it one: the layer's reduce-scatter sums it with the
    base's partial output.
    """
    if isinstance(style, ColwiseParallel):
        return dtensor.Replicate(), dtensor.Shard(0)
    if isinstance(style, RowwiseParallel):
        return dtensor.Shard(1), dtensor.Replicate()
    raise ValueError(
        f"model.lora.target_modules: a layer with tensor-parallel style {type(style).__name__} cannot take an "
        "adapter; target layers the family splits column- or row-wise, or set parallelism.tp=1"
    )


def _place(layer: nn.Module, style: ParallelStyle | None, tp_mesh: DeviceMesh, where: str) -> None:
    try:
        placements = adapter_placements(style)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    adapters = (cast(nn.Linear, layer.lora_A), cast(nn.Linear, layer.lora_B))
    for linear, placement in zip(adapters, placements, strict=True):
        placed = dtensor.distribute_tensor(linear.weight, tp_mesh, [placement])
        linear.register_parameter("weight", nn.Parameter(placed))


def _adapter_hook(scaling: float) -> Any:
    """The layer's forward hook: its output plus ``scaling * lora_B(lora_A(dropout(x)))`` (PEFT's order)."""

    def add_update(layer: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        lora_a, lora_b, dropout = (cast(nn.Module, getattr(layer, name)) for name in ADAPTER_MODULES)
        return output + lora_b(lora_a(dropout(args[0]))) * scaling

    return add_update


def linear_layer_names(family: ModelFamily, spec: ModelSpec) -> tuple[str, ...]:
    """The module names (their last part) of every linear layer in the family's blocks, from a build
    on the meta device: what ``model.lora.target_modules`` may name (on the driver, config checks)."""
    with torch.device("meta"):
        model = family.build(spec)
    names = (name.rsplit(".", 1)[-1] for name, layer in model.layers.named_modules() if type(layer) is nn.Linear)
    return tuple(dict.fromkeys(names))
