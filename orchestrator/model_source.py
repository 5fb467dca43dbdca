"""Resolve the ``model:`` section into a family and a shape, before any worker starts.

Runs on the driver, inside ``load_config``: imports the family (a registered name or the
user's ``package.module:Class``), reads a Hugging Face ``config.json`` when ``model.hf_config``
or ``model.init_from`` names one (a local file or directory, or an ``s3://`` prefix read with
the checkpoint section's endpoint and the standard AWS credentials), applies the explicit
shape keys on top, and checks that released weights match the shape. Every problem comes
back as a sentence naming the key or file and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpointing.errors import CheckpointError
from checkpointing.storage import StorageBackend, open_storage
from workers.spec import PRESETS, ModelSpec
from workers.spec.families import SHIPPED, HfConfigError, spec_from_hf_config
from workers.spec.lora import FAMILY_TARGETS, LoraBase
from workers.spec.model import recast

if TYPE_CHECKING:
    from orchestrator.config import JobConfig
    from workers.models import ModelFamily

# The default family: a shipped one, whichever the preset or the config.json's architecture names.
SHIPPED_FAMILY = "llama"


@dataclass(frozen=True)
class ModelLocation:
    """A Hugging Face model directory or config file: a URI storage can open, and a file in it."""

    uri: str
    filename: str = "config.json"

    def describe(self) -> str:
        return f"{self.uri.rstrip('/')}/{self.filename}"


def resolve_model(config: JobConfig) -> list[str]:
    """Set ``config.model.resolved``; return the problems found (none when it is set)."""
    section = config.model
    where = section.hf_config or section.init_from
    try:
        if section.family in SHIPPED:
            section.resolved = shipped_spec(config, where).with_shape_keys(section.overrides())
        else:
            section.resolved = user_family_spec(config, section.family, where)
    except (HfConfigError, CheckpointError, OSError, ValueError) as error:  # FamilyError is a ValueError
        return [str(error)]
    if section.lora is not None:
        lora_found = lora_problems(config, section.resolved)
        if lora_found:
            return lora_found
    if section.init_from is None:
        return []
    problems = section.resolved.init_from_problems()  # a shape released weights cannot start (a routing bias)
    if problems:
        return problems
    try:
        check_released_weights(config, section.resolved, section.init_from)
    except (CheckpointError, OSError) as error:
        return [f"model.init_from: {error}"]
    return []


def check_released_weights(config: JobConfig, spec: ModelSpec, where: str) -> None:
    """The weights at ``where`` fill the model of ``spec``: every file there, every tensor, every shape."""
    from workers.hf_transfer import check_pretrained  # torch: builds the model on the meta device

    storage = open_location(locate(where, config.source_dir), config)
    try:
        check_pretrained(storage, spec)
    finally:
        storage.close()


def shipped_spec(config: JobConfig, where: str | None) -> ModelSpec:
    """A shipped family's shape, without torch: the preset, or what a config.json says. With the
    default family the preset or the architecture picks it (``debug-moe`` and ``Qwen2MoeForCausalLM``
    are ``moe``); a family named explicitly reads the config.json as its own."""
    family = config.model.family
    if where is None:
        return shipped_preset_spec(config.model.preset, family)
    location = locate(where, config.source_dir)
    hf_config = read_json(location, config)
    if family == SHIPPED_FAMILY:
        return spec_from_hf_config(hf_config, location.describe())
    return SHIPPED[family].from_hf_config(hf_config, location.describe())


def shipped_preset_spec(preset: str, family: str) -> ModelSpec:
    """``model.preset``'s shape for ``family``: the preset's own family for the default, another
    shipped family's args with the preset's width and depth (``family: moe, preset: debug`` then sets
    its experts by key), or, for a family the user brings, the preset under its name until the
    family itself resolves it (``user_family_spec``)."""
    base = PRESETS[preset]
    if family in (SHIPPED_FAMILY, base.family):
        return base
    if family in SHIPPED:
        return recast(base, SHIPPED[family].args, family=family)
    return dataclasses.replace(base, family=family)


def user_family_spec(config: JobConfig, name: str, where: str | None) -> ModelSpec:
    """A family the user brings: imported (with torch) to read its config or check its preset shape,
    with the config's shape keys applied to its own args."""
    family = load_family(name)
    if where is None:
        base = family.preset(config.model.preset)
    else:
        location = locate(where, config.source_dir)
        base = family.spec_from_hf_config(read_json(location, config), location.describe())
    spec = dataclasses.replace(base, family=name).with_shape_keys(config.model.overrides())
    problems = family.problems(spec)
    if problems:
        raise HfConfigError("; ".join(problems))
    return spec


def load_family(name: str) -> ModelFamily:
    from workers.models import resolve_family  # torch: only for a family the user brings

    return resolve_family(name)


def locate(where: str, source_dir: str | None) -> ModelLocation:
    """Where ``where`` points: a URI, or a local path tried from here, then from the config's directory."""
    if "://" in where:
        if where.endswith(".json"):
            uri, _, filename = where.rpartition("/")
            return ModelLocation(uri, filename)
        return ModelLocation(where)
    candidates = [Path(where)]
    if source_dir is not None and not Path(where).is_absolute():
        candidates.append(Path(source_dir) / where)
    for path in candidates:
        if path.is_file():
            return ModelLocation(str(path.resolve().parent), path.name)
        if path.is_dir():
            return ModelLocation(str(path.resolve()))
    raise HfConfigError(f"{where}: no such file or directory; give a Hugging Face model directory or its config.json")


def open_location(location: ModelLocation, config: JobConfig) -> StorageBackend:
    """Storage for a model location; ``s3://`` uses the checkpoint section's endpoint and region."""
    return open_storage(location.uri, endpoint_url=config.checkpoint.endpoint_url, region=config.checkpoint.region)


def read_json(location: ModelLocation, config: JobConfig) -> dict[str, Any]:
    storage = open_location(location, config)
    try:
        if not storage.exists(location.filename):
            raise HfConfigError(
                f"{location.describe()} does not exist; point model.hf_config / model.init_from at a Hugging Face "
                "model directory (it holds config.json)"
            )
        raw = storage.get(location.filename)
    finally:
        storage.close()
    try:
        loaded = json.loads(raw)
    except json.JSONDecodeError as error:
        raise HfConfigError(f"{location.describe()} is not valid JSON ({error})") from None
    if not isinstance(loaded, dict):
        raise HfConfigError(f"{location.describe()} must hold a JSON object")
    return loaded


def lora_problems(config: JobConfig, spec: ModelSpec) -> list[str]:
    """``model.lora``'s settings, and its targets against the linear layers the model has (a
    shipped family's from its table, a family the user brings from a build on the meta device)."""
    assert config.model.lora is not None
    lora = config.model.lora.spec()
    found = [f"model.lora.{key}={value!r} {reason}" for key, value, reason in lora.problems()]
    if found:
        return found
    family = spec.family
    layers = FAMILY_TARGETS.get(family) or user_family_linears(family, spec)
    unknown = [name for name in lora.target_modules if name not in layers]
    if not unknown:
        return []
    why = (
        "the moe family's feed-forward is its experts, which take no adapters"
        if family == "moe" and set(unknown) & set(FAMILY_TARGETS["llama"])
        else f"no linear layer of the {family} model has that name"
    )
    return [
        f"model.lora.target_modules={list(lora.target_modules)}: {', '.join(unknown)}: {why}; "
        f"name some of {', '.join(layers)}"
    ]


def user_family_linears(name: str, spec: ModelSpec) -> tuple[str, ...]:
    """The names (last part) of the linear layers in a user family's blocks (torch: such a family imports it anyway)."""
    from workers.lora import linear_layer_names

    return linear_layer_names(load_family(name), spec)


# Bytes of each tensor's data the base's hash reads (a fine-tune changes every weight it trains,
# so the first values differ; a header alone does not tell two fine-tunes of one model apart).
FINGERPRINT_DATA_BYTES = 4096


def lora_base(config: JobConfig) -> LoraBase:
    """The frozen base of a LoRA run, as its checkpoints name it (see ``LoraBase``). On the driver,
    once per run: for ``model.init_from``, config.json, each safetensors file's size and header
    and the first bytes of each tensor, by ranged reads (never the whole files)."""
    spec = config.model_spec
    if config.model.init_from is None:
        recipe = {"family": spec.family, "model": spec.to_dict(), "seed": config.training.seed}
        digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
        return LoraBase(source=f"random-init:seed={config.training.seed}", sha256=digest)
    location = locate(config.model.init_from, config.source_dir)
    storage = open_location(location, config)
    try:
        digest = released_weights_sha256(storage)
    finally:
        storage.close()
    return LoraBase(source=location.uri, sha256=digest)


def released_weights_sha256(storage: StorageBackend) -> str:
    """sha256 of a Hugging Face directory's config.json, and per safetensors file (by name): its
    size, its header and the first ``FINGERPRINT_DATA_BYTES`` of each tensor."""
    digest = hashlib.sha256(storage.get("config.json"))
    files = [info for info in storage.list() if info.key.endswith(".safetensors")]
    with ThreadPoolExecutor(max_workers=8) as pool:
        parts = list(pool.map(lambda info: _file_fingerprint(storage, info.key, info.size), files))
    for info, part in zip(files, parts, strict=True):
        digest.update(f"\n{info.key}\n{info.size}\n".encode())
        digest.update(part)
    return digest.hexdigest()


def _file_fingerprint(storage: StorageBackend, key: str, size: int) -> bytes:
    (length,) = struct.unpack("<Q", storage.get_range(key, 0, 8))
    header = storage.get_range(key, 8, 8 + length)
    tensors = json.loads(header)
    tensors.pop("__metadata__", None)
    data_start = 8 + length
    heads = [
        storage.get_range(key, data_start + begin, data_start + min(end, begin + FINGERPRINT_DATA_BYTES))
        for begin, end in sorted(tuple(entry["data_offsets"]) for entry in tensors.values())
    ]
    return hashlib.sha256(header + b"".join(heads)).digest()
