"""Float8 matmuls in a stage's linear layers (``training.float8``), through torchao's float8 training.

Runs on every rank: ``apply_float8`` while the trainer builds each of its stages
(``Trainer._build_module``: after tensor parallelism and LoRA, which the driver refuses with float8
for now, before activation checkpointing, compile and FSDP2), ``precompute_float8_scales`` after
every optimizer step. Both do nothing
unless float8 is on, and only then import torchao (the optional extra ``meshpilot[float8]``).

The recipe is torchao's tensorwise one with FSDP2's float8 all-gather: each rank casts its weight
shards to float8 before FSDP2 gathers them (half the bytes of a bfloat16 gather), with one scale
per weight, computed for all of them by one all-reduce after the optimizer step. It is the recipe
behind TorchTitan's published Llama 3.1 8B figures that this project's goals are set against.
The rowwise recipe is more robust to outliers, but its weights are gathered in high precision
(torchao allows the float8 all-gather with tensorwise scales only).

What converts: every ``nn.Linear`` whose two dimensions are multiples of 16 (what float8 tensor
cores take), except the output head (``lm_head``) and a mixture of experts' router (``gate``),
which TorchTitan's configs keep in high precision too: the logits feed the loss, and a routing
decision flips on small differences. A mixture of experts' grouped expert weights are no
``nn.Linear`` and stay as they are.

Nothing a checkpoint sees changes: a converted layer keeps its name and its parameters' names,
shapes and dtype (the master weights stay in the training dtype; the matmuls' inputs are cast on
the fly), so a float8 run resumes without float8 and the other way round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from importlib.util import find_spec

import torch
from torch import nn

# Float8 tensor cores: Ada (8.9), Hopper (9.0) and later.
FLOAT8_MIN_CAPABILITY = (8, 9)
# Linear layers kept in high precision, by attribute name: the output head, a mixture of experts' router.
HIGH_PRECISION_LINEARS = frozenset({"lm_head", "gate"})
# Float8 tensor cores take matrices whose dimensions are multiples of 16.
FLOAT8_DIM_MULTIPLE = 16


class Float8Unavailable(RuntimeError):
    """``training.float8`` on a rank whose device or installation cannot run it; the message names
    the device (or the missing package) and the fix, on one line."""


def float8_problem(device: torch.device) -> str | None:
    """Rank side: why this rank cannot train in float8 on ``device``, or None when it can."""
    needs = "training.float8 needs a CUDA GPU of compute capability 8.9 or higher (Ada, Hopper or newer)"
    if device.type != "cuda":
        return f"{needs}; this rank runs on the {device.type.upper()}: set training.float8=false"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FLOAT8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"{needs}; this rank's {name} has {major}.{minor}: set training.float8=false, or run on such GPUs"
    if find_spec("torchao") is None:
        return (
            "training.float8 needs torchao, which this rank's Python environment lacks: "
            "pip install 'meshpilot[float8]' on every node (or set training.float8=false)"
        )
    return None


def converts(module: nn.Module, fqn: str) -> bool:
    """Whether ``module`` (at ``fqn`` in its stage) trains in float8 (see the module docstring)."""
    if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] in HIGH_PRECISION_LINEARS:
        return False
    return module.in_features % FLOAT8_DIM_MULTIPLE == 0 and module.out_features % FLOAT8_DIM_MULTIPLE == 0


def apply_float8(module: nn.Module, *, enabled: bool, device: torch.device) -> None:
    """Every rank, for each stage it builds, while the stage is still on the meta device and
    before FSDP2 wraps it: swap its linear layers for torchao's float8 ones, in place (nothing when
    not ``enabled``). Raises ``Float8Unavailable`` when this rank cannot (``float8_problem``)."""
    if not enabled:
        return
    problem = float8_problem(device)
    if problem is not None:
        raise Float8Unavailable(problem)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name("tensorwise"),
        enable_fsdp_float8_all_gather=True,
        # Off a GPU (only reachable from tests, past float8_problem) the float8 casts are emulated:
        # float8 values, high-precision matmuls.
        emulate=device.type != "cuda",
    )
    convert_to_float8_training(module, config=config, module_filter_fn=converts)


@torch.no_grad()
def precompute_float8_scales(modules: Sequence[nn.Module], *, enabled: bool) -> None:
    """Collective over each stage's FSDP mesh: every rank, after every optimizer step (nothing when
    not ``enabled``). Each float8 weight's scale, from its largest magnitude over the whole weight,
    for all of a stage's weights in one all-reduce; without it, FSDP2's float8 all-gather runs one
    all-reduce per weight in the next forward. A fresh trainer (a new generation, a restore) has
    none yet and gathers the first step that way."""
    if not enabled:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for module in modules:
        precompute_float8_dynamic_scale_for_fsdp(module)
