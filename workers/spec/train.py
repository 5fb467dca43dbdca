"""What a rank is asked to train: the job's rank-side view, its batch split and checkpoint target.

Plain values (no torch): built once on the driver (``orchestrator/driver/train_spec.py``) and
sent to every rank actor. ``OptimizerSpec`` declares the optimizer settings once: the job
config's ``training:`` section and ``TrainSpec`` both extend it, so a new setting is one field
here, read from YAML, validated for type and sent to the ranks without further edits.
``BatchPlan`` (the batch arithmetic) lives with ``MeshSpec`` in ``elastic/spec.py`` and is
re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from elastic.spec import BatchPlan, CpMethod
from workers.spec.lora import LoraBase, LoraSpec
from workers.spec.model import ModelSpec
from workers.spec.tokens import Packing

__all__ = [
    "BatchPlan",
    "CheckpointTarget",
    "EvalSpec",
    "OptimizerSpec",
    "ReshardAfterForward",
    "StepDecision",
    "TokenCorpusSource",
    "TrainSpec",
    "Verdict",
]


class Verdict(StrEnum):
    """The per-step commit vote's outcomes (see workers/rendezvous.py); the values are what the
    job's store holds."""

    COMMIT = "commit"
    COMMIT_AND_PAUSE = "commit_pause"  # commit, then leave the generation (a mesh change)
    COMMIT_PAUSE_CHECKPOINT = "commit_pause_checkpoint"  # the same, saving a checkpoint first
    ABORT = "abort"  # a rank failed: nobody applies the step


# Appended to a commit when every rank snapshots the step once applied (peer-memory snapshots).
_SNAPSHOT_MARK = "+snapshot"


@dataclass(frozen=True)
class StepDecision:
    """What the commit vote decided for a step: the verdict and whether every rank snapshots
    the step once applied. Stored in the job's store as one value, so every rank reads the same
    decision."""

    verdict: Verdict
    snapshot: bool = False

    def encode(self) -> str:
        return self.verdict + (_SNAPSHOT_MARK if self.snapshot else "")

    @classmethod
    def decode(cls, value: str) -> StepDecision:
        verdict = value.removesuffix(_SNAPSHOT_MARK)
        try:
            return cls(Verdict(verdict), snapshot=verdict != value)
        except ValueError:
            raise ValueError(f"not a step decision: {value!r}") from None

    @property
    def pause(self) -> bool:
        return self.verdict in (Verdict.COMMIT_AND_PAUSE, Verdict.COMMIT_PAUSE_CHECKPOINT)

    @property
    def checkpoint_before_pause(self) -> bool:
        """Save a checkpoint before pausing (a drain that takes the last replica group)."""
        return self.verdict == Verdict.COMMIT_PAUSE_CHECKPOINT


class ReshardAfterForward(StrEnum):
    """When FSDP2 frees a block's gathered parameters: ``parallelism.reshard_after_forward``."""

    # After each forward without pipelining, never with it (the stage's microbatches reuse them).
    AUTO = "auto"
    ALWAYS = "always"  # ZeRO-3: only the shard is held between forward and backward
    NEVER = "never"  # ZeRO-2: the whole parameters are held from forward to backward


@dataclass(frozen=True)
class CheckpointTarget:
    """Where and how a rank writes checkpoints (credentials come from the AWS chain, never here)."""

    uri: str
    endpoint_url: str | None = None
    region: str | None = None
    interval_steps: int = 10
    async_save: bool = True
    part_size_bytes: int = 8 << 20
    upload_concurrency: int = 4
    max_in_flight: int = 1


@dataclass(frozen=True)
class PretrainedSource:
    """Released Hugging Face weights a fresh run starts from: a directory or ``s3://`` prefix
    holding config.json and safetensors (credentials from the AWS chain, never here)."""

    uri: str
    endpoint_url: str | None = None
    region: str | None = None


@dataclass(frozen=True)
class TokenCorpusSource:
    """A prepared token corpus (``data.source: tokens``): a directory or ``s3://`` prefix holding
    the manifest and shards of ``workers/spec/tokens.py`` (credentials from the AWS chain, never here),
    and how samples are cut from it (``data.packing``, resolved by the driver from the corpus format)."""

    uri: str
    endpoint_url: str | None = None
    region: str | None = None
    packing: Packing = Packing.WINDOWS


@dataclass(frozen=True, kw_only=True)
class EvalSpec:
    """Evaluation while training: the settings, declared once (the job config's ``eval:`` section
    extends this class, and ``TrainSpec.eval`` carries it to the ranks).

    Every ``interval_steps`` applied steps, after the last step, and before step 1 when
    ``at_start``, the ranks compute the mean token loss over ``batches x global_batch`` fixed
    evaluation samples. ``interval_steps=0`` turns evaluation off.
    """

    #: Evaluate every this many applied steps and after the last (0: off).
    interval_steps: int = 0
    #: batches x training.global_batch fixed evaluation samples, the same on any mesh.
    batches: int = 4
    #: Also evaluate before step 1.
    at_start: bool = False

    def due(self, step: int, *, last_step: int) -> bool:
        """Whether the boundary after (1-based) ``step`` is evaluated (``step=0``: before step 1)."""
        if self.interval_steps <= 0:
            return False
        if step == 0:
            return self.at_start
        return step % self.interval_steps == 0 or step == last_step


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """AdamW with linear warmup and cosine decay: the settings, declared once.

    The job config's ``training:`` section extends this class (its YAML keys are these field
    names) and so does ``TrainSpec`` (ranks read ``spec.lr``); the driver copies the fields by name.
    """

    #: Peak learning rate: linear warmup, then cosine decay.
    lr: float = 3e-4
    #: Cosine decay ends at lr * min_lr_ratio on the last step.
    min_lr_ratio: float = 0.1
    #: Steps of linear warmup.
    warmup_steps: int = 0
    #: AdamW's weight decay.
    weight_decay: float = 0.1
    #: AdamW's beta1.
    beta1: float = 0.9
    #: AdamW's beta2.
    beta2: float = 0.95
    #: Clip the global gradient norm (over every dimension, pipeline stages included) to this; 0: off.
    grad_clip: float = 1.0


@dataclass(frozen=True, kw_only=True)
class TrainSpec(OptimizerSpec):
    """Everything a rank needs to train, except the mesh, which changes with the cluster.

    Built by the driver from the job config; sent to every rank actor once. The optimizer
    settings are its own fields (it extends OptimizerSpec); the batch split is ``batch``.
    """

    model: ModelSpec
    steps: int
    global_batch: int
    seq_len: int
    # Samples per forward pass; fixed from the first mesh so a smaller mesh accumulates more.
    microbatch_size: int
    microbatches: int = 1
    pp_schedule: str = "1f1b"
    stages_per_rank: int = 1
    # FSDP2's reshard_after_forward (ZeRO-3 vs ZeRO-2 memory) and host offload of the sharded state.
    reshard_after_forward: ReshardAfterForward = ReshardAfterForward.AUTO
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    # How attention spans a sequence split over cp > 1 ranks (``parallelism.cp_method``).
    cp_method: CpMethod = CpMethod.ALLGATHER
    # ``training.compile``: each transformer block compiled (workers/compile.py); ``training.float8``:
    # its linear layers' matmuls in float8 (workers/float8.py).
    compile: bool = False
    float8: bool = False
    # Where a compiling rank keeps inductor's caches on its node (see workers/compile.py).
    compile_cache_dir: str = ""
    # Expert parallelism: ranks of dp_shard that split a mixture of experts' experts (1: none).
    ep: int = 1
    seed: int = 0
    dtype: str = "float32"  # float32, or bfloat16 parameters with float32 gradient reduction
    data_source: str = "synthetic"
    tokens: TokenCorpusSource | None = None  # where data_source "tokens" reads from
    # Report with each step the global sample indices this rank's data-parallel slice consumed.
    record_samples: bool = False
    backend: str = "gloo"
    collective_timeout_s: float = 120.0
    checkpoint: CheckpointTarget | None = None
    # A fresh start loads these weights instead of drawing random ones.
    init_from: PretrainedSource | None = None
    # LoRA adapters (``model.lora``): only they train, the base stays as loaded; None trains every weight.
    lora: LoraSpec | None = None
    # The frozen base a LoRA run's checkpoints name (set by the driver whenever ``lora`` is).
    lora_base: LoraBase | None = None
    # Polled by every rank for a spot / maintenance notice of its own instance; "{node_id}"
    # is replaced by the rank's Ray node id (lets a test serve notices per node on loopback).
    instance_action_url: str | None = None
    instance_action_poll_s: float = 2.0
    eval: EvalSpec = EvalSpec()
    # runtime.survive_driver_loss: the rank outlives the driver, and exits after this many
    # seconds without hearing from one (workers/driver_lease.py). None: it dies with the driver.
    driver_lease_s: float | None = None

    @property
    def batch(self) -> BatchPlan:
        """How each step's global batch splits over a mesh's data-parallel ranks and rounds."""
        return BatchPlan(
            global_batch=self.global_batch, microbatch_size=self.microbatch_size, microbatches=self.microbatches
        )

    def accumulation(self, dp: int) -> int:
        """Forward/backward rounds per step on ``dp`` data-parallel ranks (see BatchPlan.accumulation)."""
        return self.batch.accumulation(dp)

    def ep_on(self, dp_shard: int) -> int:
        """Expert-parallel degree on a mesh with ``dp_shard``: the configured ``ep``, or on a mesh
        restored onto fewer ranks whose dp_shard it no longer divides, the largest common divisor
        (it still divides the expert count). Called by every rank when it builds its trainer."""
        return math.gcd(self.ep, dp_shard)

    def lr_at(self, step: int) -> float:
        """Learning rate of (1-based) step: linear warmup, then cosine down to lr * min_lr_ratio."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        decay_steps = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1.0 + math.cos(math.pi * progress))
