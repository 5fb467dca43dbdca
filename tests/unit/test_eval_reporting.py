"""Evaluations on their way to the user (no Ray, no torch): the rank's report becomes one ``eval``
event per step boundary, a Prometheus gauge, a console line, a curve in ``meshpilot report``'s
picture and TensorBoard scalars that TensorBoard's own reader gives back."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from matplotlib.image import imread
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from elastic.spec import MeshSpec
from orchestrator.analysis.timeline_plot import EVAL_COLOUR, render_timeline
from orchestrator.config import config_from_dict
from orchestrator.driver.detector import Detector
from orchestrator.driver.rank_reports import ReportRouter, RouterHooks
from orchestrator.errors import UserError
from orchestrator.observe.events import EventLog, read_events
from orchestrator.observe.logs import ConsoleEventPrinter
from orchestrator.observe.tensorboard import NullTensorBoard, TensorBoardWriter, build_tensorboard
from tests.fixtures.synthetic_events import synthetic_run
from tests.unit.test_metrics import fed_exporter, scrape, value
from workers.reporting import ReportChannel


def with_evals(events: list[dict[str, Any]], every: int = 10) -> list[dict[str, Any]]:
    """``events`` with an ``eval`` event after every ``every``-th step event, its loss a little above the step's."""
    out = []
    for event in events:
        out.append(event)
        if event["event"] == "step" and event["step"] % every == 0:
            loss = round(event["loss"] + 0.1, 4)
            step = event["step"]
            out.append(
                {"event": "eval", "time": event["time"], "step": step, "loss": loss, "tokens": 8192, "eval_s": 0.4}
            )
    return out


def test_one_eval_event_per_boundary_from_rank_zeros_report(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    router = ReportRouter(events, mesh=MeshSpec(dp_shard=2), tokens_per_step=256)
    channel = ReportChannel(rank=0)
    channel.evaluated(step=5, loss=3.25, tokens=4096, eval_s=0.123456789)
    channel.evaluated(step=5, loss=3.25, tokens=4096, eval_s=0.2)  # evaluated again after a failure at 6
    channel.evaluated(step=10, loss=3.0, tokens=4096, eval_s=0.2)
    router.route(channel.drain())
    router.rewind(5)  # a restore to step 5: the boundaries after it are evaluated (and shown) again
    channel.evaluated(step=10, loss=3.0, tokens=4096, eval_s=0.2)
    router.route(channel.drain())
    events.close()
    shown = [(e["step"], e["loss"], e["tokens"], e["eval_s"]) for e in read_events(tmp_path / "events.jsonl")]
    assert shown == [(5, 3.25, 4096, 0.123457), (10, 3.0, 4096, 0.2), (10, 3.0, 4096, 0.2)]


def test_an_evaluation_is_progress_for_the_hang_check():
    now = [0.0]
    found = Detector(heartbeat_timeout_s=10.0, hang_timeout_s=60.0, clock=lambda: now[0])
    found.reset(2, step=5)
    router = ReportRouter(
        EventLog(None), mesh=MeshSpec(dp_shard=2), tokens_per_step=1, hooks=RouterHooks(after_eval=found.evaluated)
    )
    channel = ReportChannel(rank=0)
    now[0] = 50.0  # boundary 5's evaluation took 50 s
    channel.evaluated(step=5, loss=3.0, tokens=64, eval_s=50.0)
    router.route(channel.drain())
    now[0] = 100.0  # step 6 has run for 50 s since: no hang, though no step completed for 100 s
    assert found.hung() is None
    now[0] = 111.0
    assert found.hung() == [0, 1]


def test_eval_loss_gauge_console_line_and_curve(tmp_path, caplog):
    events = with_evals(synthetic_run())
    samples = scrape(fed_exporter(events))
    assert value(samples, "meshpilot_eval_loss") == [e for e in events if e["event"] == "eval"][-1]["loss"]
    printer = ConsoleEventPrinter(logging.getLogger("meshpilot.test-eval"))
    with caplog.at_level(logging.INFO, logger="meshpilot.test-eval"):
        for event in events:
            printer.on_event(event)
    at_20 = next(e for e in events if e["event"] == "eval" and e["step"] == 20)
    assert f"eval at step 20: loss {at_20['loss']:.4f} over 8,192 tokens in 0.4 s" in caplog.text
    with_curve = imread(render_timeline(events, tmp_path / "with-eval.png"))
    without = imread(render_timeline(synthetic_run(), tmp_path / "without-eval.png"))
    colour = [int(EVAL_COLOUR[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    shows_eval = [(abs(image[..., :3] - colour).max(axis=-1) <= 6 / 255).any() for image in (with_curve, without)]
    assert shows_eval == [True, False]


def test_tensorboard_scalars_read_back_per_step(tmp_path):
    events = with_evals(synthetic_run())
    writer = build_tensorboard(config_from_dict({"metrics": {"tensorboard_dir": str(tmp_path / "tb")}}))
    assert isinstance(writer, TensorBoardWriter)
    for event in events:
        writer.on_event(event)
    writer.close()
    reader = EventAccumulator(str(tmp_path / "tb"))
    reader.Reload()
    assert set(reader.Tags()["scalars"]) == {
        "train/loss",
        "train/lr",
        "train/tokens_per_s",
        "train/grad_norm",
        "eval/loss",
    }
    # A restore redoes steps 51-52: TensorBoard keeps the redone values, as the run ended with them.
    steps = {e["step"]: e for e in events if e["event"] == "step"}
    evals = {e["step"]: e for e in events if e["event"] == "eval"}
    expected = {
        "train/loss": {step: e["loss"] for step, e in steps.items()},
        "train/lr": {step: e["lr"] for step, e in steps.items()},
        "train/grad_norm": {step: e["grad_norm"] for step, e in steps.items()},
        "train/tokens_per_s": {step: e["tokens"] / e["step_time_s"] for step, e in steps.items()},
        "eval/loss": {step: e["loss"] for step, e in evals.items()},
    }
    for tag, values in expected.items():
        read = {scalar.step: scalar.value for scalar in reader.Scalars(tag)}
        assert read == pytest.approx(values, rel=1e-6), tag


def test_tensorboard_is_off_by_default_and_an_unwritable_dir_is_one_error(tmp_path):
    assert isinstance(build_tensorboard(config_from_dict({})), NullTensorBoard)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(UserError, match=r"metrics.tensorboard_dir='.*/file/tb': cannot write there"):
        TensorBoardWriter(tmp_path / "file" / "tb")
