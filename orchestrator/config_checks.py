"""The checks of a built job config against itself and the filesystem.

Runs on the driver. ``orchestrator.config`` builds a ``JobConfig`` with every key and type
checked generically, then calls ``validate`` here for the rules that relate values to each
other: signs and ranges, the model's shape against the mesh and schedule, the batch against
the pipeline, the elastic bounds, the checkpoint and run record URIs. ``resolve_data_path`` lives here
because ``data.path`` is checked against the disk, and the config hash reads the same file; a
token corpus (``data.source: tokens``) is checked against its manifest by ``token_corpus``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic.spec import CpMethod, ulysses_heads_problem
from orchestrator.observe.tracking import tracking_problems
from orchestrator.token_corpus import token_corpus_problems
from workers.spec.pipeline import microbatches_problem, stages_per_rank_problem

if TYPE_CHECKING:
    # Only for annotations: ``orchestrator.config`` imports this module to run ``validate``.
    from orchestrator.config import JobConfig
    from workers.spec import ModelSpec

_POSITIVE_KEYS = (
    "parallelism.dp_replicate",
    "parallelism.dp_shard",
    "parallelism.tp",
    "parallelism.pp",
    "parallelism.cp",
    "parallelism.microbatches",
    "parallelism.ep",
    "training.steps",
    "training.global_batch",
    "training.seq_len",
    "checkpoint.interval_steps",
    "checkpoint.keep_last",
    "checkpoint.part_size_mb",
    "checkpoint.upload_concurrency",
    "checkpoint.max_in_flight",
    "elastic.min_replicas",
    "elastic.snapshot_memory_limit_mb",
    "eval.batches",
)
_NON_NEGATIVE_KEYS = (
    "training.lr",
    "training.warmup_steps",
    "training.weight_decay",
    "training.grad_clip",
    "training.seed",
    "checkpoint.keep_every",
    "elastic.spare_actors",
    "elastic.snapshot_interval_steps",
    "runtime.cpus_per_rank",
    "eval.interval_steps",
)
_ELASTIC_DURATION_KEYS = (
    "heartbeat_timeout_s",
    "hang_timeout_s",
    "compile_timeout_s",
    "collective_timeout_s",
    "failure_window_s",
    "instance_action_poll_s",
)


def validate(config: JobConfig) -> list[str]:
    """Cross-field checks; returns sentences naming key, value and reason."""
    problems: list[str] = []
    _positive(problems, config, _POSITIVE_KEYS)
    _non_negative(problems, config, _NON_NEGATIVE_KEYS)
    if problems:
        return problems
    model = config.model_spec
    problems.extend(model.problems())
    problems.extend(_parallelism_problems(config, model, check_mesh=not problems))
    problems.extend(_training_and_data_problems(config, model))
    problems.extend(_elastic_problems(config))
    if config.eval.at_start and config.eval.interval_steps == 0:
        problems.append(
            "eval.at_start=true does nothing while eval.interval_steps=0 (evaluation off): "
            "set eval.interval_steps to a number of steps, or eval.at_start=false"
        )
    if not 0 <= config.metrics.port <= 65535:
        problems.append(f"metrics.port={config.metrics.port} must lie in 0..65535 (0 picks a free port)")
    problems.extend(_gpus_per_rank_problems(config))
    problems.extend(_float8_problems(config))
    problems.extend(_compile_problems(config, model))
    problems.extend(tracking_problems(config))
    if config.checkpoint.uri is not None:
        problems.extend(uri_problems(config.checkpoint.uri, "checkpoint.uri"))
    if config.runtime.run_dir is not None:
        problems.extend(uri_problems(config.runtime.run_dir, "runtime.run_dir"))
    if config.runtime.run_dir_sync_s <= 0:
        problems.append(f"runtime.run_dir_sync_s={config.runtime.run_dir_sync_s} must be > 0")
    if config.runtime.driver_lease_s <= 0:
        problems.append(
            f"runtime.driver_lease_s={config.runtime.driver_lease_s:g} must be > 0 (seconds the ranks "
            "wait for a driver before they exit)"
        )
    return problems


def _gpus_per_rank_problems(config: JobConfig) -> list[str]:
    """A rank drives no GPU (gloo) or exactly one (NCCL): the only layouts the ranks support.

    NCCL refuses two ranks of one communicator on the same GPU, so a fraction fails at the
    first collective; tensor parallelism is laid out one rank per GPU, so a rank given two
    leaves one idle. Both are caught here, before any actor is placed.
    """
    runtime = config.runtime
    gpus = runtime.gpus_per_rank
    if gpus not in (0, 1):
        return [
            f"runtime.gpus_per_rank={gpus:g} must be 0 (CPU ranks, gloo) or 1 (one GPU per rank, NCCL): "
            "NCCL refuses two ranks on one GPU, and a rank drives exactly one GPU (more GPUs: more ranks, "
            "e.g. a larger parallelism.tp or dp_shard); set runtime.gpus_per_rank=1"
        ]
    if runtime.backend == "nccl" and gpus == 0:
        return ["runtime.backend=nccl needs runtime.gpus_per_rank > 0 (NCCL runs on GPUs): set runtime.gpus_per_rank=1"]
    return []


def _compile_problems(config: JobConfig, model: ModelSpec) -> list[str]:
    """``training.compile`` against what compiled blocks are known to train right with (``workers.compile``)."""
    if not config.training.compile:
        return []
    if model.expert_params_per_layer > 0:
        # A routed block's data-dependent token counts break its graph: on CPU it compiled for minutes.
        return [
            f"training.compile=true cannot run with model.family={model.family} (a mixture of experts) yet "
            "(compiled blocks train dense models with FSDP2, tp, pp, cp and activation checkpointing): "
            "set training.compile=false"
        ]
    return []


def _float8_problems(config: JobConfig) -> list[str]:
    """``training.float8`` against where the ranks run and what it composes with (``workers.float8``).

    On CPU ranks that is the only float8 problem said: the others would not matter there. A CUDA
    GPU below compute capability 8.9, or a node without torchao, is found by the ranks (the driver
    does not see the GPUs), which refuse it with one line.
    """
    if not config.training.float8:
        return []
    if config.runtime.gpus_per_rank == 0:
        return [
            "training.float8=true needs CUDA GPUs of compute capability 8.9 or higher (Ada, Hopper or newer); "
            "this job's ranks run on the CPU (runtime.gpus_per_rank=0, gloo): set training.float8=false, "
            "or runtime.gpus_per_rank=1 on such GPUs"
        ]
    par = config.parallelism
    unsupported = {
        # torchao's float8 tensor-parallel styles (Float8ColwiseParallel, ...) are not in the families' plans.
        f"parallelism.tp={par.tp}": par.tp > 1,
        # Not built: which of a frozen base's layers and its adapters would train in float8 is untried.
        "model.lora": config.model.lora is not None,
        # Each step's scales are reduced where the shards live: in host memory, which NCCL does not reduce.
        "parallelism.cpu_offload=true": par.cpu_offload,
    }
    return [
        f"training.float8=true cannot run with {setting} (float8 trains with FSDP2, pp, cp and ep, tp=1, no LoRA, "
        "no cpu_offload): change it, or set training.float8=false"
        for setting, refused in unsupported.items()
        if refused
    ]


def _training_and_data_problems(config: JobConfig, model: ModelSpec) -> list[str]:
    """The sequence and schedule against the model, and the data source against the vocabulary and disk."""
    train = config.training
    problems = model.sequence_problems(train.seq_len)
    if not 0.0 <= train.min_lr_ratio <= 1.0:
        problems.append(f"training.min_lr_ratio={train.min_lr_ratio} must lie in [0, 1]")
    if config.data.source == "text":
        if model.vocab_size < 256:
            problems.append(
                f"model.vocab_size={model.vocab_size} must be >= 256 for data.source=text (byte-level tokens)"
            )
        if resolve_data_path(config) is None:
            problems.append(
                f"data.path={config.data.path!r}: no such file (looked in the current directory"
                + (f" and {config.source_dir}" if config.source_dir else "")
                + ")"
            )
    if config.data.source == "tokens":
        problems.extend(token_corpus_problems(config, model))
    return problems + _packing_layout_problems(config)


def _packing_layout_problems(config: JobConfig) -> list[str]:
    """``data.packing: documents`` against the source and the layout (after the corpus set its default)."""
    packing, source = config.data.packing, config.data.source
    if packing != "documents":
        return []
    if source != "tokens":
        return [
            f"data.packing=documents needs data.source=tokens (a corpus from meshpilot data prepare, which keeps "
            f"document boundaries); data.source={source} has none: remove data.packing or prepare a corpus"
        ]
    if config.parallelism.pp > 1:
        return [
            f"data.packing=documents cannot run with parallelism.pp={config.parallelism.pp}: pipeline stages pass "
            "only hidden states, not the document boundaries attention needs; set parallelism.pp=1 or "
            "data.packing=windows"
        ]
    return []


def _elastic_problems(config: JobConfig) -> list[str]:
    """The replica bounds against the starting mesh, and every elastic duration > 0."""
    par, el = config.parallelism, config.elastic
    problems: list[str] = []
    if el.max_replicas is not None and el.max_replicas < par.dp_replicate:
        problems.append(f"elastic.max_replicas={el.max_replicas} is below parallelism.dp_replicate={par.dp_replicate}")
    if el.min_replicas > par.dp_replicate:
        problems.append(f"elastic.min_replicas={el.min_replicas} exceeds parallelism.dp_replicate={par.dp_replicate}")
    for key in _ELASTIC_DURATION_KEYS:
        if getattr(el, key) <= 0:
            problems.append(f"elastic.{key}={getattr(el, key)} must be > 0")
    if not 0.0 <= el.snapshot_overhead_limit < 1.0:
        problems.append(
            f"elastic.snapshot_overhead_limit={el.snapshot_overhead_limit} must lie in [0, 1): the fraction of step "
            "time snapshots may cost (0: no limit)"
        )
    problems.extend(_snapshot_memory_problems(config))
    problems.extend(_straggler_problems(config))
    return problems


def _straggler_problems(config: JobConfig) -> list[str]:
    """``elastic.straggler``: a factor above 1 (at or under 1 every rank would be slow) and a window of steps."""
    straggler = config.elastic.straggler
    problems = []
    if straggler.factor <= 1:
        problems.append(
            f"elastic.straggler.factor={straggler.factor:g} must be > 1: a rank is a straggler when its compute "
            "takes more than factor x its peers' median (e.g. elastic.straggler.factor=2)"
        )
    if straggler.window_steps < 1:
        problems.append(f"elastic.straggler.window_steps={straggler.window_steps} must be >= 1")
    return problems


# Bytes of state per parameter a snapshot holds: the float32 parameter and AdamW's two moments.
SNAPSHOT_BYTES_PER_PARAM = 12
# Snapshots a rank holds: two of its own state and two of its buddy's.
SNAPSHOTS_HELD = 4


def _trained_params(config: JobConfig) -> int:
    """The parameters whose state a snapshot holds: every one, or with LoRA only the adapters (the
    frozen base is re-read from its source, never snapshotted)."""
    model = config.model_spec
    if config.model.lora is None:
        return model.num_params
    lora = config.model.lora.spec()
    return model.n_layers * model.adapter_params_per_layer(lora.target_modules, lora.rank)


def _snapshot_memory_problems(config: JobConfig) -> list[str]:
    """Peer-memory snapshots that cannot fit ``elastic.snapshot_memory_limit_mb``, estimated from
    the model's size (the ranks check their exact layout again when they start)."""
    el, mesh = config.elastic, config.mesh
    if el.snapshot_interval_steps <= 0 or el.snapshot_memory_limit_mb is None or el.snapshot_memory_limit_mb <= 0:
        return []
    state = SNAPSHOT_BYTES_PER_PARAM * _trained_params(config) / (mesh.fsdp_shards * mesh.tp * mesh.pp)
    needed = SNAPSHOTS_HELD * state
    if needed <= el.snapshot_memory_limit_mb * 2**20:
        return []
    return [
        f"elastic.snapshot_memory_limit_mb={el.snapshot_memory_limit_mb} is too small for peer-memory snapshots: "
        f"each rank holds about {needed / 2**20:.1f} MiB ({SNAPSHOTS_HELD // 2} snapshots of its "
        f"{state / 2**20:.1f} MiB share of parameters and optimizer state, and as many of its buddy's); raise the "
        "limit, shard the state over more ranks (dp_shard, tp, pp), or set elastic.snapshot_interval_steps=0"
    ]


def _parallelism_problems(config: JobConfig, model: ModelSpec, *, check_mesh: bool) -> list[str]:
    """The schedule's own rules, then the mesh against model and batch (when ``check_mesh`` and the
    rules hold: a mesh checked against a broken model or schedule only repeats the same problem)."""
    par, train = config.parallelism, config.training
    problems: list[str] = []
    if par.stages_per_rank is not None and par.stages_per_rank < 1:
        problems.append(f"parallelism.stages_per_rank={par.stages_per_rank} must be >= 1")
    else:
        problems.extend(_schedule_problems(config))
    problems.extend(_expert_parallel_problems(config, model))
    problems.extend(_cp_method_problems(config, model))
    if check_mesh and not problems:
        shape_from = config.model.hf_config or config.model.init_from
        prefix = f"parallelism (model shape from {shape_from}): " if shape_from else "parallelism: "
        problems.extend(
            prefix + p
            for p in config.mesh.check_divides(
                n_heads=model.n_heads,
                n_kv_heads=model.n_kv_heads,
                n_layers=model.n_layers,
                ffn_dim=model.tp_split_ffn_dim,
                global_batch=train.global_batch,
                microbatches=par.microbatches,
                seq_len=train.seq_len,
                stages_per_rank=par.virtual_stages,
            )
        )
    return problems


def _cp_method_problems(config: JobConfig, model: ModelSpec) -> list[str]:
    """``parallelism.cp_method: ulysses`` splits heads over cp: the model's heads per tp rank must
    allow it (``elastic.spec.ulysses_heads_problem``). The other methods take any heads; every
    method's sequence rule (2 x cp chunks) is the mesh's own check."""
    par = config.parallelism
    if par.cp == 1 or par.cp_method != CpMethod.ULYSSES or model.n_heads % par.tp or model.n_kv_heads % par.tp:
        return []  # a tp that does not divide the heads is the mesh check's line
    problem = ulysses_heads_problem(n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, tp=par.tp, cp=par.cp)
    if problem is None:
        return []
    return [
        f"parallelism.cp_method=ulysses splits attention heads over cp: {problem}; "
        "choose another parallelism.cp, or parallelism.cp_method ring or allgather"
    ]


def _schedule_problems(config: JobConfig) -> list[str]:
    """The pipeline schedule's own rules (``workers.spec.pipeline``: torch's for each schedule).

    The zero-bubble schedules' split backward runs with FSDP2 (any dp_shard), tp and activation
    checkpointing alike (tests/ranks/test_pipeline_training.py), so no combination is refused here.
    """
    par = config.parallelism
    problem = stages_per_rank_problem(par.pp_schedule, par.virtual_stages)
    if problem is None and par.pp > 1:
        problem = microbatches_problem(
            par.pp_schedule, pp=par.pp, stages_per_rank=par.virtual_stages, microbatches=par.microbatches
        )
    return [problem] if problem else []


def resolve_data_path(config: JobConfig) -> Path | None:
    candidates = [Path(config.data.path)]
    if config.source_dir and not Path(config.data.path).is_absolute():
        candidates.append(Path(config.source_dir) / config.data.path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    return None


def uri_problems(uri: str, key: str) -> list[str]:
    """What is wrong with a storage location given as ``key`` (s3://, file:// or a directory); [] when fine."""
    if uri.startswith("s3:") and not uri.startswith("s3://"):
        return [f"{key}={uri!r}: write s3://BUCKET/PREFIX (two slashes after s3:)"]
    if uri.startswith("s3://"):
        bucket = uri[len("s3://") :].split("/", 1)[0]
        if not bucket:
            return [f"{key}={uri!r}: no bucket; write s3://BUCKET/PREFIX"]
        return []
    if "://" in uri and not uri.startswith("file://"):
        scheme = uri.split("://", 1)[0]
        return [f"{key}={uri!r}: scheme {scheme!r} is not supported; use s3://, file:// or a directory"]
    return []


def _lookup(config: JobConfig, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def _positive(problems: list[str], config: JobConfig, keys: tuple[str, ...]) -> None:
    for key in keys:
        value = _lookup(config, key)
        if value is not None and value < 1:
            problems.append(f"{key}={value} must be >= 1")


def _non_negative(problems: list[str], config: JobConfig, keys: tuple[str, ...]) -> None:
    for key in keys:
        value = _lookup(config, key)
        if value is not None and value < 0:
            problems.append(f"{key}={value} must be >= 0")


def _expert_parallel_problems(config: JobConfig, model: ModelSpec) -> list[str]:
    """``parallelism.ep`` splits a model's routed experts over ranks borrowed from dp_shard: the
    model says whether it has experts to split that many ways, the mesh whether dp_shard does."""
    ep, dp_shard = config.parallelism.ep, config.parallelism.dp_shard
    if ep == 1:
        return []
    problems = []
    # A model without experts has no split to fit into dp_shard: its own problem says so.
    if dp_shard % ep and model.expert_params_per_layer:
        problems.append(
            f"parallelism.ep={ep} must divide parallelism.dp_shard={dp_shard}: the experts are split over ranks "
            "of dp_shard; choose an ep that divides it"
        )
    model_problem = model.expert_parallel_problem(ep, "parallelism.ep")
    return problems + ([model_problem] if model_problem else [])
