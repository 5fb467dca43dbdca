"""The Prometheus exporter: what a scrape shows after a run's events (no Ray, no torch)."""

from __future__ import annotations

import json
import math
import statistics
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from checkpointing.spec import FailureReport, ShardReport
from elastic.spec import MeshSpec
from orchestrator.config import config_from_dict
from orchestrator.driver.checkpoint_commits import DriverCheckpoints
from orchestrator.errors import UserError
from orchestrator.observe.events import EventLog, read_events
from orchestrator.observe.metric_names import METRICS, exported_names, peak_flops
from orchestrator.observe.metrics import MetricsExporter, NullMetrics, build_metrics
from tests.fixtures.synthetic_events import CHECKPOINT_BYTES, START_TIME, TOKENS_PER_STEP, synthetic_run
from workers.spec import PRESETS, CheckpointUploadReport


class FakeClock:
    def __init__(self, now: float = START_TIME) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def scrape(exporter: MetricsExporter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of one scrape as {(name, sorted labels): value}."""
    samples = {}
    for family in text_string_to_metric_families(exporter.render().decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, /, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def fed_exporter(events, **kwargs) -> MetricsExporter:
    exporter = MetricsExporter(
        model=PRESETS["debug"],
        seq_len=128,
        world_size=8,
        min_world_size=4,
        checkpoint_interval_steps=10,
        run_name="synthetic",
        **kwargs,
    )
    for event in events:
        exporter.on_event(event)
    return exporter


def test_synthetic_run_counts_what_happened():
    events = synthetic_run()
    samples = scrape(fed_exporter(events, clock=FakeClock(events[-1]["time"] + 50)))
    step_events = [e for e in events if e["event"] == "step"]
    last = step_events[-1]

    assert value(samples, "meshpilot_steps_total") == len(step_events) == 62  # 2 steps redone after a restore
    assert value(samples, "meshpilot_step") == 60
    assert value(samples, "meshpilot_target_steps") == 60
    assert value(samples, "meshpilot_loss") == last["loss"]
    assert value(samples, "meshpilot_grad_norm") == last["grad_norm"]
    assert value(samples, "meshpilot_learning_rate") == last["lr"]
    assert value(samples, "meshpilot_tokens_total") == 62 * TOKENS_PER_STEP
    assert value(samples, "meshpilot_tokens_per_second") == pytest.approx(TOKENS_PER_STEP / last["step_time_s"])
    assert value(samples, "meshpilot_step_time_seconds_count") == 62
    assert value(samples, "meshpilot_step_time_seconds_sum") == pytest.approx(
        sum(e["step_time_s"] for e in step_events)
    )
    # Mesh after the drain: one replica of pp=2 x tp=2 left.
    assert value(samples, "meshpilot_world_size") == 4
    assert value(samples, "meshpilot_world_size_min") == 4
    assert value(samples, "meshpilot_world_size_target") == 8
    assert value(samples, "meshpilot_mesh_degree", dim="dp_replicate") == 1
    assert value(samples, "meshpilot_mesh_degree", dim="tp") == 2
    # Checkpoints at 10, 20, 40, 50, 60; the upload at 30 failed.
    assert value(samples, "meshpilot_checkpoints_committed_total") == 5
    assert value(samples, "meshpilot_checkpoint_bytes_total") == 5 * CHECKPOINT_BYTES
    assert value(samples, "meshpilot_checkpoint_last_bytes") == CHECKPOINT_BYTES
    assert value(samples, "meshpilot_checkpoint_failures_total", reason="storage") == 1
    assert value(samples, "meshpilot_checkpoint_failures_total", reason="interrupted") == 0
    assert value(samples, "meshpilot_checkpoint_last_committed_step") == 60
    assert value(samples, "meshpilot_checkpoint_stall_seconds_count") == 6
    assert value(samples, "meshpilot_checkpoint_upload_seconds_count") == 5
    # Failures, recoveries, elasticity.
    assert value(samples, "meshpilot_failures_total", kind="actor_died") == 1
    assert value(samples, "meshpilot_failures_total", kind="node_died") == 1
    assert value(samples, "meshpilot_recoveries_total") == 2  # the drain's pause is no recovery
    assert value(samples, "meshpilot_drain_seconds_count") == 1
    assert value(samples, "meshpilot_drain_seconds_sum") == pytest.approx(0.3)
    assert value(samples, "meshpilot_grow_seconds_sum") == pytest.approx(1.5)
    assert (
        value(samples, "meshpilot_last_failure_timestamp_seconds")
        == [e for e in events if e["event"] == "failure"][-1]["time"]
    )
    assert value(samples, "meshpilot_recovery_seconds_sum") == pytest.approx(3.0 + 8.5)
    assert value(samples, "meshpilot_recovery_seconds_bucket", le="5.0") == 1
    assert value(samples, "meshpilot_lost_steps_total") == 2
    assert value(samples, "meshpilot_restores_total") == 1
    assert value(samples, "meshpilot_drains_total") == 1
    assert value(samples, "meshpilot_grows_total") == 1
    assert value(samples, "meshpilot_log_messages_total", level="WARNING") == 1
    assert value(samples, "meshpilot_running") == 0
    assert value(samples, "meshpilot_run_info", name="synthetic", config_hash="0123456789abcdef") == 1


def test_per_rank_step_time_and_straggler():
    events = synthetic_run(straggler_rank=3)
    samples = scrape(fed_exporter(events))
    rank_times = [e for e in events if e["event"] == "step"][-1]["rank_step_time_s"]
    shown = {dict(labels)["rank"] for name, labels in samples if name == "meshpilot_rank_step_time_seconds"}
    assert shown == {"0", "1", "2", "3"}  # ranks 4..7 left with the drain and are no longer drawn
    assert value(samples, "meshpilot_rank_step_time_seconds", rank="3") == rank_times[3]
    assert value(samples, "meshpilot_slowest_rank") == 3
    assert value(samples, "meshpilot_straggler_ratio") == pytest.approx(
        rank_times[3] / statistics.median(rank_times.values())
    )


def test_goodput_counts_completed_steps_and_takes_back_lost_ones():
    events = synthetic_run()
    done = events[-1]["time"]
    samples = scrape(fed_exporter(events, clock=FakeClock(done + 1000)))  # frozen at "done"
    restored_at = next(i for i, e in enumerate(events) if e["event"] == "restored")
    productive = sum(
        e["step_time_s"]
        for i, e in enumerate(events)
        if e["event"] == "step" and not (i < restored_at and e["step"] > 50)
    )  # steps 51, 52 before the restore were lost
    assert value(samples, "meshpilot_effective_training_seconds") == pytest.approx(productive)
    assert value(samples, "meshpilot_goodput_ratio") == pytest.approx(productive / (done - START_TIME))
    assert 0.5 < value(samples, "meshpilot_goodput_ratio") < 1.0


def test_mfu_uses_flops_per_token_over_device_peak():
    model = PRESETS["llama3-1b"]
    exporter = MetricsExporter(
        model=model, seq_len=2048, world_size=4, device_peak_flops=peak_flops(None, "NVIDIA H100 80GB HBM3")
    )
    exporter.on_event({"event": "start", "time": 0.0, "world_size": 4})
    exporter.on_event(
        {"event": "step", "time": 2.0, "step": 1, "loss": 2.0, "tokens": 65536, "step_time_s": 2.0, "world_size": 4}
    )
    expected = 65536 / 2.0 * model.flops_per_token(2048) / (4 * 989e12)
    assert value(scrape(exporter), "meshpilot_mfu_ratio") == pytest.approx(expected)
    assert 0.0 < expected < 1.0


def test_mfu_is_nan_when_the_device_peak_is_unknown():
    exporter = fed_exporter(synthetic_run())  # CPU: no configured peak, no known device
    assert math.isnan(value(scrape(exporter), "meshpilot_mfu_ratio"))
    assert peak_flops(None, "cpu") is None
    assert peak_flops(150.0, "cpu") == 150e12
    assert peak_flops(None, "NVIDIA H100 PCIe") == 756e12


def test_ages_are_computed_at_scrape_time():
    clock = FakeClock(100.0)
    exporter = MetricsExporter(world_size=2, checkpoint_interval_steps=10, clock=clock)
    exporter.on_event({"event": "start", "time": 100.0, "world_size": 2})
    clock.now = 130.0
    samples = scrape(exporter)
    assert value(samples, "meshpilot_checkpoint_age_seconds") == 30.0  # no commit yet: since the start
    exporter.on_event({"event": "checkpoint_committed", "time": 140.0, "step": 10, "bytes": 10, "upload_s": 1.0})
    exporter.on_event({"event": "heartbeat", "time": 140.0, "rank_age_s": {"0": 0.5, "1": 2.5}})
    clock.now = 150.0
    samples = scrape(exporter)
    assert value(samples, "meshpilot_checkpoint_age_seconds") == 10.0
    assert value(samples, "meshpilot_heartbeat_age_seconds") == 12.5  # 10 s since the report + the oldest 2.5 s
    assert value(samples, "meshpilot_checkpoint_last_committed_timestamp_seconds") == 140.0


def test_event_log_subscribers_see_mesh_objects():
    exporter = MetricsExporter(world_size=8)
    log = EventLog(None, [exporter])
    log.emit(
        "start",
        name="via-event-log",
        config_hash="abc",
        world_size=8,
        steps=5,
        mesh=MeshSpec(dp_replicate=2, dp_shard=2, tp=2),
        run_dir=None,
        global_batch=16,
        seq_len=128,
    )
    assert value(scrape(exporter), "meshpilot_run_info", name="via-event-log", config_hash="abc") == 1
    mesh = MeshSpec(dp_replicate=1, dp_shard=2, tp=2, pp=1)
    log.emit("recovered", mttr_s=1.0, lost_steps=0, old_mesh=MeshSpec(dp_replicate=2, dp_shard=2, tp=2), new_mesh=mesh)
    samples = scrape(exporter)
    assert value(samples, "meshpilot_world_size") == 4
    assert value(samples, "meshpilot_mesh_degree", dim="dp_shard") == 2


def test_every_exported_sample_is_declared_and_every_declaration_is_exported():
    samples = scrape(fed_exporter(synthetic_run()))
    shown = {name for name, _ in samples}
    assert shown <= exported_names()
    for spec in METRICS.values():
        assert spec.name.startswith("meshpilot_")
        assert spec.sample_names() & shown, f"{spec.name} never shows up in a scrape"
    assert len({spec.name for spec in METRICS.values()}) == len(METRICS)


def test_http_server_binds_loopback_on_a_free_port_and_stops(tmp_path):
    exporter = fed_exporter(synthetic_run(), targets_dir=tmp_path / "targets")
    url = exporter.start_server("127.0.0.1", 0)
    try:
        port = exporter.port
        assert url == f"http://127.0.0.1:{port}/metrics" and port > 0
        assert exporter._server.server_address[0] == "127.0.0.1"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        assert "meshpilot_steps_total 62.0" in body
        target = json.loads((tmp_path / "targets").glob("*.json").__next__().read_text())
        assert target == [{"targets": [f"127.0.0.1:{port}"], "labels": {"run": "synthetic"}}]
        with pytest.raises(RuntimeError, match="already running"):
            exporter.start_server("127.0.0.1", 0)
    finally:
        exporter.close()
    assert list((tmp_path / "targets").iterdir()) == []
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)
    exporter.close()  # twice is fine


def test_build_metrics_follows_the_config(tmp_path):
    config = config_from_dict(
        {
            "data": {"source": "synthetic"},
            "parallelism": {"dp_replicate": 2, "dp_shard": 1, "tp": 2, "pp": 2},
            "elastic": {"min_replicas": 1},
            "metrics": {"device_peak_tflops": 2.0},
            "checkpoint": {"uri": str(tmp_path)},
        }
    )
    exporter = build_metrics(config)
    samples = scrape(exporter)
    assert value(samples, "meshpilot_world_size") == 8
    assert value(samples, "meshpilot_world_size_min") == 4
    assert value(samples, "meshpilot_checkpoint_enabled") == 1
    assert exporter._peak_flops == 2e12
    config.metrics.enabled = False
    assert isinstance(build_metrics(config), NullMetrics)


def test_null_metrics_has_the_interface_the_controller_uses():
    null = NullMetrics()
    for name in ("on_event", "start_server", "close", "render"):
        assert callable(getattr(null, name)) and callable(getattr(MetricsExporter, name))
    null.on_event({"event": "step", "time": 0.0, "step": 1})
    assert null.start_server("127.0.0.1", 0) is None
    assert null.port is None
    null.close()


def test_a_bad_event_never_stops_training(caplog):
    exporter = MetricsExporter(world_size=2)
    with caplog.at_level("WARNING", logger="meshpilot.metrics"):
        exporter.on_event({"event": "step", "time": 1.0, "loss": 1.0})  # no step number
        exporter.on_event({"event": "step", "time": 2.0, "loss": 1.0})  # warned once per kind
        exporter.on_event({"event": "step", "time": 3.0, "step": 1, "loss": 0.5, "tokens": 10, "step_time_s": 1.0})
    assert [r.getMessage() for r in caplog.records] == [
        "metrics: cannot use a 'step' event (KeyError: 'step'); its metrics may be stale"
    ]
    assert value(scrape(exporter), "meshpilot_step") == 1


def test_a_taken_port_is_one_clear_error(tmp_path):
    first = MetricsExporter()
    first.start_server("127.0.0.1", 0)
    second = MetricsExporter()
    try:
        with pytest.raises(
            UserError,
            match=rf"cannot serve metrics on metrics.host='127.0.0.1', "
            rf"metrics.port={first.port}: .*; pick a free port \(0 = any free one\)",
        ):
            second.start_server("127.0.0.1", first.port)
        blocked = tmp_path / "file"
        blocked.write_text("")
        third = MetricsExporter(targets_dir=blocked / "targets")
        with pytest.raises(UserError, match=r"metrics.targets_dir='.*/file/targets': cannot write the scrape target"):
            third.start_server("127.0.0.1", 0)
        assert third.port is None  # nothing left serving
    finally:
        first.close()


def test_a_save_dropped_by_a_mesh_change_is_no_storage_failure(tmp_path):
    """The driver's own checkpoint path (local storage) emits both kinds of ``checkpoint_failed``."""
    config = config_from_dict(
        {
            "checkpoint": {"uri": str(tmp_path / "ckpt")},
            "parallelism": {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "pp": 1},
        }
    )
    exporter = MetricsExporter(world_size=4, checkpoint_interval_steps=4)
    checkpoints = DriverCheckpoints(config, EventLog(None, [exporter]), mesh=config.mesh)
    assert value(scrape(exporter), "meshpilot_checkpoint_failures_total", reason="storage") == 0
    durable = ShardReport(step=8, rank=0)
    checkpoints.reset(config.mesh, generation=1)  # the first configure
    # 1 of 4 ranks durable, then a restore: the save is dropped.
    checkpoints.on_report(CheckpointUploadReport(rank=0, time=0.0, upload=durable, generation=1))
    checkpoints.reset(MeshSpec(dp_replicate=1, dp_shard=2, tp=1, pp=1), generation=2)
    given_up = FailureReport(step=12, rank=1, error="SlowDown", attempts=5)
    checkpoints.on_report(CheckpointUploadReport(rank=1, time=0.0, upload=given_up, generation=2))
    samples = scrape(exporter)
    assert value(samples, "meshpilot_checkpoint_failures_total", reason="interrupted") == 1
    assert value(samples, "meshpilot_checkpoint_failures_total", reason="storage") == 1


def test_goodput_takes_back_steps_after_a_fallback_to_an_older_checkpoint():
    exporter = MetricsExporter(world_size=2, checkpoint_interval_steps=2, clock=FakeClock(100.0))
    exporter.on_event({"event": "start", "time": 0.0, "world_size": 2})
    for step in range(1, 7):
        exporter.on_event({"event": "step", "time": float(step), "step": step, "tokens": 1, "step_time_s": 1.0})
        if step in (2, 4):
            exporter.on_event({"event": "checkpoint_committed", "time": step + 0.1, "step": step, "bytes": 1})
    # step 4's checkpoint turned out corrupt: the restore fell back to step 2, steps 3-6 are redone
    exporter.on_event({"event": "restored", "time": 10.0, "step": 2, "restore_s": 1.0})
    assert value(scrape(exporter), "meshpilot_effective_training_seconds") == 2.0


def test_pauses_that_were_no_failure_stay_out_of_the_recovery_figures():
    exporter = MetricsExporter(world_size=4)
    full, half = {"dp_replicate": 2, "dp_shard": 2}, {"dp_replicate": 1, "dp_shard": 2}
    exporter.on_event({"event": "drain", "time": 1.0, "node": "n1", "ranks": [2, 3]})
    exporter.on_event(
        {
            "event": "recovered",
            "time": 2.0,
            "mttr_s": 0.8,
            "lost_steps": 0,
            "old_mesh": full,
            "new_mesh": half,
            "cause": "drain",
        }
    )
    exporter.on_event(
        {
            "event": "recovered",
            "time": 3.0,
            "mttr_s": 0.2,
            "lost_steps": 0,
            "old_mesh": half,
            "new_mesh": half,
            "cause": "grow",
        }
    )  # a grow's pause that ended without growing
    exporter.on_event({"event": "grow", "time": 9.0, "new_mesh": full, "added_ranks": [2, 3], "join_s": 1.2})
    samples = scrape(exporter)
    assert value(samples, "meshpilot_recoveries_total") == 0
    assert value(samples, "meshpilot_recovery_seconds_count") == 0
    assert value(samples, "meshpilot_drain_seconds_sum") == 0.8
    assert value(samples, "meshpilot_grow_seconds_sum") == 1.2
    assert value(samples, "meshpilot_world_size") == 4
    exporter.on_event(
        {
            "event": "recovered",
            "time": 12.0,
            "mttr_s": 0.7,
            "lost_steps": 0,
            "old_mesh": full,
            "new_mesh": half,
            "cause": "failure",
        }
    )
    samples = scrape(exporter)
    assert value(samples, "meshpilot_recoveries_total") == 1
    assert value(samples, "meshpilot_recovery_seconds_sum") == 0.7
    assert value(samples, "meshpilot_world_size") == 2


def test_a_recorded_real_drain_and_grow_are_no_recoveries():
    """The real event stream of a Ray drain (tests/data/run-drain-grow, see test_report.py)."""
    events = read_events(Path(__file__).resolve().parents[1] / "data" / "run-drain-grow" / "events.jsonl")
    samples = scrape(fed_exporter(events))
    assert value(samples, "meshpilot_drains_total") == 1
    assert value(samples, "meshpilot_drain_seconds_sum") == next(
        e["mttr_s"] for e in events if e["event"] == "recovered" and e["cause"] == "drain"
    )
    assert value(samples, "meshpilot_grow_seconds_sum") == next(e["join_s"] for e in events if e["event"] == "grow")
    assert value(samples, "meshpilot_recoveries_total") == 0 and value(samples, "meshpilot_recovery_seconds_count") == 0
    assert value(samples, "meshpilot_world_size") == 4 and value(samples, "meshpilot_steps_total") == 24
    assert {labels for name, labels in samples if name == "meshpilot_failures_total"} == set()


def test_a_mixture_of_experts_load_balance_is_exported_per_layer():
    events = synthetic_run()
    last = [e for e in events if e["event"] == "step"][-1]["expert_load_max_over_mean"]
    samples = scrape(fed_exporter(events))
    for layer, ratio in last.items():
        assert value(samples, "meshpilot_expert_load_max_over_mean", layer=layer) == ratio


def test_trained_tokens_are_counted_apart_from_tokens():
    exporter = MetricsExporter()
    exporter.on_event({"event": "start", "time": 0.0, "world_size": 2})
    for step, trained in ((1, 40), (2, 25)):
        event = {"event": "step", "time": float(step), "step": step, "loss": 2.0, "tokens": 128, "step_time_s": 1.0}
        exporter.on_event({**event, "trained_tokens": trained})
    samples = scrape(exporter)
    assert value(samples, "meshpilot_tokens_total") == 256
    assert value(samples, "meshpilot_trained_tokens_total") == 65
