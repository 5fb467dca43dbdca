"""What a model family is, and how a family is found by name.

A family is the code that turns its args (a ``ModelSpec`` subclass: shapes, counts and
validation, torch-free) into modules every rank can split, shard and initialise, and that knows
its Hugging Face names. meshpilot ships ``llama`` (Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM) and
``moe`` (Qwen2-MoE), one folder each (``workers.models.<family>``, their args in
``workers.spec.families``); a user brings an architecture by writing a ``ModelFamily`` subclass
(and, for a block other than llama's, its args class) in their own package and naming it in the
config::

    model:
      family: my_pkg.models:MyFamily

Used on the driver (reading a Hugging Face config, naming tensors for import and export) and
on every rank (building its pipeline stages). A family object holds no state: ranks and the
driver each resolve it from its name.

What the rest of meshpilot relies on (``StageModel``):
- ``layers`` is an ``nn.ModuleDict`` keyed by the global layer index (``"0"``, ``"1"``, ...):
  a layer is the pipeline split unit, the FSDP unit and the activation-checkpointing unit,
  and parameter names never change with the pipeline split;
- ``keep_only`` removes what a pipeline stage does not own; ``first_stage_modules`` are the
  attributes only the first stage keeps (embeddings), ``last_stage_modules`` only the last
  (final norm, output projection);
- ``forward`` takes token ids [batch, seq] on the first stage and hidden states
  [batch, seq, dim] after it, and returns logits [batch, seq, vocab] on the last stage; with
  ``documents`` (packing by documents, see ``workers.data.Sample``) it hands them to every layer,
  whose attention restarts positions and stops at each document.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from checkpointing.hf_format import HfName
from workers.spec import PRESETS, ModelSpec
from workers.spec.families import LlamaArgs
from workers.spec.model import recast

SpecT = TypeVar("SpecT", bound=ModelSpec)


class StageModel(nn.Module):
    """The whole model, or one pipeline stage of it once ``keep_only`` has run."""

    first_stage_modules: ClassVar[tuple[str, ...]] = ()
    last_stage_modules: ClassVar[tuple[str, ...]] = ()
    layers: nn.ModuleDict

    def keep_only(self, layer_ids: range, *, first: bool, last: bool) -> StageModel:
        """Drop what a pipeline stage does not own; names of what stays are unchanged."""
        for layer_id in list(self.layers.keys()):
            if int(layer_id) not in layer_ids:
                del self.layers[layer_id]
        dropped = (() if first else self.first_stage_modules) + (() if last else self.last_stage_modules)
        for name in dropped:
            setattr(self, name, None)
        return self

    @property
    def is_first_stage(self) -> bool:
        return all(getattr(self, name) is not None for name in self.first_stage_modules)

    @property
    def is_last_stage(self) -> bool:
        return all(getattr(self, name) is not None for name in self.last_stage_modules)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] -> hidden states [batch, seq, dim] (first stage only)."""
        raise NotImplementedError

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states -> logits [batch, seq, vocab] (last stage only)."""
        raise NotImplementedError

    def scale_auxiliary_losses(self, scale: float) -> None:
        """Multiply the gradient of every auxiliary loss (a mixture of experts' load balancing) by
        ``scale``, as the trainer scales its loss: 1 / microbatches per step. Called on every rank
        once the stage is built; a model without auxiliary losses ignores it."""

    def expert_load(self) -> dict[str, float]:
        """A mixture of experts' load balance per layer since the last call (the trainer reads it
        once per step, on every rank); empty for a model without experts."""
        return {}

    def set_shape_inference(self, active: bool) -> None:
        """Every rank of a pipeline, around the stage's shape inference (a forward on placeholder
        inputs before the first step, part of no step): state a forward keeps (routing counts)
        must not count it. A model without such state ignores it."""

    def start_step(self) -> None:
        """Every rank, before a step's first forward: forget what an aborted attempt counted."""

    def after_optimizer_step(
        self, parameters: Mapping[str, torch.Tensor], all_reduce: Callable[[torch.Tensor], None]
    ) -> None:
        """Every rank, after the optimizer applied a step: update state that is not trained by
        gradients (a mixture of experts' routing biases). ``parameters``: the stage's parameters
        by name as the optimizer holds them (sharded); ``all_reduce``: sums a tensor over every
        rank holding this stage (collective). A model without such state ignores it."""

    def forward(self, tokens_or_hidden: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens_or_hidden) if self.is_first_stage else tokens_or_hidden
        for layer in self.layers.values():
            # Positional: activation checkpointing's wrapper passes positional arguments on.
            h = layer(h) if documents is None else layer(h, documents)
        return self.head(h) if self.is_last_stage else h


@dataclass(frozen=True)
class InitRule:
    """How a parameter starts in a fresh run: ``normal`` with ``std``, ``uniform`` within
    +-``bound``, or filled with ``value``."""

    std: float | None = None
    value: float = 0.0
    bound: float | None = None

    @classmethod
    def normal(cls, std: float) -> InitRule:
        return cls(std=std)

    @classmethod
    def uniform(cls, bound: float) -> InitRule:
        return cls(bound=bound)

    @classmethod
    def fill(cls, value: float) -> InitRule:
        return cls(value=value)


@dataclass(frozen=True)
class TensorParallelPlan:
    """Parallel styles (``parallelize_module`` plans) for the stage's own modules and per layer.

    Keys name submodules relative to the stage (``top``) or to one layer (``layer``); a key
    whose module the stage does not hold (an embedding on a middle stage) is skipped.
    """

    top: Mapping[str, ParallelStyle]
    layer: Mapping[str, ParallelStyle]


class ModelFamily(Generic[SpecT]):
    """A model architecture meshpilot can build, shard, initialise, import and export.

    Subclass it, set ``name`` and ``args_class`` (its shape: ``LlamaArgs`` when the block counts
    as llama's, else your own ``ModelSpec`` subclass) and implement ``build``,
    ``tensor_parallel_plan`` and ``init_rule``; override ``preset`` where the shipped presets'
    block is not yours; add ``spec_from_hf_config`` / ``hf_config`` / ``hf_name`` for Hugging Face
    import and export. Methods run on the driver and on every rank and must not keep state.
    """

    name: ClassVar[str] = ""
    # The family's args: what the planner counts and the config's shape keys fill.
    args_class: ClassVar[type[ModelSpec]] = LlamaArgs
    # Hugging Face ``architectures`` entries whose weights this family loads.
    hf_architectures: ClassVar[tuple[str, ...]] = ()

    def preset(self, name: str) -> ModelSpec:
        """The shape ``model.preset: <name>`` gives this family before the config's own keys (on the
        driver). Defaults to the shipped preset's values of the fields ``args_class`` has; a family
        whose block differs (no grouped-query attention, a two-matrix MLP) returns their width and
        depth with its own block."""
        base = PRESETS[name]
        return base if type(base) is self.args_class else recast(base, self.args_class)

    def build(self, spec: SpecT) -> StageModel:
        """The whole model, constructed under ``torch.device("meta")`` by the caller."""
        raise NotImplementedError

    def tensor_parallel_plan(self, spec: SpecT) -> TensorParallelPlan:
        raise NotImplementedError

    def init_rule(self, fqn: str, spec: SpecT) -> InitRule:
        """Initial values of parameter ``fqn``: identical whatever the mesh (drawn in full per name)."""
        raise NotImplementedError

    def problems(self, spec: SpecT) -> list[str]:
        """Shapes this family cannot build, as sentences naming the keys (on the driver); the
        args' own ``problems`` unless the family adds to them."""
        return spec.problems()

    # ------------------------------------------------------------ Hugging Face
    def spec_from_hf_config(self, config: dict[str, Any], source: str) -> ModelSpec:
        """The shape a Hugging Face ``config.json`` describes (on the driver; no torch needed)."""
        raise NotImplementedError(f"model family {self.name!r} does not read Hugging Face configs")

    def hf_config(self, spec: SpecT, *, dtype: str) -> dict[str, Any]:
        """``config.json`` for an export of this shape."""
        raise NotImplementedError(f"model family {self.name!r} does not export to Hugging Face")

    def hf_name(self, fqn: str) -> str:
        """The Hugging Face tensor name of parameter ``fqn`` (export, and import by default)."""
        raise NotImplementedError(f"model family {self.name!r} has no Hugging Face names")

    def hf_names(self, spec: SpecT, fqn: str) -> HfName:
        """The Hugging Face tensor(s) parameter ``fqn`` is exported as: ``hf_name``, or (a family with
        stacked parameters) a tuple of names, one per slice along the first dimension."""
        return self.hf_name(fqn)

    def hf_source_names(self, spec: SpecT, fqns: list[str], available: set[str]) -> dict[str, HfName]:
        """Which Hugging Face tensor(s) each parameter is loaded from (``available``: the file's names).

        Defaults to ``hf_names``; a family overrides it where one tensor feeds two parameters
        (tied embeddings stored once).
        """
        return {fqn: self.hf_names(spec, fqn) for fqn in fqns}


class FamilyError(ValueError):
    """A model family that cannot be found; the message names it and the fix."""


_REGISTRY: dict[str, type[ModelFamily]] = {}


def register_family(family: type[ModelFamily], *aliases: str) -> type[ModelFamily]:
    """Make ``family`` available as ``model.family: <name>`` (and each alias)."""
    for name in (family.name, *aliases):
        _REGISTRY[name] = family
    return family


def registered_families() -> list[str]:
    return sorted(_REGISTRY)


def resolve_family(name: str) -> ModelFamily:
    """The family named ``name``: a registered name, or ``package.module:Class`` to import."""
    if name in _REGISTRY:
        return _REGISTRY[name]()
    if ":" not in name:
        raise FamilyError(
            f"model.family {name!r} is not a registered family ({', '.join(registered_families())}); "
            "name one of those, or your own class as package.module:Class"
        )
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise FamilyError(
            f"model.family {name!r}: module {module_name} does not import ({error}); install the package "
            "that holds it on every node, or fix the path"
        ) from None
    family = getattr(module, class_name, None)
    if not (isinstance(family, type) and issubclass(family, ModelFamily)):
        raise FamilyError(
            f"model.family {name!r}: {module_name} has no ModelFamily subclass named {class_name}; "
            "name a class that subclasses meshpilot's ModelFamily"
        )
    return family()


def family_for_architecture(architecture: str) -> ModelFamily | None:
    """The registered family that loads this Hugging Face architecture, if any."""
    for family in dict.fromkeys(_REGISTRY.values()):
        if architecture in family.hf_architectures:
            return family()
    return None
