"""The run record's mirror: events go up as they come, the end leaves a byte-equal copy, and a
broken or hung store neither fails nor stalls the run."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest

from checkpointing.errors import StorageUnreachableError
from checkpointing.local import LocalStorage
from orchestrator.cli import main
from orchestrator.errors import UserError
from orchestrator.observe.events import EventLog
from orchestrator.observe.logs import setup_logging
from orchestrator.observe.record_mirror import EVENTS, RecordMirror, part_key, read_record_events

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


@pytest.fixture
def console_text():
    buffer = io.StringIO()
    setup_logging(console_format="json", stream=buffer)  # one JSON line a record: nothing wrapped
    yield buffer
    setup_logging(stream=io.StringIO())  # leave no handler pointing at this test's buffer


@pytest.fixture
def run_dir(tmp_path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: mirrored\n")
    return run_dir


def emit_steps(events: EventLog, first: int, last: int) -> None:
    for step in range(first, last + 1):
        events.emit(
            "step", step=step, loss=1.0 / step, tokens=64, step_time_s=0.1, world_size=1, mesh={}, lr=1e-3,
            rank_step_time_s={0: 0.1},
        )  # fmt: skip


class FlakyStorage(LocalStorage):
    """LocalStorage whose writes fail while ``failing`` (with a credential in the message)."""

    failing = True

    def put_stream(self, key, pieces, *, size=None):
        if self.failing:
            raise StorageUnreachableError(f"cannot reach http://admin:{SECRET}@s3.example:9000 for {key}")
        return super().put_stream(key, pieces, size=size)


class HangingStorage(LocalStorage):
    """LocalStorage whose writes block until ``release`` is set: an endpoint that never answers."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.release = threading.Event()

    def put_stream(self, key, pieces, *, size=None):
        self.release.wait()
        return super().put_stream(key, pieces, size=size)


def test_new_lines_go_up_as_parts_and_the_end_leaves_a_byte_equal_copy(run_dir, tmp_path):
    remote = LocalStorage(tmp_path / "remote")
    mirror = RecordMirror(run_dir, remote)
    events = EventLog(run_dir / EVENTS)
    emit_steps(events, 1, 3)
    assert mirror.flush()
    assert remote.get("config.yaml") == b"name: mirrored\n"
    assert remote.get(part_key(1)) == (run_dir / EVENTS).read_bytes()
    assert mirror.flush() and not remote.exists(part_key(2))  # nothing new: no upload

    emit_steps(events, 4, 5)
    assert mirror.flush()
    assert [json.loads(line)["step"] for line in remote.get(part_key(2)).splitlines()] == [4, 5]
    assert read_record_events(remote) == (run_dir / EVENTS).read_bytes()  # a reader during the run

    events.close()
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "rank-0.jsonl").write_text('{"message": "hello"}\n')
    assert mirror.close()
    assert remote.get(EVENTS) == (run_dir / EVENTS).read_bytes()
    assert remote.get("logs/rank-0.jsonl") == b'{"message": "hello"}\n'
    assert remote.list("events.parts/") == []


def test_a_line_still_being_written_waits_for_its_end(run_dir, tmp_path):
    remote = LocalStorage(tmp_path / "remote")
    mirror = RecordMirror(run_dir, remote)
    with open(run_dir / EVENTS, "ab") as handle:
        handle.write(b'{"event": "a"}\n{"event": "b", "ti')
        handle.flush()
        mirror.flush()
        assert remote.get(part_key(1)) == b'{"event": "a"}\n'
        handle.write(b'me": 1}\n')
    mirror.flush()
    assert remote.get(part_key(2)) == b'{"event": "b", "time": 1}\n'


def test_an_upload_error_is_logged_once_masked_and_retried(run_dir, tmp_path, console_text):
    remote = FlakyStorage(tmp_path / "remote")
    mirror = RecordMirror(run_dir, remote, interval_s=7)
    events = EventLog(run_dir / EVENTS)
    for first in (1, 3, 5):
        emit_steps(events, first, first + 1)
        assert not mirror.flush()
    logged = console_text.getvalue()
    assert logged.count("cannot upload the run record") == 1
    assert f"trying again every 7 s, the local copy is {run_dir}" in logged
    assert SECRET not in logged and "***" in logged

    remote.failing = False
    assert mirror.flush()  # everything that failed goes up now, in order
    assert remote.get("config.yaml") == b"name: mirrored\n"
    assert read_record_events(remote) == (run_dir / EVENTS).read_bytes()
    events.close()
    assert mirror.close() and remote.get(EVENTS) == (run_dir / EVENTS).read_bytes()
    assert console_text.getvalue().count("cannot upload the run record") == 1


def test_a_hung_store_stalls_neither_the_events_nor_the_end_of_the_run(run_dir, tmp_path, console_text):
    remote = HangingStorage(tmp_path / "remote")
    mirror = RecordMirror(run_dir, remote, interval_s=0.01, close_timeout_s=0.5).start()
    events = EventLog(run_dir / EVENTS)
    try:
        started = time.monotonic()
        emit_steps(events, 1, 200)
        events.close()
        assert mirror.close() is False
        assert time.monotonic() - started < 5  # the close timeout, not the store, bounds the run's end
        assert f"gave up waiting 0.5 s for the run record's last upload to {remote.uri}" in console_text.getvalue()
    finally:
        remote.release.set()  # let the mirror's thread finish


def test_an_earlier_runs_record_at_the_same_uri_is_replaced(run_dir, tmp_path):
    remote = LocalStorage(tmp_path / "remote")
    remote.put_bytes(EVENTS, b'{"event": "old"}\n')
    for number in (1, 2, 3):
        remote.put_bytes(part_key(number), b'{"event": "old part"}\n')
    events = EventLog(run_dir / EVENTS)
    emit_steps(events, 1, 1)
    RecordMirror(run_dir, remote).flush()
    assert read_record_events(remote) == (run_dir / EVENTS).read_bytes()
    assert [info.key for info in remote.list()] == ["config.yaml", part_key(1)]


def test_the_reader_takes_the_parts_up_to_the_first_gap_and_names_an_empty_uri(tmp_path):
    remote = LocalStorage(tmp_path / "remote")
    with pytest.raises(UserError, match="holds no events.jsonl, so it is not a meshpilot run record"):
        read_record_events(remote)
    for number in (1, 2, 4):
        remote.put_bytes(part_key(number), f"{number}\n".encode())
    assert read_record_events(remote) == b"1\n2\n"


def test_report_of_an_s3_uri_without_a_bucket_is_one_error(capsys):
    assert main(["report", "s3://"]) == 2
    assert "RUN_DIR='s3://': no bucket; write s3://BUCKET/PREFIX" in capsys.readouterr().err
