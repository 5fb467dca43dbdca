"""Console and per-rank logs: what lands on the terminal and in RUN_DIR/logs, secrets masked."""

from __future__ import annotations

import io
import json
import logging

import pytest
from rich.console import Console

from orchestrator.observe.events import EventLog
from orchestrator.observe.logs import ConsoleEventPrinter, RankLogWriter, setup_logging
from orchestrator.observe.redact import register_secret
from tests.fixtures.synthetic_events import synthetic_run

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"


@pytest.fixture
def console_text():
    buffer = io.StringIO()
    yield Console(file=buffer, width=200, force_terminal=False), buffer
    setup_logging(stream=io.StringIO())  # leave no handler pointing at a closed run dir


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rank_log_events_go_to_one_json_file_per_rank(tmp_path):
    register_secret(SECRET)
    writer = RankLogWriter(tmp_path)
    log = EventLog(tmp_path / "events.jsonl", [writer])
    log.emit("log", rank=0, level="INFO", message="loaded shard 0")
    log.emit("log", rank=3, level="WARNING", message=f"retrying upload with secret_key={SECRET} and {KEY_ID}")
    log.emit("log", rank=0, level="INFO", message="step 1 done")
    log.emit(
        "step",
        step=1,
        loss=1.0,
        tokens=8,
        step_time_s=0.1,
        world_size=1,
        mesh={},
        lr=0.001,
        rank_step_time_s={"0": 0.1},
    )  # not a log record: no file
    writer.close()
    log.close()

    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["rank-0.jsonl", "rank-3.jsonl"]
    rank0 = read_lines(tmp_path / "logs" / "rank-0.jsonl")
    assert [line["message"] for line in rank0] == ["loaded shard 0", "step 1 done"]
    assert rank0[0]["rank"] == 0 and rank0[0]["level"] == "INFO" and "time" in rank0[0]
    rank3_text = (tmp_path / "logs" / "rank-3.jsonl").read_text()
    assert SECRET not in rank3_text and KEY_ID not in rank3_text
    assert read_lines(tmp_path / "logs" / "rank-3.jsonl")[0]["message"] == "retrying upload with secret_key=*** and ***"


def test_console_and_driver_file_mask_secrets_in_messages_and_tracebacks(tmp_path, console_text):
    register_secret(SECRET)
    console, buffer = console_text
    logger = setup_logging(run_dir=tmp_path, console=console)
    logger.getChild("controller").info("connecting to s3://bucket with key %s", KEY_ID)
    try:
        raise RuntimeError(f"PUT refused for https://user:{SECRET}@store.example/bucket")
    except RuntimeError:
        logger.exception("upload failed")
    shown = buffer.getvalue()
    written = (tmp_path / "logs" / "driver.jsonl").read_text()
    for text in (shown, written):
        assert SECRET not in text and KEY_ID not in text
        assert "connecting to s3://bucket with key ***" in text
        assert "RuntimeError: PUT refused for https://user:***@store.example/bucket" in text
    lines = read_lines(tmp_path / "logs" / "driver.jsonl")
    assert [line["level"] for line in lines] == ["INFO", "ERROR"]
    assert lines[0]["logger"] == "meshpilot.controller"


def test_driver_records_without_rank_go_through_the_logger(tmp_path, console_text):
    console, buffer = console_text
    setup_logging(run_dir=tmp_path, console=console)
    writer = RankLogWriter(tmp_path)
    writer.on_event({"event": "log", "time": 1.0, "rank": None, "level": "WARNING", "message": "spare actor slow"})
    writer.close()
    assert "spare actor slow" in buffer.getvalue()
    assert read_lines(tmp_path / "logs" / "driver.jsonl")[0]["message"] == "spare actor slow"
    assert not list((tmp_path / "logs").glob("rank-*.jsonl"))


def test_json_console_format_and_setup_is_idempotent():
    stream = io.StringIO()
    setup_logging(console_format="json", stream=stream)
    logger = setup_logging(console_format="json", stream=stream)  # a second call replaces, not adds
    logger.warning("token=%s", "abcd1234efgh")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["message"] == "token=***"
    with pytest.raises(ValueError, match="console_format='xml' is not one of rich, json"):
        setup_logging(console_format="xml")


def test_console_printer_tells_what_happened(console_text):
    console, buffer = console_text
    logger = setup_logging(console=console)
    printer = ConsoleEventPrinter(logger)
    for event in synthetic_run():
        printer.on_event(event)
    shown = buffer.getvalue()
    assert "run synthetic: dp_replicate=2 x pp=2 x tp=2 (8 ranks), 60 steps" in shown
    assert "failure: actor_died on node node-2, ranks 4, 5, 6, 7: rank 4 actor died" in shown
    assert "recovered in 3.0 s: dp_replicate=2 x pp=2 x tp=2 -> pp=2 x tp=2, 0 steps lost" in shown
    assert "checkpoint step 10 committed: 48.0 MB in 1.8 s -> s3://bucket/run/step-00000010" in shown
    assert "checkpoint step 30 failed: upload gave up after 5 attempts" in shown
    assert "restored step 50 from s3://bucket/run/step-00000050" in shown
    assert "[rank 3] step slower than its peers" in shown
    assert "draining node node-2 (ranks 4, 5, 6, 7): spot instance-action notice" in shown
    assert "training again after the drain in 0.3 s: dp_replicate=2 x pp=2 x tp=2 -> pp=2 x tp=2" in shown
    assert "done: finished after 60 steps" in shown
    assert "loss" not in shown  # steps are the progress bar's, not the log's


def test_a_save_dropped_by_a_mesh_change_is_no_warning(console_text):
    console, buffer = console_text
    printer = ConsoleEventPrinter(setup_logging(console=console))
    printer.on_event(
        {"event": "checkpoint_failed", "time": 0.0, "step": 8, "error": "the mesh changed before every rank reported"}
    )
    assert "checkpoint step 8 dropped: the mesh changed before every rank reported" in buffer.getvalue()
    assert "WARNING" not in buffer.getvalue()
    printer.on_event({"event": "checkpoint_failed", "time": 0.0, "step": 12, "error": "rank 1 gave up: SlowDown"})
    assert "WARNING  checkpoint step 12 failed: rank 1 gave up: SlowDown" in buffer.getvalue()


def test_console_printer_hides_rank_info_below_its_level(console_text):
    console, buffer = console_text
    printer = ConsoleEventPrinter(setup_logging(console=console), rank_level=logging.WARNING)
    printer.on_event({"event": "log", "time": 0.0, "rank": 2, "level": "INFO", "message": "quiet detail"})
    printer.on_event({"event": "log", "time": 0.0, "rank": 2, "level": "ERROR", "message": "loud problem"})
    assert "quiet detail" not in buffer.getvalue()
    assert "[rank 2] loud problem" in buffer.getvalue()


def test_unwritable_log_dir_warns_once_and_does_not_raise(tmp_path, console_text):
    console, buffer = console_text
    setup_logging(console=console)
    blocked = tmp_path / "file"
    blocked.write_text("")
    writer = RankLogWriter(blocked)  # logs/ cannot be created under a file
    for _ in range(3):
        writer.on_event({"event": "log", "time": 1.0, "rank": 0, "level": "INFO", "message": "x"})
    assert buffer.getvalue().count("cannot write rank logs to") == 1
    printer = ConsoleEventPrinter(setup_logging(console=console))
    printer.on_event({"event": "recovered", "time": 1.0, "mttr_s": "soon"})  # not a number: shown raw
    assert "recovered: {" in buffer.getvalue()
