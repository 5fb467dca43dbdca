"""The job config: one YAML file -> nested dataclasses, validated before any worker starts.

Runs on the driver. ``load_config(path, overrides)`` is the only way in: it reads YAML (safe
loader only), applies ``--set dotted.key=value`` overrides, checks every key and type
generically (unknown keys get a "did you mean"), then checks the values against each other
(mesh degrees against heads, layers and batch; those rules live in ``config_checks``). Every
problem found is reported at once in a ``ConfigError`` naming the key path, the value and the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from elastic.spec import CpMethod, MeshSpec
from orchestrator.config_checks import resolve_data_path, validate
from orchestrator.errors import ConfigError
from orchestrator.model_source import resolve_model, shipped_preset_spec
from workers.spec import PRESETS, ModelSpec
from workers.spec.lora import DEFAULT_TARGETS, LoraSpec
from workers.spec.pipeline import RULES, PipelineSchedule
from workers.spec.tokens import Packing
from workers.spec.train import EvalSpec, OptimizerSpec, ReshardAfterForward

PP_SCHEDULES = tuple(schedule.value for schedule in PipelineSchedule)
RESHARD_AFTER_FORWARD = tuple(choice.value for choice in ReshardAfterForward)
CP_METHODS = tuple(method.value for method in CpMethod)
DATA_SOURCES = ("text", "synthetic", "tokens")
PACKINGS = tuple(Packing)
BACKENDS = ("auto", "nccl", "gloo")
DTYPES = ("auto", "float32", "bfloat16")
WANDB_MODES = ("online", "offline")


def _choices(*values: str) -> dict[str, Any]:
    return {"choices": values}


@dataclass
class LoraConfig:
    """``model.lora``: train low-rank adapters beside the frozen model (``workers.spec.lora``)."""

    #: Rank of each adapter (the inner dimension of its two matrices).
    rank: int = 16
    #: The adapters' output is scaled by alpha / rank.
    alpha: float = 32.0
    #: Dropout on each adapter's input (0: none).
    dropout: float = 0.0
    #: Hugging Face module names of the linear layers that get an adapter.
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))

    def spec(self) -> LoraSpec:
        return LoraSpec(
            rank=self.rank, alpha=self.alpha, dropout=self.dropout, target_modules=tuple(self.target_modules)
        )


@dataclass
class ModelConfig:
    """The model: a family, its shape (a preset, or a Hugging Face config.json), any field of
    which may be overridden, and optionally the released weights it starts from."""

    #: A registered family: llama (Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM) or moe (Qwen2-MoE), or your
    #: own: package.module:Class (a ModelFamily subclass).
    family: str = "llama"
    #: A shipped shape of the family (debug-moe is the moe family's); hf_config or init_from give the shape instead.
    preset: str = field(default="debug", metadata=_choices(*PRESETS))
    #: A Hugging Face config.json (file, directory or s3:// prefix) that gives every shape field.
    hf_config: str | None = None
    #: A Hugging Face model directory or s3:// prefix (config.json + safetensors): a fresh run
    #: starts from these weights (its config.json gives the shape unless hf_config is set).
    #: A checkpoint under checkpoint.uri takes precedence once one exists.
    init_from: str | None = None
    #: Any of the shape keys below overrides the preset's (or config.json's) value: the model width.
    dim: int | None = None
    #: Transformer blocks.
    n_layers: int | None = None
    #: Attention heads.
    n_heads: int | None = None
    #: Key/value heads (grouped-query attention).
    n_kv_heads: int | None = None
    #: Vocabulary size.
    vocab_size: int | None = None
    #: SwiGLU hidden size.
    ffn_dim: int | None = None
    #: RMSNorm's epsilon.
    norm_eps: float | None = None
    #: RoPE base frequency.
    rope_theta: float | None = None
    #: Longest sequence the positions are built for.
    max_seq_len: int | None = None
    #: Width of one head, when it is not dim / n_heads.
    head_dim: int | None = None
    #: Biases on the q, k and v projections (Qwen2).
    qkv_bias: bool | None = None
    #: The release ties lm_head to the embedding (loaded untied).
    tie_embeddings: bool | None = None
    # Mixture of experts (family moe, preset debug-moe): see workers.spec.families.moe.MoeArgs.
    #: Mixture of experts (family moe): routed experts per layer.
    n_experts: int | None = None
    #: Experts each token goes to (dropless: every token reaches all of them).
    top_k_experts: int | None = None
    #: One routed expert's SwiGLU hidden size (default ffn_dim).
    moe_ffn_dim: int | None = None
    #: Shared experts every token passes, behind a sigmoid gate (Qwen2-MoE).
    n_shared_experts: int | None = None
    #: Weight of the load-balancing loss in the gradient (preset debug-moe: 0.01).
    router_aux_loss_coef: float | None = None
    #: Auxiliary-loss-free balancing (DeepSeek-V3: 0.001); 0 or null: off.
    router_bias_update_rate: float | None = None
    #: softmax (default) or sigmoid: how router logits become expert scores.
    router_score: str | None = None
    #: Rescale each token's top-k scores to sum to one (norm_topk_prob).
    normalize_top_k: bool | None = None
    #: LoRA: {rank, alpha, dropout, target_modules}, e.g. {rank: 16}; the base stays frozen. null (the
    #: default) trains every weight.
    lora: LoraConfig | None = None
    # The shape once resolved by ``orchestrator.model_source`` (preset or config.json); not a key.
    resolved: ModelSpec | None = field(default=None, metadata={"internal": True}, repr=False)

    def overrides(self) -> dict[str, Any]:
        """Shape keys set explicitly, under their config names (``ModelSpec.with_shape_keys`` takes them)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _NOT_SHAPE_KEYS and not f.metadata.get("internal") and getattr(self, f.name) is not None
        }

    def spec(self) -> ModelSpec:
        """The shape ``orchestrator.model_source`` resolved (or, before it ran, the preset's with the keys)."""
        if self.resolved is not None:
            return self.resolved
        return shipped_preset_spec(self.preset, self.family).with_shape_keys(self.overrides())


# The model section's keys that say where the shape comes from rather than give part of it.
_NOT_SHAPE_KEYS = ("family", "preset", "hf_config", "init_from", "lora")


@dataclass
class ParallelismConfig:
    #: Replica groups: whole copies of the state (HSDP); the unit that fails and is dropped.
    dp_replicate: int = 1
    #: FSDP2 sharding inside a replica group.
    dp_shard: int = 2
    #: Expert parallelism (moe models): ranks of dp_shard that split the experts; must divide dp_shard.
    ep: int = 1
    #: Tensor parallel, with sequence parallelism; must divide heads, kv heads, ffn_dim and seq_len / cp.
    tp: int = 2
    #: Pipeline stages, balanced by layer count.
    pp: int = 2
    #: torch's pipeline schedule of that name.
    pp_schedule: str = field(default="1f1b", metadata=_choices(*PP_SCHEDULES))
    #: Model chunks per pipeline rank; None = 2 for interleaved_1f1b, zero_bubble, zbv and dualpipev, else 1.
    stages_per_rank: int | None = None
    #: Pipeline microbatches per step with pp > 1; gradient-accumulation microbatches without.
    microbatches: int = 4
    #: Recompute each block's activations in the backward instead of keeping them.
    activation_checkpointing: bool = False
    #: When FSDP2 frees gathered parameters: always (ZeRO-3), never (ZeRO-2), auto (never with pp > 1).
    reshard_after_forward: str = field(default="auto", metadata=_choices(*RESHARD_AFTER_FORWARD))
    #: Sharded parameters, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy).
    cpu_offload: bool = False
    #: Context parallel: ranks that split every sequence (same samples).
    cp: int = 1
    #: How their attention spans the whole sequence: allgather (K/V), ring, ulysses (elastic.spec.CpMethod);
    #: auto: the planner's pick for this layout on GPUs, allgather on CPU (orchestrator.driver.train_spec).
    cp_method: str = field(default="auto", metadata=_choices("auto", *CP_METHODS))

    def mesh(self) -> MeshSpec:
        return MeshSpec(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp, pp=self.pp, cp=self.cp)

    @property
    def virtual_stages(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return RULES[PipelineSchedule(self.pp_schedule)].default_stages_per_rank


@dataclass(frozen=True, kw_only=True)
class TrainingConfig(OptimizerSpec):
    """The ``training:`` section: the run's length and batch, and every optimizer setting
    (``lr``, ``warmup_steps``, ... are OptimizerSpec's fields, declared once there)."""

    #: Optimizer steps the run trains for (a resumed run may be extended).
    steps: int = 50
    #: Sequences per step, constant whatever the mesh (accumulation makes up for lost ranks).
    global_batch: int = 16
    #: Tokens per sequence.
    seq_len: int = 128
    #: A job warms up over its first steps unless told otherwise; OptimizerSpec itself does not.
    warmup_steps: int = 5
    #: Seed of the initial weights and the data order.
    seed: int = 0
    #: auto: bfloat16 parameters with float32 gradient reduction on GPU, float32 on CPU.
    dtype: str = field(default="auto", metadata=_choices(*DTYPES))
    #: Per-block torch.compile (inductor: C++ on CPU, Triton on CUDA), caches kept for the job.
    compile: bool = False
    #: float8 matmuls through torchao (CUDA, compute capability 8.9 or higher, tp=1;
    #: pip install 'meshpilot[float8]'); weights stay high precision.
    float8: bool = False


@dataclass
class DataConfig:
    #: text: byte-level tokens of data.path; synthetic: seeded, learnable samples; tokens: a corpus
    #: from `meshpilot data prepare` at data.uri.
    source: str = field(default="text", metadata=_choices(*DATA_SOURCES))
    #: A text file, tokenized at byte level; relative paths are tried from the current
    #: directory, then from the config file's directory.
    path: str = "data/sample.txt"
    #: source=tokens: a corpus written by ``meshpilot data prepare`` (a directory, tried like path,
    #: or s3://bucket/prefix read with checkpoint.endpoint_url and region). Ranks read it; the driver
    #: reads only its manifest.
    uri: str | None = None
    #: The tokenizer.json the job expects: the corpus must have been prepared with this very file.
    tokenizer: str | None = None
    #: Write RUN_DIR/samples.jsonl: per applied step and data-parallel rank, the samples consumed.
    record_samples: bool = False
    #: source=tokens: how samples are cut from the corpus. windows: seq_len + 1 tokens of the stream
    #: (pre-training); documents: whole documents packed up to seq_len, positions restarting and
    #: attention fenced at each. Unset: windows for a text corpus, documents for chat and
    #: prompt-completion corpora (set from the corpus manifest when the job is checked).
    packing: str | None = field(default=None, metadata=_choices(*PACKINGS))
    # sha256 of the corpus manifest once checked (the config hash names the corpus by it); not a key.
    manifest_sha256: str | None = field(default=None, metadata={"internal": True}, repr=False)


@dataclass(frozen=True, kw_only=True)
class EvalConfig(EvalSpec):
    """The ``eval:`` section: evaluation while training (its keys are EvalSpec's fields, declared
    once there): every ``interval_steps`` steps (0 = off), after the last step, and before step 1
    when ``at_start``, the mean token loss over ``batches x training.global_batch`` fixed samples."""


@dataclass
class CheckpointConfig:
    #: s3://bucket/prefix, file:///dir or a plain directory; None turns checkpoints off.
    uri: str | None = None
    #: The S3 endpoint for S3-compatible servers (SeaweedFS, MinIO); null: AWS.
    endpoint_url: str | None = None
    #: The S3 region.
    region: str | None = None
    #: Steps between checkpoints; the last step is also saved.
    interval_steps: int = 10
    #: Committed checkpoints kept; older ones are deleted.
    keep_last: int = 3
    #: Also keep every M-th step forever (0 = none).
    keep_every: int = 0
    #: Upload in the background while training goes on; false: every save waits until durable.
    async_: bool = field(default=True, metadata={"key": "async"})
    #: Multipart upload part size.
    part_size_mb: int = 8
    #: Parts each rank uploads at once.
    upload_concurrency: int = 4
    #: Saves being uploaded at once; the loop waits before staging another.
    max_in_flight: int = 1
    #: Resume from the latest committed checkpoint under uri when one exists.
    resume: bool = True


@dataclass
class StragglerConfig:
    """``elastic.straggler``: a rank whose compute is persistently slower than its peers' (``elastic/straggler.py``)."""

    #: Slow = compute phase over this many times the median of its peers' (the ranks of the same
    #: pipeline stage; must be > 1).
    # 2.0: a healthy rank's
    # compute varies far less (within ~1.3x on the shared 2-core CPU machine, less on GPUs), while
    # a throttled GPU or a rank sharing its device runs 2x or slower, and a rank at 2x holds every
    # step of the job back by as much.
    factor: float = 2.0
    #: ... in this many consecutive steps (all but one of them, so that one noisy step of a loaded
    #: machine does not hide it).
    # 5: a one-off hiccup (a page-cache miss, a garbage collection, a
    # snapshot copy) lasts a step or two; four slow steps of five is a condition, and replacing
    # costs no step, so acting after five is cheap.
    window_steps: int = 5
    #: replace: its replica group's work moves to warm actors at the next step boundary (0 steps
    #: lost, like a drain) and its node is avoided for new actors while others have room; exclude:
    #: its replica group leaves without a refill (the job grows back later, as after any shrink,
    #: from new actors placed away from its node); warn: only reported. Without warm
    #: actors (elastic.spare_actors) or another replica group, stragglers are only reported.
    # replace is the default: a
    # slow rank costs every step of the job, a replacement costs one step boundary.
    action: str = field(default="replace", metadata=_choices("warn", "replace", "exclude"))


@dataclass
class ElasticConfig:
    #: Fewest replica groups to keep training in place with.
    min_replicas: int = 1
    #: Grow up to this many replica groups when capacity allows (null: parallelism.dp_replicate).
    max_replicas: int | None = None
    #: A rank silent this long is lost.
    heartbeat_timeout_s: float = 10.0
    #: The floor of the hang threshold: a step is hung once it has run 4 x the recent p90 step time
    #: (and 2 x the slowest of the last 3) and at least this long (the first step of each generation
    #: gets a generous warm-up allowance: orchestrator/driver/detector.py). A job that knows its steps are
    #: steady lowers it (the chaos soak runs with 2 s: each hang found in 2-4.3 s).
    # 10 s, not lower: on a
    # shared 2-core machine a single-replica job's step stalled over 2 s during a storage outage, and
    # a hang declared there failed a run that had nothing to restore.
    hang_timeout_s: float = 10.0
    #: With training.compile: how long the first step of each mesh may take before it counts as hung
    #: (it may compile the blocks; a layout seen before loads them from the job's caches instead).
    compile_timeout_s: float = 600.0
    #: gloo/NCCL timeout for one collective.
    collective_timeout_s: float = 120.0
    #: Warm spare actors started with the job (rounded up to whole replica groups): a failed
    #: replica group is refilled from them at once, state copied from a surviving replica.
    spare_actors: int = 0
    #: Peer-memory snapshots: every this many steps each rank copies its state to host memory
    #: and a rank on another node keeps a copy, so a lost rank's state is rebuilt without
    #: storage (0: off). Each rank holds two of its own and two of its buddy's.
    snapshot_interval_steps: int = 1
    #: The fraction of step time snapshots may cost: when one costs more than this times the
    #: interval, they are taken less often (measured as the run goes, at most every 100 steps;
    #: 0: no limit, exactly every snapshot_interval_steps). The cost is what the loop waits for
    #: a snapshot: its copy overlaps the next step, so only a state too large to copy within
    #: a step's forward and backward costs anything.
    snapshot_overhead_limit: float = 0.02
    #: The host memory the snapshots may take per rank; a job needing more is refused at start
    #: (None: no limit; the memory they take is reported either way).
    snapshot_memory_limit_mb: int | None = None
    #: Failure budget: more than max_failures incidents within failure_window_s ends the run (a
    #: loss before any step completed since the previous one is the same incident), and so do
    #: more than max_failures recovery attempts of one incident.
    max_failures: int = 5
    #: The window of the failure budget (elastic.max_failures).
    failure_window_s: float = 3600.0
    #: A cloud's spot / maintenance notice endpoint, polled by every rank from its own node
    #: (e.g. http://169.254.169.254/latest/meta-data/spot/instance-action on AWS); 200 = notice.
    instance_action_url: str | None = None
    #: Seconds between polls of instance_action_url.
    instance_action_poll_s: float = 2.0
    #: A rank whose compute is persistently slower than its peers'.
    straggler: StragglerConfig = field(default_factory=StragglerConfig)


@dataclass
class MetricsConfig:
    #: Serve Prometheus metrics on /metrics from the driver.
    enabled: bool = True
    #: Address the metrics server binds; 0.0.0.0 only when asked (e.g. in a pod).
    host: str = "127.0.0.1"
    #: 0 picks a free port and prints it.
    port: int = 0
    #: Device peak FLOP/s for the MFU estimate; None = a default for the device kind.
    device_peak_tflops: float | None = None
    #: A directory Prometheus watches (file_sd_configs): the driver writes its scrape target
    #: there, so a port picked at random is still found. None = write nothing.
    targets_dir: str | None = None
    #: A directory the driver writes TensorBoard scalars to (loss, lr, tokens/s, grad norm, eval
    #: loss per step). None = write none.
    tensorboard_dir: str | None = None


@dataclass
class MlflowTrackingConfig:
    """``tracking.mlflow``: the run as an MLflow run (``orchestrator/observe/tracking.py``)."""

    #: The tracking server, e.g. http://mlflow.example:5000. None: MLFLOW_TRACKING_URI, else MLflow's local default.
    tracking_uri: str | None = None
    #: The experiment the run is filed under (created when missing). None: the job's name.
    experiment: str | None = None


@dataclass
class WandbTrackingConfig:
    """``tracking.wandb``: the run as a Weights & Biases run (``orchestrator/observe/tracking.py``)."""

    #: The W&B project. None: the job's name.
    project: str | None = None
    #: online: sent as the run goes (WANDB_API_KEY or `wandb login`); offline: written to RUN_DIR/wandb only,
    #: `wandb sync RUN_DIR/wandb/offline-run-*` uploads it later.
    mode: str = field(default="online", metadata=_choices(*WANDB_MODES))


@dataclass
class TrackingConfig:
    """``tracking:``: the experiment trackers the driver reports the run to (off unless a backend is set)."""

    #: MLflow: {tracking_uri, experiment}; null (the default): no MLflow run.
    mlflow: MlflowTrackingConfig | None = None
    #: Weights & Biases: {project, mode}; null (the default): no W&B run.
    wandb: WandbTrackingConfig | None = None
    #: Seconds the end of the run waits for the trackers to take what is still queued (the run record
    #: stays in RUN_DIR either way); an unreachable server never holds the run up for longer.
    close_timeout_s: float = 10.0


@dataclass
class RuntimeConfig:
    #: None: an embedded local Ray cluster (or RAY_ADDRESS when set).
    address: str | None = None
    #: auto: nccl with GPUs, gloo without.
    backend: str = field(default="auto", metadata=_choices(*BACKENDS))
    #: Ray CPUs each rank actor asks for.
    cpus_per_rank: float = 0.5
    #: Ray GPUs each rank actor asks for (1: NCCL and bfloat16 are chosen automatically).
    gpus_per_rank: float = 0.0
    #: Custom Ray resources each rank needs, e.g. {spot: 1}: places ranks only on nodes that
    #: advertise them (node pools, failure domains).
    resources_per_rank: dict[str, float] = field(default_factory=dict)
    #: Logical CPUs of the embedded cluster; None = enough for every rank.
    num_cpus: int | None = None
    #: Seconds to wait for every rank actor to be placed and started.
    start_timeout_s: float = 180.0
    #: Where the run's record goes (config.yaml, events.jsonl, logs/): a directory, or
    #: s3://bucket/prefix, mirrored from a local runs/<name>-<timestamp> while the run goes
    #: (with checkpoint.endpoint_url and region). None: runs/<name>-<timestamp>; in a Ray job with an
    #: s3:// checkpoint.uri, mirrored to <checkpoint.uri>/runs/<name>-<timestamp>. --run-dir wins.
    run_dir: str | None = None
    #: Seconds between uploads of new events to an s3:// run record (and once more at the end).
    run_dir_sync_s: float = 10.0
    #: training.compile: each node's directory of the job's compile caches ("{node_id}" is replaced
    #: by the rank's Ray node id). None: <tmp>/meshpilot-compile/<name>-<config hash>, so a resumed
    #: job finds its graphs compiled.
    compile_cache_dir: str | None = None
    #: Rank actors and the rendezvous store outlive the driver (detached Ray actors named after the
    #: run), so a driver started again for the same run adopts them with no step lost
    #: (orchestrator/driver/adoption.py). Needs a cluster that outlives the driver (RAY_ADDRESS).
    survive_driver_loss: bool = False
    #: With survive_driver_loss: seconds a rank (and the store) waits without hearing from any
    #: driver before it exits, so that nothing outlives a driver that never comes back.
    driver_lease_s: float = 120.0


@dataclass
class JobConfig:
    #: The run name: the run directory is runs/<name>-<timestamp>, and it labels the metrics.
    name: str = "meshpilot"
    #: The model: its family, its shape (a preset or a Hugging Face config.json, any field overridden),
    #: the weights it starts from, LoRA.
    model: ModelConfig = field(default_factory=ModelConfig)
    #: The device mesh: world size = pp x dp_replicate x dp_shard x cp x tp.
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    #: The run's length and batch, the optimizer, precision and compilation.
    training: TrainingConfig = field(default_factory=TrainingConfig)
    #: What the job trains on: a text file, synthetic samples or a corpus from `meshpilot data prepare`.
    data: DataConfig = field(default_factory=DataConfig)
    #: Evaluation while training on fixed samples, the same on any mesh.
    eval: EvalConfig = field(default_factory=EvalConfig)
    #: Asynchronous sharded safetensors checkpoints to S3 or disk.
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    #: Failure detection, recovery, peer-memory snapshots, growing back and stragglers.
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    #: The Prometheus endpoint the driver serves, and TensorBoard scalars.
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    #: Where the job runs: the Ray cluster, what each rank gets, where its record goes.
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    #: Experiment trackers (MLflow, Weights & Biases) the driver reports the run to.
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # Where the YAML came from; not a key.
    source_dir: str | None = field(default=None, metadata={"internal": True}, repr=False)

    @property
    def mesh(self) -> MeshSpec:
        return self.parallelism.mesh()

    @property
    def model_spec(self) -> ModelSpec:
        return self.model.spec()

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def config_hash(self) -> str:
        """Hash of what decides the numbers (model, parallelism-independent training, data).

        A checkpoint written under one hash resumes under another mesh: parallelism, runtime,
        metrics and checkpoint settings are left out on purpose, and so is training.steps (a
        run may be extended).
        """
        decisive = {key: self.to_dict()[key] for key in ("training", "data")}
        decisive["model"] = self._decisive_model()
        decisive["training"] = {k: v for k, v in decisive["training"].items() if k != "steps"}
        # The text itself, not where it lies: the same file under another path is the same job.
        data_path = resolve_data_path(self) if self.data.source == "text" else None
        decisive["data"] = {
            "source": self.data.source,
            "text_sha256": hashlib.sha256(data_path.read_bytes()).hexdigest() if data_path else None,
        }
        if self.data.source == "tokens":  # the corpus itself, by its manifest (which lists every shard's hash)
            decisive["data"]["tokens_manifest_sha256"] = self.data.manifest_sha256
            if self.data.packing == Packing.DOCUMENTS:  # other samples; windows hash as before packing existed
                decisive["data"]["packing"] = str(Packing.DOCUMENTS)
        if self.model.lora is not None:  # adapters change what trains (absent otherwise: older hashes hold)
            decisive["lora"] = self.model.lora.spec().to_dict()
        return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()[:16]

    def _decisive_model(self) -> dict[str, Any]:
        """A preset with overrides of the original keys hashes as it always did (so checkpoints
        written before model families resume); any other model hashes by its resolved shape,
        not by where the shape was read from (init_from only matters before a checkpoint exists)."""
        section = self.to_dict()["model"]
        section.pop("lora")  # hashed on its own (config_hash)
        if all(section[key] == value for key, value in _DEFAULT_MODEL_SECTION.items() if key not in _PRESET_KEYS):
            return {key: section[key] for key in _PRESET_KEYS}
        return self.model_spec.to_dict()


# The model section's keys before model families: a config using only these hashes as it did then.
_PRESET_KEYS = ("preset", "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "norm_eps", "rope_theta")
_DEFAULT_MODEL_SECTION = {
    f.name: f.default for f in dataclasses.fields(ModelConfig) if not f.metadata.get("internal") and f.name != "lora"
}


# ---------------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read, override, type-check and cross-check a job config; raise ConfigError listing problems."""
    raw: dict[str, Any] = {}
    source_dir = None
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a YAML job file")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"{path} is not valid YAML{where}: {getattr(error, 'problem', error)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path} must hold a mapping of sections (model:, parallelism:, ...), not a {type(loaded).__name__}"
            )
        raw = loaded
        source_dir = str(path.resolve().parent)
    problems: list[str] = []
    for override in overrides:
        _apply_override(raw, override, problems)
    config = _build(JobConfig, raw, "", problems)
    if problems:
        raise ConfigError(problems)
    config.source_dir = source_dir
    problems.extend(resolve_model(config))
    if problems:
        raise ConfigError(problems)
    problems.extend(validate(config))
    if problems:
        raise ConfigError(problems)
    return config


def config_from_dict(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Build and validate a config from a mapping (the Python API, tests, the job-submission
    entrypoint), with ``--set``-style overrides applied to a copy of it."""
    raw = copy.deepcopy(raw)
    problems: list[str] = []
    for override in overrides:
        _apply_override(raw, override, problems)
    config = _build(JobConfig, raw, "", problems) if not problems else JobConfig()
    if not problems:
        problems.extend(resolve_model(config))
    if not problems:
        problems.extend(validate(config))
    if problems:
        raise ConfigError(problems)
    return config


def _apply_override(raw: dict[str, Any], override: str, problems: list[str]) -> None:
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        problems.append(f"--set {override!r}: expected dotted.key=value, e.g. --set parallelism.tp=4")
        return
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            problems.append(f"--set {key}: {part!r} is not a section")
            return
        node = child
    node[parts[-1]] = value


def _yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    where = prefix.rstrip(".") or "the config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping of keys, got {type(raw).__name__} {raw!r}")
        return cls()
    fields = {_yaml_key(f): f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    for key in raw:
        if key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1)
            suggestion = f"; did you mean '{prefix}{hint[0]}'?" if hint else f"; known keys: {', '.join(fields)}"
            problems.append(f"{prefix}{key}: unknown key{suggestion}")
    values = {}
    hints = typing.get_type_hints(cls)
    for key, f in fields.items():
        if key not in raw:
            continue
        kind = hints[f.name]
        section = _section_class(kind)
        if section is not None and not (raw[key] is None and section is not kind):
            values[f.name] = _build(section, raw[key], f"{prefix}{key}.", problems)
        else:
            values[f.name] = _check_value(f"{prefix}{key}", raw[key], kind, f.metadata.get("choices"), problems)
    return cls(**values)


def _section_class(kind: Any) -> type | None:
    """The dataclass a key holds (a section), also when it is optional (``LoraConfig | None``: null turns it off)."""
    members = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    sections = [member for member in members if isinstance(member, type) and dataclasses.is_dataclass(member)]
    return sections[0] if sections else None


# PyYAML reads YAML 1.1, where "1e-3" (no dot in the mantissa) is a string, not a number as in
# YAML 1.2 and JSON; a float setting takes it as the number everyone means.
_EXPONENT_WITHOUT_DOT = re.compile(r"[-+]?[0-9]+[eE][-+]?[0-9]+")


def _check_value(key: str, value: Any, kind: Any, choices: tuple[str, ...] | None, problems: list[str]) -> Any:
    allowed = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    if value is None:
        if type(None) in allowed:
            return None
        problems.append(f"{key}: null is not allowed; give a {_type_name(allowed)}")
        return None
    for candidate in allowed:
        checked = _as_kind(key, value, candidate, choices, problems)
        if checked is not _NOT_THIS_KIND:
            return checked
    problems.append(f"{key}: expected {_type_name(allowed)}, got {type(value).__name__} {value!r}")
    return None


# What _as_kind gives for a value that is not of the kind asked (None is a valid result).
_NOT_THIS_KIND = object()


def _as_kind(key: str, value: Any, kind: Any, choices: tuple[str, ...] | None, problems: list[str]) -> Any:
    """``value`` taken as one member of a setting's type: a mapping, bool, int, float (from an int or
    YAML 1.1's "1e-3") or str (one of ``choices`` when given); ``_NOT_THIS_KIND`` when it is not one."""
    if typing.get_origin(kind) is dict:
        return _check_mapping(key, value, problems)
    if typing.get_origin(kind) is list:
        return _check_names(key, value, problems)
    if isinstance(value, bool):
        return value if kind is bool else _NOT_THIS_KIND
    if kind is int and isinstance(value, int):
        return value
    if kind is float and (isinstance(value, (int, float)) or _is_exponent_text(value)):
        return float(value)
    if kind is str and isinstance(value, str):
        if choices and value not in choices:
            hint = difflib.get_close_matches(value, choices, n=1)
            extra = f"; did you mean {hint[0]!r}?" if hint else ""
            problems.append(f"{key}: {value!r} is not one of {', '.join(choices)}{extra}")
        return value
    return _NOT_THIS_KIND


def _is_exponent_text(value: Any) -> bool:
    return isinstance(value, str) and _EXPONENT_WITHOUT_DOT.fullmatch(value) is not None


def _check_mapping(key: str, value: Any, problems: list[str]) -> dict[str, float] | None:
    """A mapping of names to non-negative numbers (custom Ray resources)."""
    if not isinstance(value, dict):
        problems.append(f"{key}: expected a mapping of resource names to numbers, got {type(value).__name__} {value!r}")
        return None
    for name, amount in value.items():
        if not isinstance(amount, (int, float)) or isinstance(amount, bool) or amount < 0:
            problems.append(f"{key}.{name}: expected a number >= 0, got {amount!r}")
    return {str(name): float(amount) for name, amount in value.items()}


def _check_names(key: str, value: Any, problems: list[str]) -> list[str] | None:
    """A list of names (one name alone counts as a list of one)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        problems.append(f"{key}: expected a list of names, got {type(value).__name__} {value!r}")
        return None
    return names


def _type_name(allowed: tuple[Any, ...]) -> str:
    names = [
        {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(t, "a mapping")
        for t in allowed
        if t is not type(None)
    ]
    return " or ".join(names)


def _to_dict(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    if dataclasses.is_dataclass(value):
        return {
            _yaml_key(f): _to_dict(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not f.metadata.get("internal")
        }
    return value
