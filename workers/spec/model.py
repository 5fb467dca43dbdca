"""What every model family's shape (its *args*) holds and answers: plain values, no torch.

The planner sizes a 405B model from these numbers on a laptop, and the driver validates a
config without importing the model. ``ModelSpec`` is the base each family's args subclass
(``workers.spec.families``: ``LlamaArgs``, ``MoeArgs``; a user's family brings its own): the
fields every decoder has, and the questions the planner, the cost and memory models and the
config checks ask a shape. A family answers them for its own block, so none of those callers
knows which family it is pricing.

    counts        params_per_layer, active_params_per_layer, embedding_params, head_params,
                  num_params, num_active_params, layer_flops_per_token, flops_per_token
    memory        saved_activations_per_token (values one layer keeps per token for backward)
    parallelism   tp_split_ffn_dim, tp_whole_params_per_layer, expert_params_per_layer,
                  experts_per_token, splits_experts, expert_parallel_problem
    validation    problems (the shape itself), sequence_problems (against training.seq_len),
                  init_from_problems (against released Hugging Face weights)
    records       to_dict / from_dict (checkpoint manifests), with_shape_keys (config keys)

``family`` names the code that builds the model from these shapes (``workers.models``): a
registered name or ``package.module:Class``. Everything here runs on the driver (config
checks, ``meshpilot plan``) and on the ranks (the trainer reads the shape it was handed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

# The family a model description without one names (manifests written before families existed).
DEFAULT_FAMILY = "llama"

# Fields a checkpoint's model description holds only while they differ from the value given here,
# so that a checkpoint written before the field existed still compares equal to the same model.
# The value is the one every description had then, not the field's default in its family: the
# ``moe`` family's args name their family, which a description leaves out only when it is llama.
RECORDED_WHEN_SET: Mapping[str, Any] = {
    "family": DEFAULT_FAMILY,
    "attention_head_dim": None,
    "qkv_bias": False,
    "tie_embeddings": False,
    "rope_scaling": None,
    "sliding_window": None,
    "n_experts": 0,
    "top_k_experts": 0,
    "moe_ffn_dim": None,
    "n_shared_experts": 0,
    "shared_expert_ffn_dim": None,
    "router_score": "softmax",
    "normalize_top_k": False,
    "router_aux_loss_coef": 0.001,
    "router_bias_update_rate": 0.0,
}

# Config keys whose field in the args has another name (``model.head_dim``).
FIELD_OF_KEY = {"head_dim": "attention_head_dim"}

Spec = TypeVar("Spec", bound="ModelSpec")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape: the fields every family has, and the protocol the
    planner and the config checks read. Not built directly: each family's args subclass it and
    count their own block (see the module docstring)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    family: str = DEFAULT_FAMILY
    # Width of one attention head when it is not dim / n_heads (Hugging Face's ``head_dim``).
    attention_head_dim: int | None = None

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    # ------------------------------------------------------------ counting (the family's block)
    @property
    def params_per_layer(self) -> int:
        """Every parameter of one layer (all experts of a mixture of experts)."""
        raise NotImplementedError(f"{type(self).__name__} does not count its layer's parameters")

    @property
    def active_params_per_layer(self) -> int:
        """The parameters of one layer a token is computed with (all of them unless routed)."""
        return self.params_per_layer

    @property
    def embedding_params(self) -> int:
        """Parameters only the first pipeline stage holds (looked up, not multiplied)."""
        raise NotImplementedError(f"{type(self).__name__} does not count its embedding")

    @property
    def head_params(self) -> int:
        """Parameters only the last pipeline stage holds: final norm and output projection."""
        raise NotImplementedError(f"{type(self).__name__} does not count its output head")

    @property
    def num_params(self) -> int:
        """All parameters: embedding, layers, final norm, output projection."""
        return self.embedding_params + self.n_layers * self.params_per_layer + self.head_params

    @property
    def num_active_params(self) -> int:
        """The parameters one token is computed with: ``num_params`` less the experts it skips."""
        return self.embedding_params + self.n_layers * self.active_params_per_layer + self.head_params

    def layer_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs of one layer per token: 6 x its active parameters, plus the
        attention scores and their weighted sum over a causal window of ``seq_len``."""
        return 6.0 * self.active_params_per_layer + 12.0 * self.n_heads * self.head_dim * seq_len

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), the usual 6N plus attention scores.

        Embedding lookups do no matmul, so they are left out of N, as in the PaLM appendix; a
        mixture of experts counts the active parameters (top-k experts), not all of them.
        """
        dense = self.num_active_params - self.embedding_params
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6.0 * dense + attention

    # ------------------------------------------------------------ adapters
    def adapter_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of one layer's linear layers a LoRA adapter may target, by
        Hugging Face name: the attention projections (a family with a dense MLP adds its own)."""
        queries, keys = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {
            "q_proj": (self.dim, queries),
            "k_proj": (self.dim, keys),
            "v_proj": (self.dim, keys),
            "o_proj": (queries, self.dim),
        }

    def adapter_params_per_layer(self, target_modules: tuple[str, ...], rank: int) -> int:
        """Trainable parameters of one layer's LoRA adapters: ``rank x (in + out)`` per target."""
        shapes = self.adapter_linear_shapes()
        return sum(rank * (shapes[name][0] + shapes[name][1]) for name in target_modules if name in shapes)

    # ------------------------------------------------------------ memory
    def saved_activations_per_token(self) -> int:
        """Values one token leaves behind in one layer for the backward pass (the memory model
        multiplies them by the activation width)."""
        raise NotImplementedError(f"{type(self).__name__} does not count its saved activations")

    # ------------------------------------------------------------ parallelism
    @property
    def tp_split_ffn_dim(self) -> int | None:
        """The MLP width tensor parallelism splits (checked against tp); None: the family keeps
        its feed-forward whole on every tp rank, which then runs its own tokens through it."""
        return self.ffn_dim

    @property
    def tp_whole_params_per_layer(self) -> int:
        """Parameters of one layer tensor parallelism leaves whole on every tp rank (FSDP shards
        them over the tp ranks too); 0 when tp splits the whole layer."""
        return 0

    @property
    def expert_params_per_layer(self) -> int:
        """Parameters of one layer's routed experts: what expert parallelism splits (0: none)."""
        return 0

    @property
    def experts_per_token(self) -> int:
        """Routed experts each token is sent to (top-k): the copies of a token expert parallelism
        exchanges per layer (0: no routed experts)."""
        return 0

    def splits_experts(self, ep: int) -> bool:
        """Whether ``ep`` ranks can share this model's routed experts evenly (only 1 without experts)."""
        return ep == 1

    def expert_parallel_problem(self, ep: int, key: str) -> str | None:
        """Why ``key=ep`` cannot split this model's experts evenly (None when it can), as a
        sentence naming ``key`` (``parallelism.ep``, ``ep``, ``--ep``) and the fix."""
        if ep == 1:
            return None
        return (
            f"{key}={ep} needs a mixture-of-experts model (model.n_experts is not set): set {key}=1, "
            "or train a moe model (model.preset=debug-moe)"
        )

    # ------------------------------------------------------------ validation
    def problems(self) -> list[str]:
        """Every inconsistency of the shape itself, as sentences naming the keys."""
        found = []
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
            if getattr(self, name) < 1:
                found.append(f"model.{name}={getattr(self, name)} must be >= 1")
        if found:
            return found
        found.extend(self.head_problems())
        if self.n_heads % self.n_kv_heads:
            found.append(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
        return found

    def head_problems(self) -> list[str]:
        """The attention heads' width against ``dim`` (a family adds its own rules on the heads)."""
        if self.attention_head_dim is None and self.dim % self.n_heads:
            return [f"model.n_heads={self.n_heads} must divide model.dim={self.dim}"]
        return []

    def sequence_problems(self, seq_len: int) -> list[str]:
        """What keeps this model from training on sequences of ``seq_len`` tokens."""
        if seq_len > self.max_seq_len:
            return [f"training.seq_len={seq_len} exceeds the model's max_seq_len={self.max_seq_len}"]
        return []

    def init_from_problems(self) -> list[str]:
        """What keeps this shape from starting from released Hugging Face weights (``model.init_from``)."""
        return []

    # ------------------------------------------------------------ records and config keys
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (checkpoint manifests record them).

        Fields in ``RECORDED_WHEN_SET`` are left out while they hold the value given there, so
        a checkpoint written before they existed still compares equal to the same model now.
        """
        values = dataclasses.asdict(self)
        for name in list(values):
            if name in RECORDED_WHEN_SET and values[name] == RECORDED_WHEN_SET[name]:
                del values[name]
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelSpec:
        """The inverse of ``to_dict``; keys this class does not know are ignored.

        On ``ModelSpec`` itself: the args of the shipped family the description names (llama
        when it names none); a family meshpilot does not ship reads through its own args class.
        """
        if cls is ModelSpec:
            # A late import: the shipped families' args subclass this module's class.
            from workers.spec.families import shipped_args

            return shipped_args(str(values.get("family") or DEFAULT_FAMILY)).from_dict(values)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**cls.decode_fields({key: value for key, value in values.items() if key in known}))

    @classmethod
    def decode_fields(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Fields whose recorded form is not their value (a nested dataclass); none here."""
        return values

    def with_shape_keys(self: Spec, keys: Mapping[str, Any]) -> Spec:
        """This shape with ``model:`` config keys applied (under their config names); a key the
        family's args do not have is refused by name (on the driver, resolving the config)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(key for key in keys if FIELD_OF_KEY.get(key, key) not in names)
        if unknown:
            raise ValueError(
                f"model.{unknown[0]} is not a shape key of model family {self.family}: leave it unset, or name "
                "a model.family (or model.preset) whose model has it"
            )
        return dataclasses.replace(self, **{FIELD_OF_KEY.get(key, key): value for key, value in keys.items()})


def recast(spec: ModelSpec, args_class: type[Spec], **changes: Any) -> Spec:
    """``spec``'s values of the fields ``args_class`` has, as that class, with ``changes`` on top:
    a preset's width and depth given to another family's args (on the driver). ``family`` is not
    carried over: it is the new class's default unless ``changes`` names one."""
    names = {f.name for f in dataclasses.fields(args_class)} - {"family"}
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name in names}
    return args_class(**{**values, **changes})
