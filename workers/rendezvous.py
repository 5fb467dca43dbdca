"""The job's long-lived key-value store, and the per-step commit vote built on it.

``StoreHost`` is a Ray actor started by the driver on its own node: it owns the TCPStore
server, so the store outlives any rank. Each generation of the process groups works under its
own key prefix ``gen{n}/``.

The commit vote (``StepCommitter.vote``, called by every rank once per step, after gradients
are reduced and before the optimizer update) makes "was step s applied?" one atomic decision:
the last rank to arrive writes ``commit`` into ``gen{n}/step/{s}`` with compare-and-set, and
the driver, when it learns of a failure, writes ``abort`` the same way. Whichever write lands
first is what every rank reads, so after any failure all survivors hold the same step.
The driver can also ask for a pause: the deciding rank then writes ``commit_pause`` (or
``commit_pause_checkpoint``: save first) and every rank stops after applying that step — the
step boundary at which drains and grows happen. The deciding rank also says whether every rank
snapshots the step (peer-memory snapshots): every ``gen{n}/snapshot_interval`` steps, and at a
pause; the driver changes that interval as it measures what snapshots cost
(``elastic/snapshot_cadence.py``), and the vote makes every rank follow the same one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

from workers.driver_lease import DriverLease, start_watch
from workers.spec import FailureKind, StepDecision, Verdict
from workers.spec.messages import DriverRecord

# torch.distributed is imported inside the methods: the driver imports this module for the
# StoreHost class handle and must not load torch.distributed itself.


def connect_store(host: str, port: int, timeout_s: float = 60.0) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


class StoreHost:
    """Ray actor (driver's node, no CPU reserved) holding the TCPStore server.

    With ``runtime.survive_driver_loss`` (``lease_s`` set) it is detached and outlives the
    driver under a lease (``workers/driver_lease.py``): it keeps the ``DriverRecord`` a new
    driver adopts the run from, pauses the generation at the next step boundary when the driver
    falls silent, and exits when the lease runs out.
    """

    def __init__(self, lease_s: float | None = None) -> None:
        import ray
        import torch.distributed as dist

        self.host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        self.record = DriverRecord(config_yaml="", run_dir=None, generation=0, last_step=0)
        self.lease: DriverLease | None = None
        if lease_s is not None:
            self.lease = DriverLease(lease_s)
            start_watch(self.lease, holder="rendezvous store", on_silence=self._pause_without_driver)

    def address(self) -> tuple[str, int]:
        return self.host, self.store.port

    def begin_record(self, config_yaml: str, run_dir: str | None) -> None:
        """Driver, when it starts (or adopts) the run: the run's config and record directory."""
        self.record = replace(self.record, config_yaml=config_yaml, run_dir=run_dir)

    def renew_lease(self, generation: int, last_step: int) -> None:
        """Driver, twice a second: the driver lives; the run has reached ``generation`` and ``last_step``."""
        if self.lease is not None:
            self.lease.renew()
        self.record = replace(self.record, generation=generation, last_step=last_step)

    def driver_record(self) -> DriverRecord:
        """Called by a driver adopting the run (which renews the lease by calling)."""
        if self.lease is not None:
            self.lease.renew()
        return self.record

    def _pause_without_driver(self) -> None:
        # The vote's pause: every rank applies the step being decided, then waits with its state.
        # The next generation too: the driver may have configured it and died before renewing.
        if self.record.generation > 0:
            for generation in (self.record.generation, self.record.generation + 1):
                self.request_pause(generation)

    def request_pause(self, generation: int, checkpoint: bool = False) -> None:
        self.store.set(f"gen{generation}/pause", "checkpoint" if checkpoint else "1")

    def clear_pause(self, generation: int) -> None:
        """A driver adopting the run, before it configures ``generation``: the pause its silence
        asked of that generation is not wanted."""
        self.store.set(f"gen{generation}/pause", NO_PAUSE)

    def set_snapshot_interval(self, generation: int, interval_steps: int) -> None:
        """Snapshot every ``interval_steps`` steps from the next decided step of ``generation`` on."""
        self.store.set(f"gen{generation}/snapshot_interval", str(interval_steps))

    def abort_from(self, generation: int, step: int) -> int:
        """Veto the first undecided step at or after ``step``; returns that step.

        Steps already committed are skipped: their decision stands.
        """
        while True:
            key = f"gen{generation}/step/{step}"
            decided = self.store.compare_set(key, "", Verdict.ABORT).decode()
            if decided == Verdict.ABORT:
                return step
            step += 1


NO_PAUSE = "0"  # the pause key's value until the driver asks for one


class CommitVoteTimeout(RuntimeError):
    """This rank waited for the step's decision longer than the collective timeout."""

    failure_kind = FailureKind.TIMEOUT


class JoinAborted(RuntimeError):
    """The driver ended the generation while this rank waited for the others to join it."""

    failure_kind = FailureKind.PEER_FAILURE


class JoinTimeout(RuntimeError):
    """Not every rank joined the generation within the collective timeout."""

    failure_kind = FailureKind.TIMEOUT


def join_barrier(
    store: Any,
    *,
    generation: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    aborted: Callable[[], bool],
    poll_s: float = 0.05,
) -> None:
    """Rank side, inside ``configure``: wait until every rank of ``generation`` has arrived,
    before any of them enters torch's own rendezvous.

    torch's rendezvous waits for a rank that will never come (it died while the generation
    configured) until the collective timeout, and nothing can interrupt it; this wait ends as
    soon as the driver aborts the generation (``aborted``), so a fault during a recovery costs
    a poll, not the timeout.
    """
    store.set(f"gen{generation}/joined/{rank}", b"1")
    keys = [f"gen{generation}/joined/{other}" for other in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if aborted():
            raise JoinAborted(f"generation {generation} was aborted while rank {rank} waited for the others to join")
        if time.monotonic() > deadline:
            missing = [other for other, key in enumerate(keys) if not store.check([key])]
            raise JoinTimeout(f"ranks {missing} did not join generation {generation} within {timeout_s:g} s")
        time.sleep(poll_s)


class StepCommitter:
    """Rank side of the vote; one per rank per generation."""

    def __init__(
        self, store: Any, *, generation: int, world_size: int, timeout_s: float, snapshot_interval: int = 0
    ) -> None:
        """``snapshot_interval``: the generation's starting interval (0: no snapshots), the same on every rank."""
        self.store = store
        self.prefix = f"gen{generation}/"
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout_s)
        # Both keys exist from here on, so the deciding rank reads them in one round trip; a
        # value the driver wrote first (a pause, a new interval) stands.
        self._control_keys = [f"{self.prefix}pause", f"{self.prefix}snapshot_interval"]
        store.compare_set(self._control_keys[0], "", NO_PAUSE)
        store.compare_set(self._control_keys[1], "", str(snapshot_interval))

    def vote(self, step: int) -> StepDecision:
        """Loop thread, every rank, once per step: this rank is ready; returns the decision.

        Raises ``CommitVoteTimeout`` when no decision came within the timeout (this rank's own
        wait: a rank that never arrives, and a driver that never vetoed).
        """
        import torch.distributed as dist

        arrived = self.store.add(f"{self.prefix}step/{step}/ready", 1)
        key = f"{self.prefix}step/{step}"
        if arrived == self.world_size:
            wanted = self._commit_decision(step)
            decided = self.store.compare_set(key, "", wanted.encode()).decode()
            self._forget(step - 2)
            return StepDecision.decode(decided)
        try:
            self.store.wait([key], self.timeout)
        except dist.DistStoreError as error:
            waited = self.timeout.total_seconds()
            raise CommitVoteTimeout(
                f"step {step}: no commit decision within {waited:g} s ({arrived} of "
                f"{self.world_size} ranks had voted when this one arrived)"
            ) from error
        return StepDecision.decode(self.store.get(key).decode())

    def _commit_decision(self, step: int) -> StepDecision:
        pause, interval = (value.decode() for value in self.store.multi_get(self._control_keys))
        verdict = {NO_PAUSE: Verdict.COMMIT, "checkpoint": Verdict.COMMIT_PAUSE_CHECKPOINT}.get(
            pause, Verdict.COMMIT_AND_PAUSE
        )
        every = int(interval)
        # A pause is a mesh change's boundary: its snapshot is what a failure while the next mesh
        # configures goes back to.
        snapshot = every > 0 and (step % every == 0 or verdict != Verdict.COMMIT)
        return StepDecision(verdict, snapshot=snapshot)

    def _forget(self, step: int) -> None:
        # Two steps back every rank has read its decision; keep the store small on long runs.
        if step >= 1:
            self.store.delete_key(f"{self.prefix}step/{step}")
            self.store.delete_key(f"{self.prefix}step/{step}/ready")
