"""A model family's Hugging Face layout, in the form ``checkpointing``'s import and export take.

Runs in ``meshpilot ckpt import`` and ``meshpilot ckpt export`` (the user's terminal, one
process, no process group). ``checkpointing`` knows no model families (it imports nothing of
``workers``) and the driver never imports torch, so this module sits between them: it resolves
the family, builds the model on the meta device (shapes, no memory) to learn its parameter
names, and hands ``import_hf`` a name map and shapes, or ``export_hf`` an ``HfNaming``.
Family and config problems come back as ``HfCheckpointError`` (a user error: one line, exit 2).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpointing.catalog import load_manifest
from checkpointing.errors import ForeignCheckpointError, HfCheckpointError
from checkpointing.export import export_hf
from checkpointing.hf_format import HfCheckpoint, HfName, check_hf_shape, find_hf_tensor, open_hf_checkpoint
from checkpointing.storage import StorageBackend
from workers.models import FamilyError, ModelFamily, family_for_architecture, registered_families, resolve_family
from workers.spec import ModelSpec
from workers.spec.families.llama_hf import HfConfigError, architecture_of

DEFAULT_FAMILY = "llama"  # manifests written before model families record none


@dataclass(frozen=True)
class ImportPlan:
    """What ``import_hf`` needs for one Hugging Face directory: our names, their sources and shapes."""

    family: str
    spec: ModelSpec
    names: dict[str, HfName]  # our FQN -> HF tensor name (or names, stacked)
    shapes: dict[str, tuple[int, ...]]


def parameter_shapes(family: ModelFamily, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model, by FQN, from a build on the meta device."""
    with torch.device("meta"):
        model = family.build(spec)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def import_plan(config: dict[str, Any], available: set[str], source: str, *, family: str | None) -> ImportPlan:
    """The family (``family``, else the one registered for config.json's architecture), its shape
    from config.json, and which HF tensor (of ``available``) each parameter reads."""
    with _as_user_errors():
        name = family or _family_for(config, source)
        resolved = resolve_family(name)
        spec = dataclasses.replace(resolved.spec_from_hf_config(config, source), family=name)
    shapes = parameter_shapes(resolved, spec)
    names = resolved.hf_source_names(spec, sorted(shapes), available)
    return ImportPlan(family=name, spec=spec, names=names, shapes=shapes)


def _family_for(config: dict[str, Any], source: str) -> str:
    architecture = architecture_of(config, source)
    found = family_for_architecture(architecture)
    if found is None:
        raise HfCheckpointError(
            f"{source}: no model family loads architecture {architecture} (registered: "
            f"{', '.join(registered_families())}); name one with --family NAME or --family package.module:Class"
        )
    return found.name


def check_pretrained(storage: StorageBackend, spec: ModelSpec) -> HfCheckpoint:
    """Refuse released weights that cannot fill the model of ``spec``: a shard the index names
    but the directory lacks, a parameter with no tensor, a tensor of another shape.

    Runs on the driver before any rank starts (reads the index and the file headers only), so
    these mistakes are one line and exit 2 rather than a failure on every rank.
    """
    with _as_user_errors():
        family = resolve_family(spec.family)
    checkpoint = open_hf_checkpoint(storage)
    shapes = parameter_shapes(family, spec)
    names = family.hf_source_names(spec, sorted(shapes), set(checkpoint.tensors))
    for fqn, shape in shapes.items():
        check_hf_shape(checkpoint, find_hf_tensor(checkpoint, fqn, names), shape)
    return checkpoint


class FamilyNaming:
    """``checkpointing.export.HfNaming`` of the family a checkpoint's model description names.

    Exports exactly the parameters of the model that description builds; the optimizer state
    and anything else in the checkpoint stay behind.
    """

    def __init__(self, model: Mapping[str, Any]) -> None:
        self.family_name = str(model.get("family") or DEFAULT_FAMILY)
        with _as_user_errors():
            self.family = resolve_family(self.family_name)
        self.spec = _spec_of(model, self.family_name, self.family.args_class)
        self.parameters = parameter_shapes(self.family, self.spec)

    def hf_name(self, fqn: str) -> HfName | None:
        return self.family.hf_names(self.spec, fqn) if fqn in self.parameters else None

    def hf_config(self, model: dict[str, Any], dtype: str) -> dict[str, Any]:
        return self.family.hf_config(self.spec, dtype=dtype)

    def check_holds_every_parameter(self, tensors: Mapping[str, Any], where: str) -> None:
        """Refuse a checkpoint that lacks parameters of its own model (it would export a partial model)."""
        missing = sorted(set(self.parameters) - set(tensors))
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ForeignCheckpointError(
                f"checkpoint {where} lacks {shown} of its {self.family_name} model: it holds another model's "
                "tensors and cannot be exported"
            )


def export_family(
    storage: StorageBackend, out_dir: str | os.PathLike, *, step: int | None = None, **options: Any
) -> tuple[Path, FamilyNaming]:
    """Export ``step`` (the newest committed when None) in its family's Hugging Face layout.

    ``options`` are ``export_hf``'s (``dtype``, ``max_shard_bytes``). Refuses a checkpoint that
    lacks parameters of its own model. Returns the directory and the naming used.
    """
    manifest = load_manifest(storage, step)
    naming = FamilyNaming(manifest.model)
    naming.check_holds_every_parameter(manifest.tensors, f"{storage.uri} step {manifest.step}")
    return export_hf(storage, out_dir, step=manifest.step, naming=naming, **options), naming


def _spec_of(model: Mapping[str, Any], family: str, args_class: type[ModelSpec]) -> ModelSpec:
    """The family's args from a checkpoint's model description (refused when it lacks a field they need)."""
    required = [f.name for f in dataclasses.fields(args_class) if f.default is dataclasses.MISSING]
    missing = [name for name in required if name not in model]
    if missing:
        kind = "Llama-style" if family == DEFAULT_FAMILY else family
        raise ForeignCheckpointError(
            f"the checkpoint's model description lacks {', '.join(missing)}: it is not a meshpilot {kind} model "
            "and cannot be exported"
        )
    return args_class.from_dict({**model, "family": family})


@contextmanager
def _as_user_errors() -> Iterator[None]:
    """The family registry and the config reader raise ValueErrors; the CLI prints user errors."""
    try:
        yield
    except (FamilyError, HfConfigError) as error:
        raise HfCheckpointError(str(error)) from None
