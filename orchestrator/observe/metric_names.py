"""The one list of what meshpilot exports to Prometheus: every metric's name, kind, help and labels.

Plain declarations (driver side, no server): ``metrics.py`` creates them in a registry and
drives them from events; dashboards and alert rules are tested against ``METRICS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "meshpilot_"
MESH_DIMS = ("dp_replicate", "dp_shard", "tp", "pp")

_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_STALL_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TRANSFER_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

# Dense bf16 peak per device, TFLOP/s, matched as a substring of the device name, first match wins.
DEVICE_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
    ("L4", 121.0),
    ("MI300X", 1307.0),
)


@dataclass(frozen=True)
class MetricSpec:
    """One Prometheus metric: its family name (without ``_total``), kind, help text and labels."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    def sample_names(self) -> frozenset[str]:
        """Names as they appear in the exposition and in PromQL."""
        if self.kind == "counter":
            return frozenset({f"{self.name}_total", f"{self.name}_created"})
        if self.kind == "histogram":
            return frozenset(f"{self.name}{suffix}" for suffix in ("_bucket", "_sum", "_count", "_created"))
        return frozenset({self.name})

    def create(self, registry: CollectorRegistry) -> Any:
        if self.kind == "counter":
            return Counter(self.name, self.help, self.labels, registry=registry)
        if self.kind == "gauge":
            return Gauge(self.name, self.help, self.labels, registry=registry)
        assert self.buckets is not None  # every histogram is declared through _histogram, with its buckets
        return Histogram(self.name, self.help, self.labels, registry=registry, buckets=self.buckets)


def _counter(name: str, text: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(PREFIX + name, "counter", text, labels)


def _gauge(name: str, text: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(PREFIX + name, "gauge", text, labels)


def _histogram(name: str, text: str, buckets: tuple[float, ...]) -> MetricSpec:
    return MetricSpec(PREFIX + name, "histogram", text, (), buckets)


# The one list of what meshpilot exports; dashboards and alert rules are tested against it.
METRICS: dict[str, MetricSpec] = {
    # run
    "run_info": _gauge("run_info", "Always 1; labels name the run.", ("name", "config_hash")),
    "running": _gauge("running", "1 while the run trains, 0 once it is done."),
    "run_start_time": _gauge("run_start_timestamp_seconds", "Unix time the run started."),
    "target_steps": _gauge("target_steps", "Optimizer steps the run is configured to reach."),
    # progress
    "step": _gauge("step", "Last completed optimizer step (goes back after a restore)."),
    "steps": _counter("steps", "Optimizer steps completed by this driver, redone steps included."),
    "last_step_time": _gauge(
        "last_step_timestamp_seconds", "Unix time of the last completed step (the run start before the first)."
    ),
    "loss": _gauge("loss", "Training loss of the last step."),
    "eval_loss": _gauge("eval_loss", "Mean token loss on the fixed evaluation samples, last evaluation."),
    "learning_rate": _gauge("learning_rate", "Learning rate of the last step."),
    "grad_norm": _gauge("grad_norm", "Gradient norm of the last step, before clipping."),
    "tokens": _counter("tokens", "Tokens trained on."),
    "trained_tokens": _counter(
        "trained_tokens", "Labels the loss was taken over (tokens whose loss mask trains; all of them unmasked)."
    ),
    "tokens_per_second": _gauge("tokens_per_second", "Throughput of the last step, whole job."),
    "step_time": _histogram("step_time_seconds", "Wall time of one optimizer step.", _STEP_BUCKETS),
    "rank_step_time": _gauge("rank_step_time_seconds", "Last step's time as seen by each rank.", ("rank",)),
    "straggler_ratio": _gauge(
        "straggler_ratio", "Slowest rank's step time over the median rank's, last step (1 = even)."
    ),
    "slowest_rank": _gauge("slowest_rank", "Rank with the longest step time, last step."),
    "expert_load": _gauge(
        "expert_load_max_over_mean",
        "Mixture of experts, last step: per layer, the busiest expert's tokens over the mean expert's "
        "(1 = even), the most uneven data-parallel slice's.",
        ("layer",),
    ),
    "mfu": _gauge("mfu_ratio", "Model FLOPs utilisation estimate, 0..1 (NaN when the device peak is unknown)."),
    "effective_seconds": _gauge(
        "effective_training_seconds", "Wall time spent in completed steps; steps lost to a restore are taken back out."
    ),
    "goodput": _gauge("goodput_ratio", "Effective training time: time in completed steps / wall time since start."),
    # mesh
    "world_size": _gauge("world_size", "Ranks training now."),
    "world_size_min": _gauge("world_size_min", "Smallest world size the job may shrink to (elastic.min_replicas)."),
    "world_size_target": _gauge("world_size_target", "World size the job was configured with."),
    "mesh_degree": _gauge("mesh_degree", "Degree of each parallel dimension of the current mesh.", ("dim",)),
    # checkpoints
    "checkpoint_enabled": _gauge("checkpoint_enabled", "1 when the job writes checkpoints."),
    "checkpoint_interval": _gauge("checkpoint_interval_steps", "Steps between checkpoints."),
    "checkpoint_stall": _histogram(
        "checkpoint_stall_seconds", "Time the training loop stood still to stage a checkpoint.", _STALL_BUCKETS
    ),
    "checkpoint_upload": _histogram(
        "checkpoint_upload_seconds",
        "Time from staging to commit of a checkpoint (in the background).",
        _TRANSFER_BUCKETS,
    ),
    "checkpoint_bytes": _counter("checkpoint_bytes", "Bytes of committed checkpoints."),
    "checkpoint_last_bytes": _gauge("checkpoint_last_bytes", "Size of the last committed checkpoint."),
    "checkpoints": _counter("checkpoints_committed", "Checkpoints committed."),
    # reason="storage": an upload or the commit gave up after retries (look at the object store);
    # reason="interrupted": a failure, drain or grow changed the mesh before every rank's shards
    # were durable, so the save was dropped (the run goes on; nothing is wrong with storage).
    "checkpoint_failures": _counter("checkpoint_failures", "Checkpoints not committed, by reason.", ("reason",)),
    "checkpoint_last_step": _gauge("checkpoint_last_committed_step", "Step of the last committed checkpoint."),
    "checkpoint_last_time": _gauge("checkpoint_last_committed_timestamp_seconds", "Unix time of the last commit."),
    "checkpoint_age": _gauge(
        "checkpoint_age_seconds", "Seconds since the last commit (since the start before the first)."
    ),
    # failures and elasticity
    "failures": _counter("failures", "Failures detected, by kind.", ("kind",)),
    # Unlabelled, so it exists from the start and changes() sees even the first failure.
    "last_failure_time": _gauge("last_failure_timestamp_seconds", "Unix time of the last failure (0 before any)."),
    "recoveries": _counter("recoveries", "Recoveries from a failure completed (in place or from a checkpoint)."),
    "recovery_time": _histogram("recovery_seconds", "Failure to training again (MTTR).", _RECOVERY_BUCKETS),
    "lost_steps": _counter("lost_steps", "Completed steps lost and redone because of failures."),
    "restores": _counter("restores", "Restores from a checkpoint."),
    "restores_by_source": _counter(
        "restores_by_source", "Restores, by where the state came from (peer_memory, storage).", ("source",)
    ),
    "restore_peer_bytes": _counter(
        "restore_peer_bytes", "Bytes restores read from other ranks' memory (peer-memory snapshots)."
    ),
    "snapshot_host_bytes": _gauge(
        "snapshot_host_bytes", "Host memory peer-memory snapshots take on the most loaded rank (0: snapshots off)."
    ),
    "restore_time": _histogram("restore_seconds", "Time to load a checkpoint into the mesh.", _TRANSFER_BUCKETS),
    "drains": _counter("drains", "Nodes drained ahead of a spot reclaim or shutdown."),
    "drain_time": _histogram("drain_seconds", "Drain notice to training again on the smaller mesh.", _RECOVERY_BUCKETS),
    "grows": _counter("grows", "Times the mesh grew back."),
    "stragglers": _counter(
        "stragglers",
        "Ranks found persistently slower than their peers, by what was done (elastic.straggler).",
        ("action",),
    ),
    "grow_time": _histogram(
        "grow_seconds",
        "Pause for a grow to training again on the larger mesh (new ranks joined, state copied from a replica).",
        _RECOVERY_BUCKETS,
    ),
    "heartbeat_age": _gauge("heartbeat_age_seconds", "Oldest heartbeat among the ranks, seconds."),
    "log_messages": _counter("log_messages", "Log messages reported by ranks, by level.", ("level",)),
}


def exported_names() -> frozenset[str]:
    """Every sample name meshpilot exports (``_total``, ``_bucket`` ... included)."""
    return frozenset().union(*(spec.sample_names() for spec in METRICS.values()))


def exported_labels() -> frozenset[str]:
    """Every label name meshpilot puts on its samples, plus what Prometheus adds."""
    labels = {"job", "instance", "le"}
    for spec in METRICS.values():
        labels.update(spec.labels)
    return frozenset(labels)


def peak_flops(configured_tflops: float | None, device_name: str | None = None) -> float | None:
    """Peak FLOP/s of one device: the configured value, else a known device's, else None."""
    if configured_tflops is not None:
        return configured_tflops * 1e12
    for needle, tflops in DEVICE_PEAK_TFLOPS:
        if device_name and needle.lower() in device_name.lower():
            return tflops * 1e12
    return None
