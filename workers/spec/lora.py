"""LoRA adapters: which layers get a trainable low-rank pair, and how large. Plain values, no torch.

Built by the driver from ``model.lora`` and sent to every rank in ``TrainSpec.lora``; the planner
and ``meshpilot plan`` price it; checkpoints record it. The arithmetic follows Hugging Face PEFT's
``LoraConfig`` so that an exported adapter loads there unchanged: a targeted linear layer
``y = W x (+ b)`` becomes ``y = W x (+ b) + scaling * B(A(dropout(x)))`` with ``A`` of shape
``[rank, in_features]`` (initialised as PEFT does), ``B`` of shape ``[out_features, rank]``
(initialised to zero, so training starts from the base model exactly) and ``scaling = alpha / rank``.

Names: the adapters of the layer ``layers.3.self_attn.q_proj`` are the parameters
``layers.3.self_attn.q_proj.lora_A.weight`` and ``layers.3.self_attn.q_proj.lora_B.weight``; the
base layer keeps its own names (``...q_proj.weight``), so importing and exporting the base is
unchanged. ``target_modules`` are Hugging Face's module names (the last part of the name).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Hugging Face's names of the linear layers a decoder block of the shipped families has.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# The layers of each shipped family that take an adapter. The ``moe`` family's feed-forward is its
# experts (and a shared expert inside the same block, kept whole under tensor parallelism): it
# takes adapters on attention only.
FAMILY_TARGETS: dict[str, tuple[str, ...]] = {"llama": LORA_TARGETS, "moe": DEFAULT_TARGETS}
# The two adapter matrices of a targeted layer, as parameter name suffixes.
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter(fqn: str) -> bool:
    """Whether parameter ``fqn`` is a LoRA adapter matrix (else a base weight)."""
    return fqn.endswith(ADAPTER_SUFFIXES)


@dataclass(frozen=True)
class LoraSpec:
    """``model.lora``: adapter rank, ``alpha`` (scaling = alpha / rank), dropout on the adapter's
    input, and the layers that get one (by Hugging Face module name)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def targets(self, module_name: str) -> bool:
        """Whether the linear layer of this fully qualified name gets an adapter."""
        return module_name.rsplit(".", 1)[-1] in self.target_modules

    def to_dict(self) -> dict[str, Any]:
        """As the checkpoint manifest records it (``extra["lora"]``) and PEFT's config takes it."""
        found = asdict(self)
        found["target_modules"] = list(self.target_modules)
        return found

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LoraSpec:
        return cls(
            rank=int(values["rank"]),
            alpha=float(values["alpha"]),
            dropout=float(values["dropout"]),
            target_modules=tuple(values["target_modules"]),
        )

    def problems(self) -> list[tuple[str, object, str]]:
        """(key under model.lora, value, reason) for each bad setting; empty when all are good."""
        found: list[tuple[str, object, str]] = []
        if self.rank <= 0:
            found.append(("rank", self.rank, "must be a positive integer, e.g. 16"))
        if not self.alpha > 0:
            found.append(("alpha", self.alpha, "must be positive, e.g. twice the rank"))
        if not 0.0 <= self.dropout < 1.0:
            found.append(("dropout", self.dropout, "must be in [0, 1)"))
        if not self.target_modules:
            found.append(("target_modules", list(self.target_modules), f"name at least one of {list(LORA_TARGETS)}"))
        return found


@dataclass(frozen=True)
class LoraBase:
    """The frozen base a LoRA run trains beside, as its checkpoints name it (``extra["lora_base"]``).

    ``source``: the ``model.init_from`` URI, or ``random-init:seed=<seed>`` for a run without
    one (the base is then the seeded random model, drawn identically on any mesh, so a resume
    draws it again). ``sha256``: for released weights, the hash of config.json, every
    safetensors file's name, size and header (tensor names, dtypes, shapes, offsets), and the
    first 4 KiB of every tensor's data; for a seeded base, the hash of the family, the model's
    shape and the seed. A resume re-reads the base from ``source`` and refuses a base whose
    hash differs from the checkpoint's.
    """

    source: str
    sha256: str

    def to_dict(self) -> dict[str, str]:
        return {"source": self.source, "sha256": self.sha256}
