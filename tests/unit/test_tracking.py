"""MLflow / W&B tracking on the driver, fed recorded event streams (no Ray, no server but a closed port).

    python -m pytest tests/unit/test_tracking.py -q

The real server and a real job with a killed rank: tests/integration/test_tracking.py.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import config_from_dict, load_config
from orchestrator.observe.events import read_events
from orchestrator.observe.tracking import (
    EndOfRun,
    EventRecords,
    MlflowBackend,
    Record,
    RecordsRefused,
    RunTags,
    StepValues,
    Tracker,
    build_tracker,
    flat_params,
    record_files,
)
from tests.fixtures.synthetic_events import TOKENS_PER_STEP, synthetic_run, write_events
from tests.jobs import DEMO_CONFIG, REPO

KILL_RANK3 = REPO / "tests" / "data" / "run-kill-rank3" / "events.jsonl"
SAMPLE = f"data.path={REPO / 'data' / 'sample.txt'}"


class RecordingBackend:
    """Keeps what it is sent; ``gate`` (when given) holds every send until it is set."""

    name = "recording"
    where = "memory"

    def __init__(self, *, gate: threading.Event | None = None, failures: int = 0, refusals: int = 0) -> None:
        self.records: list[Record] = []
        self.batches: list[list[Record]] = []
        self.gate = gate
        self.failures_left = failures
        self.refusals_left = refusals

    def send(self, records: list[Record]) -> None:
        if self.gate is not None:
            self.gate.wait()
        if self.failures_left:
            self.failures_left -= 1
            raise ConnectionError("connection refused")
        if self.refusals_left:
            self.refusals_left -= 1
            raise RecordsRefused("INVALID_PARAMETER_VALUE: metric value")
        self.records.extend(records)
        self.batches.append(list(records))

    def metric(self, key: str) -> list[tuple[int, float]]:
        return [(r.step, r.values[key]) for r in self.records if isinstance(r, StepValues) and key in r.values]

    def tags(self) -> dict[str, str]:
        return {k: v for r in self.records if isinstance(r, RunTags) for k, v in r.tags.items()}


def replay(events: list[dict], tracker: Tracker) -> None:
    for event in events:
        tracker.on_event(event)


def test_recorded_killed_rank_run_gives_the_loss_curve_a_failure_and_its_recovery(tmp_path):
    events = read_events(KILL_RANK3)
    write_events(tmp_path, events)
    (tmp_path / "config.yaml").write_text("name: tiny-3d\n")
    backend = RecordingBackend()
    tracker = Tracker([backend], tmp_path)
    replay(events, tracker)
    delivery = tracker.close()["recording"]

    losses = [(e["step"], e["loss"]) for e in events if e["event"] == "step"]
    assert backend.metric("loss") == losses and len(losses) == 20
    # The failure is marked at step 7, the last step completed when rank 3 died; the recovery at
    # step 8, the first step on the new mesh, with its time to recover.
    assert backend.metric("failure") == [(7, 1.0)]
    assert backend.metric("recovered") == [(8, 0.651)]
    tags = backend.tags()
    assert tags["meshpilot.failure.1"].startswith("step 7: rank_died: ranks [3]")
    assert tags["meshpilot.status"] == "finished"
    end = backend.records[-1]
    assert isinstance(end, EndOfRun) and end.status == "finished"
    assert [path.name for path in end.files] == ["config.yaml", "events.jsonl"]
    assert (delivery.sent, delivery.dropped, delivery.unsent) == (len(backend.records), 0, 0)


def test_drain_grow_and_restore_are_marked_where_the_run_was_and_mfu_when_the_peak_is_known(tmp_path):
    events = synthetic_run()
    events.insert(5, {"event": "eval", "time": events[4]["time"], "step": 2, "loss": 4.5, "tokens": 4096, "eval_s": 1})
    backend = RecordingBackend()
    tracker = Tracker([backend], tmp_path, records=EventRecords(flops_per_token=1e6, peak_flops_per_device=1e12))
    replay(events, tracker)
    tracker.close()

    assert backend.metric("eval_loss") == [(2, 4.5)]
    assert backend.metric("failure") == [(23, 4.0), (52, 4.0)]
    # A drain's pause ends with a "recovered" event too (cause: drain): only failures get a recovery marker.
    assert backend.metric("recovered") == [(23, 3.0), (50, 8.5)]
    assert backend.metric("grow") == [(35, 4.0)] and backend.metric("drain") == [(45, 4.0)]
    assert backend.metric("restored") == [(50, 2.0)]
    # Steps 51 and 52 were taken twice (before and after the restore): both are in the history.
    assert [step for step, _ in backend.metric("loss")].count(51) == 2
    first = next(e for e in events if e["event"] == "step")
    tokens_per_s = TOKENS_PER_STEP / first["step_time_s"]
    assert backend.metric("tokens_per_s")[0] == (1, pytest.approx(tokens_per_s))
    assert backend.metric("mfu")[0] == (1, pytest.approx(tokens_per_s * 1e6 / (8 * 1e12)))


def test_parameters_are_the_resolved_config_flattened_without_credentials():
    config = config_from_dict(
        {"tracking": {"mlflow": {"tracking_uri": "http://user:hunter22@mlflow.example:5000"}}}, [SAMPLE]
    )
    params = flat_params(config.to_dict())
    assert params["training.lr"] == "0.0003" and params["parallelism.tp"] == "2"
    assert params["runtime.resources_per_rank"] == "{}" and params["checkpoint.uri"] == "null"
    assert params["tracking.mlflow.tracking_uri"] == "http://user:***@mlflow.example:5000"


def test_a_stalled_tracker_never_holds_up_the_events_and_a_full_queue_drops_the_oldest(tmp_path):
    gate = threading.Event()
    backend = RecordingBackend(gate=gate)
    tracker = Tracker([backend], tmp_path, capacity=10, close_timeout_s=5)
    steps = [
        {"event": "step", "time": 1.0 + step, "step": step, "loss": 1.0 / step, "tokens": 1} for step in range(1, 101)
    ]
    started = time.perf_counter()
    replay(steps, tracker)
    assert time.perf_counter() - started < 0.5  # 100 events while every send hangs
    gate.set()
    delivery = tracker.close()["recording"]
    received = [step for step, _ in backend.metric("loss")]
    # Whatever the sender had taken before it hung, then the newest the queue of 10 kept: the last
    # 9 steps, as the run's end (EndOfRun) took the tenth place at close. Every other step is counted.
    assert received == sorted(received) and set(range(92, 101)) <= set(received)
    assert delivery.dropped == 100 - len(received) > 0 and delivery.unsent == 0
    assert isinstance(backend.records[-1], EndOfRun)


def test_a_failing_tracker_warns_once_retries_and_delivers_everything(tmp_path, caplog):
    backend = RecordingBackend(failures=3)
    tracker = Tracker([backend], tmp_path, first_retry_s=0.01)
    caplog.set_level(logging.INFO, logger="meshpilot")
    replay(read_events(KILL_RANK3), tracker)
    delivery = tracker.close()["recording"]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot reach recording at memory (ConnectionError" in warnings[0].getMessage()
    assert delivery.failures == 3 and delivery.unsent == 0
    assert len(backend.metric("loss")) == 20


def test_refused_records_are_dropped_and_counted_and_the_rest_goes_through(tmp_path, caplog):
    backend = RecordingBackend(refusals=1)
    tracker = Tracker([backend], tmp_path)
    caplog.set_level(logging.INFO, logger="meshpilot")
    events = read_events(KILL_RANK3)
    tracker.on_event(events[0])  # the start: its tags are the batch refused
    assert _wait_for(lambda: tracker._queues[0].delivery.dropped == 1)
    replay(events[1:], tracker)
    delivery = tracker.close()["recording"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "refused records (INVALID_PARAMETER_VALUE" in warnings[0]
    assert delivery.dropped == 1 and delivery.unsent == 0 and len(backend.metric("loss")) == 20
    # The end of the run is a batch of its own: a retry of its artifacts never sends metrics twice.
    assert [type(r) for r in backend.batches[-1]] == [EndOfRun]


def _wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_unreachable_mlflow_server_is_one_warning_and_the_end_waits_no_longer_than_allowed(tmp_path, caplog):
    pytest.importorskip("mlflow")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    job = load_config(DEMO_CONFIG, [SAMPLE, f"tracking.mlflow.tracking_uri=http://127.0.0.1:{port}"])
    caplog.set_level(logging.INFO)
    tracker = build_tracker(job, tmp_path)
    assert isinstance(tracker, Tracker) and isinstance(tracker._queues[0].backend, MlflowBackend)
    tracker.close_timeout_s = 1.0  # the run's end waits this long for a server that never answers
    started = time.perf_counter()
    replay(read_events(KILL_RANK3), tracker)
    on_events_s = time.perf_counter() - started
    delivery = tracker.close()["MLflow"]
    closed_s = time.perf_counter() - started
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in warnings] == ["meshpilot.tracking"], [r.getMessage() for r in warnings]
    assert warnings[0].getMessage() == (
        f"tracking: cannot reach MLflow at http://127.0.0.1:{port} (ConnectionRefusedError: [Errno 111] Connection "
        "refused); retrying in the background, the run goes on"
    )
    assert on_events_s < 0.5 and closed_s < 3.0
    assert delivery.sent == 0 and delivery.unsent > 20 and delivery.failures >= 1


def test_record_files_leave_out_w_and_b_s_own_directory(tmp_path):
    for name in ("config.yaml", "events.jsonl", "logs/rank-0.jsonl", "wandb/offline-run-1/run-1.wandb"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert [p.relative_to(tmp_path).as_posix() for p in record_files(tmp_path)] == [
        "config.yaml",
        "events.jsonl",
        "logs/rank-0.jsonl",
    ]


def test_unknown_tracking_key_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", str(DEMO_CONFIG), "--set", "tracking.mlflow.tracking_url=http://x"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "meshpilot: invalid config: tracking.mlflow.tracking_url: unknown key; "
        "did you mean 'tracking.mlflow.tracking_uri'?"
    )


def test_a_tracker_that_is_not_installed_names_the_extra(capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "wandb" else real_find_spec(name, *args)
    )
    monkeypatch.chdir(REPO)
    assert main(["train", str(DEMO_CONFIG), "--set", "tracking.wandb.mode=offline"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "meshpilot: invalid config: tracking.wandb is set but wandb is not installed: "
        "pip install 'meshpilot[tracking]' (or remove tracking.wandb)"
    )


def test_no_tracking_section_sends_nothing_and_costs_nothing(tmp_path):
    tracker = build_tracker(config_from_dict({}, [SAMPLE]), Path(tmp_path))
    tracker.on_event({"event": "step", "time": 1.0, "step": 1, "loss": 1.0})
    assert tracker.close() == {} and tracker.describe() == ""


def test_an_adopting_driver_may_track_elsewhere_than_the_run_it_adopts():
    from orchestrator.driver.adoption import differing_keys

    config = load_config(DEMO_CONFIG, [SAMPLE, "tracking.wandb.mode=offline"])
    recorded = config.to_dict()
    del recorded["tracking"]  # a run recorded before the tracking section existed
    assert differing_keys(recorded, config) == []


def test_the_warning_names_the_deepest_error_that_says_something():
    from orchestrator.observe.tracking import error_text

    def chained(*errors: BaseException) -> BaseException:
        for outer, inner in zip(errors, errors[1:]):
            outer.__cause__ = inner
        return errors[0]

    refused = chained(RuntimeError("API request to http://u:pw@h/x failed"), ConnectionRefusedError(111, "refused"))
    assert error_text(refused) == "ConnectionRefusedError: [Errno 111] refused"
    no_key = chained(ValueError("No API key configured. Use `wandb login` to log in."), OSError())
    assert error_text(no_key) == "ValueError: No API key configured. Use `wandb login` to log in."
