"""A copy of the run directory where it outlives the job: ``s3://bucket/prefix``, kept up as the run goes.

Runs on the driver, in one background thread that ``run_training`` starts and closes. The run
still writes its record to a local directory (``runs/<name>-<timestamp>``); ``RecordMirror``
copies it to storage (``checkpointing.storage``: S3, or a directory in the tests):

* ``config.yaml`` at once;
* ``events.jsonl`` as it grows. S3 has no append, so every ``interval_s`` the lines written since
  the last upload go up as the next numbered part, ``events.parts/00000001.jsonl``, ``...02``:
  a flush costs the new bytes only, never the run's whole history (a step event of a 1,024-rank
  job is ~20 kB). At the end the whole file goes up as ``events.jsonl``, byte for byte the local
  one, and the parts are deleted. A reader (``read_record_events``) takes ``events.jsonl`` when
  it exists, else the parts from 1 up to the first gap: a run in progress, or a killed driver;
* at the end, every other file of the run directory (``logs/rank-N.jsonl``, ``logs/driver.jsonl``,
  ``samples.jsonl``, a ``timeline.png`` when one was drawn).

A record URI holds one run: the first flush removes an earlier run's events there.

The mirror never fails or stalls the run: it reads the files the run writes (nothing calls into
it on the training path), an upload error is logged once (masked) and what failed is tried again
at the next flush, and ``close()`` waits for the final upload at most ``close_timeout_s``.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from checkpointing.storage import StorageBackend
from orchestrator.errors import UserError
from orchestrator.observe.redact import redact_text

EVENTS = "events.jsonl"
CONFIG = "config.yaml"
PARTS_DIR = "events.parts"
_PART_NAME = re.compile(r"^events\.parts/(\d+)\.jsonl$")
_MAX_PART_BYTES = 64 << 20  # a backlog after a long outage goes up in pieces, not one buffer
_READ_BYTES = 8 << 20

log = logging.getLogger("meshpilot")


def part_key(number: int) -> str:
    return f"{PARTS_DIR}/{number:08d}.jsonl"


class RecordMirror:
    """Copies ``run_dir`` to ``storage`` (driver, one background thread; see the module docstring).

    Call sequence: ``start()`` once the run directory holds config.yaml, the run writes its
    files, ``close()`` once every file is closed. ``flush()`` is the work of one tick, public so
    that tests can step it without the thread.
    """

    def __init__(
        self, run_dir: Path, storage: StorageBackend, *, interval_s: float = 10.0, close_timeout_s: float = 120.0
    ) -> None:
        self.run_dir = Path(run_dir)
        self.storage = storage
        self.uri = storage.uri
        self.interval_s = interval_s
        self.close_timeout_s = close_timeout_s
        self._uploaded_bytes = 0  # of events.jsonl, in parts
        self._next_part = 1
        self._earlier_record_cleared = False
        self._config_uploaded = False
        self._warned = False
        self._final_ok = False
        self._lock = threading.Lock()  # one flush at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshpilot-record-mirror", daemon=True)

    def start(self) -> RecordMirror:
        log.info("run record mirrored to %s (new events every %g s)", self.uri, self.interval_s)
        self._thread.start()
        return self

    def close(self) -> bool:
        """Upload what is left (the whole events.jsonl, logs, other files); True when all of it is up.

        Waits at most ``close_timeout_s``: a store that hangs leaves the record incomplete and
        says so, it does not hold the driver.
        """
        if self._thread.ident is None:  # never started: the final flush in this thread
            self._stop.set()
            return self.flush(final=True)
        self._stop.set()
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            log.warning(
                "gave up waiting %g s for the run record's last upload to %s; the whole record is in %s",
                self.close_timeout_s,
                self.uri,
                self.run_dir,
            )
            return False
        self.storage.close()
        return self._final_ok

    def _run(self) -> None:
        while not self._stop.is_set():
            self.flush()
            self._stop.wait(self.interval_s)
        self._final_ok = self.flush(final=True)

    # ------------------------------------------------------------------ flushing
    def flush(self, *, final: bool = False) -> bool:
        """Upload what is due (config.yaml until it is up, new events; with ``final`` everything).

        Returns True when nothing failed; a failure is logged (once per mirror) and left for the
        next flush.
        """
        with self._lock:
            tasks: list[tuple[str, Callable[[], object]]] = []
            if not self._config_uploaded:
                tasks.append((CONFIG, self._upload_config))
            tasks.append((EVENTS, self._upload_new_events))
            failures = [(what, error) for what, task in tasks if (error := _attempt(task)) is not None]
            if final:
                failures += self._final_uploads()
        for what, error in failures[:1]:
            self._report(what, error, final=final)
        return not failures

    def _upload_config(self) -> None:
        self.storage.put_bytes(CONFIG, (self.run_dir / CONFIG).read_bytes())
        self._config_uploaded = True

    def _upload_new_events(self) -> None:
        """The complete lines written since the last part, as the next part(s)."""
        if not self._earlier_record_cleared:
            self._clear_earlier_record()
        path = self.run_dir / EVENTS
        if not path.exists():
            return
        with open(path, "rb") as handle:
            while True:
                handle.seek(self._uploaded_bytes)
                chunk = handle.read(_MAX_PART_BYTES)
                end = chunk.rfind(b"\n") + 1  # whole lines: a reader of the parts sees no torn line
                if end == 0 and len(chunk) == _MAX_PART_BYTES:  # one line longer than a part
                    end = len(chunk)
                if end == 0:  # nothing new, or a line still being written
                    return
                self.storage.put_bytes(part_key(self._next_part), chunk[:end])
                self._uploaded_bytes += end
                self._next_part += 1

    def _clear_earlier_record(self) -> None:
        """An earlier run's events under this URI would be read as (or mixed into) this run's."""
        stale = [EVENTS] if self.storage.exists(EVENTS) else []
        stale += [info.key for info in self.storage.list(PARTS_DIR + "/")]
        if stale:
            log.info("the run record at %s replaces an earlier run's", self.uri)
            self.storage.delete(stale)  # ascending: a reader never sees a later part without part 1
        self._earlier_record_cleared = True

    def _final_uploads(self) -> list[tuple[str, BaseException]]:
        """The whole events.jsonl (then its parts go), and every other file of the run directory.

        The parts stay when the whole file could not go up: they are the record then.
        """
        failures = []
        error = _attempt(partial(_upload_file, self.storage, EVENTS, self.run_dir / EVENTS))
        if error is None:
            error = _attempt(partial(self.storage.delete, [part_key(n) for n in range(1, self._next_part)]))
        if error is not None:
            failures.append((EVENTS, error))
        done = {EVENTS, CONFIG} if self._config_uploaded else {EVENTS}
        for path in sorted(self.run_dir.rglob("*")):
            key = path.relative_to(self.run_dir).as_posix()
            if path.is_file() and not path.is_symlink() and key not in done:
                error = _attempt(partial(_upload_file, self.storage, key, path))
                if error is not None:
                    failures.append((key, error))
        return failures

    def _report(self, what: str, error: BaseException, *, final: bool) -> None:
        text = redact_text(f"{type(error).__name__}: {error}")
        if final:
            log.warning(
                "the run record at %s is incomplete (%s not uploaded: %s); the whole record is in %s",
                self.uri,
                what,
                text,
                self.run_dir,
            )
        elif not self._warned:
            self._warned = True
            log.warning(
                "cannot upload the run record to %s (%s: %s); trying again every %g s, the local copy is %s",
                self.uri,
                what,
                text,
                self.interval_s,
                self.run_dir,
            )


class NoMirror:
    """Stands in when the record stays where the run writes it (a local or shared directory)."""

    uri = None

    def start(self) -> NoMirror:
        return self

    def close(self) -> bool:
        return True


def _attempt(task: Callable[[], object]) -> BaseException | None:
    try:
        task()
    except Exception as error:  # noqa: BLE001 - best effort beside the run: no upload error may end it
        return error
    return None


def _upload_file(storage: StorageBackend, key: str, path: Path) -> None:
    storage.put_stream(key, _read_pieces(path), size=path.stat().st_size)


def _read_pieces(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        while piece := handle.read(_READ_BYTES):
            yield piece


# ---------------------------------------------------------------------- reading
def read_record_events(storage: StorageBackend) -> bytes:
    """The bytes of a mirrored run's events.jsonl: the whole file, or the parts uploaded so far.

    Raises a UserError naming the URI when it holds no run record.
    """
    if storage.exists(EVENTS):
        return storage.get(EVENTS)
    numbered = {}
    for info in storage.list(PARTS_DIR + "/"):
        match = _PART_NAME.match(info.key)
        if match:
            numbered[int(match.group(1))] = info.key
    pieces = []
    number = 1
    while number in numbered:  # up to the first gap: parts after it are not this record's
        pieces.append(storage.get(numbered[number]))
        number += 1
    if not pieces:
        raise UserError(
            f"{storage.uri} holds no {EVENTS}, so it is not a meshpilot run record; pass the URI "
            "`meshpilot train` printed ('run record: s3://...')"
        )
    return b"".join(pieces)
