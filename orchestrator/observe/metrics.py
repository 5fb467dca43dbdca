"""Prometheus metrics of a run: names declared in ``metric_names.py``, every value driven by events.

Runs on the driver, and only there: ranks report through the controller, the controller
emits events (``orchestrator/observe/events.py``), and ``MetricsExporter`` is one more subscriber of
the ``EventLog``. So one job is one scrape target, and the metrics, ``events.jsonl`` and the
terminal can never disagree. Usage (in the controller)::

    metrics = build_metrics(config)                  # NullMetrics when metrics.enabled is false
    event_log.subscribe(metrics)
    url = metrics.start_server(config.metrics.host, config.metrics.port)   # port 0: a free one
    ...
    metrics.close()                                  # after the "done" event

Gauges that depend on "now" (goodput, checkpoint age, heartbeat age) are computed when
Prometheus scrapes, so they keep moving while the job is stuck.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import start_wsgi_server

from elastic.straggler import StragglerAction
from orchestrator.errors import UserError
from orchestrator.observe.events import CHECKPOINT_FAILURE_REASONS, checkpoint_failure_reason, is_failure_recovery
from orchestrator.observe.metric_names import MESH_DIMS, METRICS, peak_flops
from workers.spec import ModelSpec

log = logging.getLogger("meshpilot.metrics")


def _mesh_dict(mesh: Any) -> dict[str, int] | None:
    """A mesh as {dim: degree}: subscribers see MeshSpec objects, the file holds dicts."""
    if mesh is None:
        return None
    if hasattr(mesh, "as_dict"):
        return mesh.as_dict()
    if isinstance(mesh, dict):
        return {dim: int(mesh[dim]) for dim in MESH_DIMS if dim in mesh}
    return None


class MetricsExporter:
    """Turns events into Prometheus metrics; an ``EventLog`` subscriber on the driver.

    Construct it with what the estimates need (``from_config`` does it from a JobConfig).
    ``on_event`` is called from the controller's thread, the scrape from the HTTP server's:
    prometheus-client's metrics are thread-safe, the few plain floats here are written whole.
    """

    def __init__(
        self,
        *,
        model: ModelSpec | None = None,
        seq_len: int = 0,
        world_size: int = 0,
        min_world_size: int = 0,
        device_peak_flops: float | None = None,
        checkpoint_interval_steps: int | None = None,
        run_name: str = "",
        targets_dir: str | Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.m = SimpleNamespace(**{key: spec.create(self.registry) for key, spec in METRICS.items()})
        self._flops_per_token = model.flops_per_token(seq_len) if model is not None and seq_len else None
        self._peak_flops = device_peak_flops
        self._clock = clock
        self._run_name = run_name
        self._targets_dir = Path(targets_dir) if targets_dir else None
        self._targets_file: Path | None = None
        self._server: WSGIServer | None = None
        self._server_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Scrape-time state (plain floats, written whole by on_event).
        self._start_time: float | None = None
        self._end_time: float | None = None
        self._last_commit_time: float | None = None
        self._heartbeat_time: float | None = None
        self._heartbeat_extra_age = 0.0
        self._productive = 0.0
        # Step times since the last-but-one commit, so a restore can take lost steps back out
        # of goodput (also one that falls back past a corrupt latest checkpoint).
        self._recent_step_seconds: dict[int, float] = {}
        self._committed_steps: list[int] = []
        self._rank_children: dict[str, Any] = {}
        self._mesh_shown: dict[str, int] | None = None
        self._warned: set[Any] = set()
        m = self.m
        m.world_size.set(world_size)
        m.world_size_target.set(world_size)
        m.world_size_min.set(min_world_size)
        m.checkpoint_enabled.set(1 if checkpoint_interval_steps else 0)
        m.checkpoint_interval.set(checkpoint_interval_steps or 0)
        m.mfu.set(math.nan)
        for reason in CHECKPOINT_FAILURE_REASONS:  # present from the start, so increase() sees the first
            m.checkpoint_failures.labels(reason=reason)
        for action in StragglerAction:  # likewise
            m.stragglers.labels(action=str(action))
        m.goodput.set_function(self._goodput)
        m.checkpoint_age.set_function(self._checkpoint_age)
        m.heartbeat_age.set_function(self._heartbeat_age)

    @classmethod
    def from_config(
        cls, config: Any, *, device_name: str | None = None, clock: Callable[[], float] = time.time
    ) -> MetricsExporter:
        """An exporter sized from a ``JobConfig`` (driver, before the first event)."""
        mesh = config.mesh
        return cls(
            model=config.model_spec,
            seq_len=config.training.seq_len,
            world_size=mesh.world_size,
            min_world_size=config.elastic.min_replicas * mesh.replica_size,
            device_peak_flops=peak_flops(config.metrics.device_peak_tflops, device_name),
            checkpoint_interval_steps=config.checkpoint.interval_steps if config.checkpoint.uri else None,
            run_name=config.name,
            targets_dir=config.metrics.targets_dir,
            clock=clock,
        )

    # ------------------------------------------------------------------ events
    def on_event(self, event: dict[str, Any]) -> None:
        handler = getattr(self, f"_on_{event.get('event')}", None)
        if handler is None:
            return
        try:
            handler(event)
        except Exception as error:  # noqa: BLE001 - a metrics bug must never stop training
            kind = event.get("event")
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning(
                    "metrics: cannot use a %r event (%s: %s); its metrics may be stale",
                    kind,
                    type(error).__name__,
                    error,
                )

    def _on_start(self, event: dict[str, Any]) -> None:
        m, now = self.m, float(event["time"])
        self._start_time = self._heartbeat_time = now
        self._end_time = None
        m.run_info.labels(
            name=str(event.get("name") or self._run_name), config_hash=str(event.get("config_hash") or "")
        ).set(1)
        m.running.set(1)
        m.run_start_time.set(now)
        m.last_step_time.set(now)
        if event.get("steps") is not None:
            m.target_steps.set(event["steps"])
        if event.get("world_size"):
            m.world_size_target.set(event["world_size"])
        self._set_mesh(event.get("mesh"), event.get("world_size"))

    def _on_step(self, event: dict[str, Any]) -> None:
        m, now = self.m, float(event["time"])
        step_time = float(event.get("step_time_s") or 0.0)
        tokens = int(event.get("tokens") or 0)
        m.step.set(event["step"])
        m.steps.inc()
        m.last_step_time.set(now)
        self._heartbeat_time, self._heartbeat_extra_age = now, 0.0  # every rank just reported
        if event.get("loss") is not None:
            m.loss.set(event["loss"])
        if event.get("lr") is not None:
            m.learning_rate.set(event["lr"])
        if event.get("grad_norm") is not None:
            m.grad_norm.set(event["grad_norm"])
        m.tokens.inc(tokens)
        m.trained_tokens.inc(int(event.get("trained_tokens") or 0))
        m.step_time.observe(step_time)
        self._productive += step_time
        m.effective_seconds.set(self._productive)
        self._recent_step_seconds[int(event["step"])] = step_time
        world_size = event.get("world_size")
        self._set_mesh(event.get("mesh"), world_size)
        if step_time > 0:
            throughput = tokens / step_time
            m.tokens_per_second.set(throughput)
            if self._flops_per_token and self._peak_flops and world_size:
                m.mfu.set(throughput * self._flops_per_token / (world_size * self._peak_flops))
        self._set_rank_times(event.get("rank_step_time_s"))
        for layer, ratio in (event.get("expert_load_max_over_mean") or {}).items():
            m.expert_load.labels(layer=layer).set(ratio)

    def _on_eval(self, event: dict[str, Any]) -> None:
        self.m.eval_loss.set(event["loss"])

    def _on_checkpoint_staged(self, event: dict[str, Any]) -> None:
        self.m.checkpoint_stall.observe(float(event.get("stall_s") or 0.0))

    def _on_checkpoint_committed(self, event: dict[str, Any]) -> None:
        m, now = self.m, float(event["time"])
        size = int(event.get("bytes") or 0)
        m.checkpoints.inc()
        m.checkpoint_bytes.inc(size)
        m.checkpoint_last_bytes.set(size)
        m.checkpoint_last_step.set(event["step"])
        m.checkpoint_last_time.set(now)
        if event.get("upload_s") is not None:
            m.checkpoint_upload.observe(float(event["upload_s"]))
        self._last_commit_time = now
        self._committed_steps = [*self._committed_steps[-1:], int(event["step"])]
        if len(self._committed_steps) == 2:
            oldest_kept = self._committed_steps[0]
            self._recent_step_seconds = {
                step: seconds for step, seconds in self._recent_step_seconds.items() if step > oldest_kept
            }

    def _on_checkpoint_failed(self, event: dict[str, Any]) -> None:
        self.m.checkpoint_failures.labels(reason=checkpoint_failure_reason(event)).inc()

    def _on_restored(self, event: dict[str, Any]) -> None:
        m = self.m
        m.restores.inc()
        m.restores_by_source.labels(source=str(event.get("source") or "storage")).inc()
        m.restore_peer_bytes.inc(int(event.get("bytes_from_peers") or 0))
        if event.get("restore_s") is not None:
            m.restore_time.observe(float(event["restore_s"]))
        restored_step = int(event["step"])
        m.step.set(restored_step)
        # Steps after the restored one were done for nothing: they leave the productive time.
        lost = [s for step, s in self._recent_step_seconds.items() if step > restored_step]
        self._productive -= sum(lost)
        m.effective_seconds.set(self._productive)
        self._recent_step_seconds = {step: s for step, s in self._recent_step_seconds.items() if step <= restored_step}
        self._set_mesh(event.get("to_mesh"), None)

    def _on_snapshot_memory(self, event: dict[str, Any]) -> None:
        self.m.snapshot_host_bytes.set(float(event["max_bytes"]))

    def _on_failure(self, event: dict[str, Any]) -> None:
        self.m.failures.labels(kind=str(event.get("kind") or "unknown")).inc()
        self.m.last_failure_time.set(float(event["time"]))

    def _on_recovered(self, event: dict[str, Any]) -> None:
        """Training again after a mesh change; ``cause`` says what changed it.

        The controller also reports the end of a drain's pause, and of a grow's pause that
        ended without growing, as ``recovered``: those are no failures, so they stay out of
        the recovery count and MTTR (a drain's pause has its own histogram).
        """
        m = self.m
        seconds = event.get("mttr_s")
        if is_failure_recovery(event):  # in place, or by a restore from a checkpoint
            m.recoveries.inc()
            if seconds is not None:
                m.recovery_time.observe(float(seconds))
        elif event.get("cause") == "drain" and seconds is not None:
            m.drain_time.observe(float(seconds))
        m.lost_steps.inc(int(event.get("lost_steps") or 0))
        self._set_mesh(event.get("new_mesh"), None)
        self._heartbeat_time, self._heartbeat_extra_age = float(event["time"]), 0.0

    def _on_drain(self, event: dict[str, Any]) -> None:
        self.m.drains.inc()

    def _on_straggler(self, event: dict[str, Any]) -> None:
        self.m.stragglers.labels(action=str(event.get("action"))).inc()

    def _on_grow(self, event: dict[str, Any]) -> None:
        self.m.grows.inc()
        if event.get("join_s") is not None:
            self.m.grow_time.observe(float(event["join_s"]))
        self._set_mesh(event.get("new_mesh"), None)
        self._heartbeat_time, self._heartbeat_extra_age = float(event["time"]), 0.0

    def _on_heartbeat(self, event: dict[str, Any]) -> None:
        ages = event.get("rank_age_s") or {}
        self._heartbeat_extra_age = max((float(age) for age in ages.values()), default=0.0)
        self._heartbeat_time = float(event["time"])

    def _on_log(self, event: dict[str, Any]) -> None:
        self.m.log_messages.labels(level=str(event.get("level") or "INFO").upper()).inc()

    def _on_done(self, event: dict[str, Any]) -> None:
        self.m.running.set(0)
        self._end_time = float(event["time"])

    # ----------------------------------------------------------------- helpers
    def _set_mesh(self, mesh: Any, world_size: int | None) -> None:
        degrees = _mesh_dict(mesh)
        if degrees:
            if degrees != self._mesh_shown:  # every step carries the mesh; it rarely changes
                for dim, degree in degrees.items():
                    self.m.mesh_degree.labels(dim=dim).set(degree)
                self._mesh_shown = degrees
            if world_size is None:
                world_size = math.prod(degrees.values())
        if world_size:
            self.m.world_size.set(world_size)

    def _set_rank_times(self, rank_times: dict[Any, float] | None) -> None:
        if not rank_times:
            return
        gauge = self.m.rank_step_time
        children = self._rank_children  # labels() validates and locks: look each rank up once
        slowest_rank, slowest = None, -1.0
        for rank, seconds in rank_times.items():
            label = str(rank)
            child = children.get(label)
            if child is None:
                child = children[label] = gauge.labels(rank=label)
            child.set(seconds)
            if seconds > slowest:
                slowest_rank, slowest = label, seconds
        if len(children) != len(rank_times):  # ranks that left the mesh stop being drawn
            shown = {str(rank) for rank in rank_times}
            for gone in [label for label in children if label not in shown]:
                gauge.remove(gone)
                del children[gone]
        # Step times are >= 0, so the first rank already beat -1.0.
        assert slowest_rank is not None
        median = statistics.median(rank_times.values())
        self.m.straggler_ratio.set(slowest / median if median > 0 else 1.0)
        self.m.slowest_rank.set(int(slowest_rank) if slowest_rank.isdigit() else -1)

    def _now(self) -> float:
        return self._end_time if self._end_time is not None else self._clock()

    def _goodput(self) -> float:
        if self._start_time is None:
            return 0.0
        wall = self._now() - self._start_time
        return min(1.0, max(0.0, self._productive / wall)) if wall > 0 else 0.0

    def _checkpoint_age(self) -> float:
        since = self._last_commit_time if self._last_commit_time is not None else self._start_time
        return max(0.0, self._now() - since) if since is not None else 0.0

    def _heartbeat_age(self) -> float:
        if self._heartbeat_time is None:
            return 0.0
        return max(0.0, self._now() - self._heartbeat_time) + self._heartbeat_extra_age

    # -------------------------------------------------------------- exposition
    def render(self) -> bytes:
        """The exposition text, as the HTTP endpoint serves it."""
        return generate_latest(self.registry)

    def start_server(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve ``/metrics`` on host:port (0 = a free port) in a daemon thread; return the URL.

        Binds loopback unless the config asks for another address (``metrics.host: 0.0.0.0``
        for every interface, e.g. in a pod). When ``metrics.targets_dir`` is set, also writes a
        Prometheus file_sd target there so Prometheus finds a port picked at random.
        """
        with self._lock:
            if self._server is not None:
                raise RuntimeError("the metrics server is already running")
            try:
                self._server, self._server_thread = start_wsgi_server(port, addr=host, registry=self.registry)
            except OSError as error:
                raise UserError(
                    f"cannot serve metrics on metrics.host={host!r}, metrics.port={port}: "
                    f"{error.strerror or error}; pick a free port (0 = any free one) or "
                    "an address of this machine"
                ) from None
            bound_port = self._server.server_port
        try:
            self._write_target(host, bound_port)
        except OSError as error:
            self.close()
            raise UserError(
                f"metrics.targets_dir={str(self._targets_dir)!r}: cannot write the scrape target "
                f"there ({error.strerror or error}); give a writable directory or null"
            ) from None
        shown_host = f"[{host}]" if ":" in host else host
        return f"http://{shown_host}:{bound_port}/metrics"

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server is not None else None

    def close(self) -> None:
        """Stop serving and withdraw the file_sd target; safe to call twice."""
        with self._lock:
            server, self._server = self._server, None
            thread, self._server_thread = self._server_thread, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)
        if self._targets_file is not None:
            self._targets_file.unlink(missing_ok=True)
            self._targets_file = None

    def _write_target(self, host: str, port: int) -> None:
        if self._targets_dir is None:
            return
        reachable = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        if ":" in reachable:
            reachable = f"[{reachable}]"
        self._targets_dir.mkdir(parents=True, exist_ok=True)
        target = [{"targets": [f"{reachable}:{port}"], "labels": {"run": self._run_name or "meshpilot"}}]
        path = self._targets_dir / f"meshpilot-{os.getpid()}-{port}.json"
        scratch = path.with_suffix(".tmp")
        scratch.write_text(json.dumps(target), encoding="utf-8")
        os.replace(scratch, path)  # Prometheus must never read half a file
        self._targets_file = path


class NullMetrics:
    """Metrics turned off: the same interface, nothing served, nothing counted."""

    registry = None
    port = None

    def on_event(self, event: dict[str, Any]) -> None:
        pass

    def render(self) -> bytes:
        return b""

    def start_server(self, host: str = "127.0.0.1", port: int = 0) -> None:
        return None

    def close(self) -> None:
        pass


def build_metrics(config: Any, *, device_name: str | None = None) -> MetricsExporter | NullMetrics:
    """The exporter the config asks for (driver)."""
    if not config.metrics.enabled:
        return NullMetrics()
    return MetricsExporter.from_config(config, device_name=device_name)
