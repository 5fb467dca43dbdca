"""What must hold after any run, however many faults it met: the invariant report.

Runs on the driver (or a test, or ``bench/chaos.py``) after a run ended, from what the run left:
its events, its sample ledger, its checkpoint storage and the Ray cluster. Each check is one
line of the report, PASS or FAIL with what was found:

    finished          the run reached its target step
    steps             every step applied exactly once (a restore rewinds: the steps after its
                      checkpoint are redone, once)
    losses            every step's loss equals the reference run's (relative tolerance), the last
                      time the step was applied
    samples           every global sample consumed exactly once (the ``data.record_samples`` ledger)
    replicas          the replica groups ended bitwise identical
    checkpoints       every committed checkpoint verifies (checksums of every block)
    leftovers         no rank actor, placement group or multipart upload of the run left behind,
                      and no detached actor (``runtime.survive_driver_loss``) outliving its lease

A check without its input (no reference, no ledger, no storage) is left out of the report.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkpointing.catalog import list_committed
from checkpointing.errors import CheckpointError
from checkpointing.storage import StorageBackend
from checkpointing.verify import verify_checkpoint


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class InvariantReport:
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def failed(self) -> list[Check]:
        return [check for check in self.checks if not check.ok]

    def describe(self) -> str:
        return "\n".join(f"{'PASS' if c.ok else 'FAIL'} {c.name:<12} {c.detail}" for c in self.checks)


def check_run(
    events: Sequence[dict[str, Any]],
    *,
    steps: int,
    reference_losses: Mapping[int, float] | None = None,
    rel: float = 1e-3,
    ledger: Sequence[dict[str, Any]] | None = None,
    global_batch: int | None = None,
    storage: StorageBackend | None = None,
    leftovers: Callable[[], list[str]] | None = None,
) -> InvariantReport:
    """The invariants of a run that ended with ``events``; see the module docstring."""
    checks = [_finished(events, steps), _steps_once(events, steps)]
    if reference_losses is not None:
        checks.append(_losses(events, reference_losses, rel))
    if ledger is not None and global_batch is not None:
        checks.append(_samples_once(ledger, steps, global_batch))
    checks.append(_replicas(events))
    if storage is not None:
        checks.append(_checkpoints_verify(storage))
    if leftovers is not None:
        found = leftovers()
        checks.append(Check("leftovers", not found, "; ".join(found) if found else "none"))
    return InvariantReport(tuple(checks))


def _finished(events: Sequence[dict[str, Any]], steps: int) -> Check:
    done = [e for e in events if e["event"] == "done"]
    if not done:
        return Check("finished", False, "no done event: the driver did not end the run")
    last = done[-1]
    ok = last["status"] == "finished" and last["steps"] == steps
    return Check("finished", ok, f"{last['status']} after {last['steps']} of {steps} steps ({last.get('reason')})")


def _steps_once(events: Sequence[dict[str, Any]], steps: int) -> Check:
    applied: set[int] = set()
    repeated: list[int] = []
    redone = 0
    for event in events:
        if event["event"] == "restored":
            rewound = {step for step in applied if step > event["step"]}
            redone += len(rewound)
            applied -= rewound
        elif event["event"] == "step":
            if event["step"] in applied:
                repeated.append(event["step"])
            applied.add(event["step"])
    missing = sorted(set(range(1, steps + 1)) - applied)
    ok = not repeated and not missing
    detail = f"{len(applied)} steps, {redone} redone after restores"
    if repeated:
        detail += f"; applied twice without a restore: {repeated[:10]}"
    if missing:
        detail += f"; never applied: {missing[:10]}"
    return Check("steps", ok, detail)


def _losses(events: Sequence[dict[str, Any]], reference: Mapping[int, float], rel: float) -> Check:
    last: dict[int, dict[str, Any]] = {}
    for event in events:
        if event["event"] == "step":
            last[event["step"]] = event
    worst, worst_step, off = 0.0, None, []
    for step, event in sorted(last.items()):
        if event.get("loss_partial") or step not in reference or event["loss"] is None:
            continue  # a rank that died between applying and reporting took its slice's loss along
        error = abs(event["loss"] - reference[step]) / max(abs(reference[step]), 1e-12)
        if error > worst:
            worst, worst_step = error, step
        if error > rel:
            off.append(step)
    detail = f"largest relative difference {worst:.2e} (step {worst_step}), tolerance {rel:g}"
    if off:
        detail += f"; off at steps {off[:10]}"
    return Check("losses", not off, detail)


def _samples_once(ledger: Sequence[dict[str, Any]], steps: int, global_batch: int) -> Check:
    counts = Counter(index for line in ledger for index in line["indices"])
    expected = set(range(steps * global_batch))
    twice = sorted(index for index, count in counts.items() if count > 1)
    missing = sorted(expected - set(counts))
    extra = sorted(set(counts) - expected)
    ok = not twice and not missing and not extra
    detail = f"{len(counts)} of {len(expected)} samples"
    for label, found in (("consumed twice", twice), ("never consumed", missing), ("beyond the run", extra)):
        if found:
            detail += f"; {label}: {found[:10]}"
    return Check("samples", ok, detail)


def _replicas(events: Sequence[dict[str, Any]]) -> Check:
    done = [e for e in events if e["event"] == "done"]
    consistent = done[-1].get("replicas_consistent") if done else None
    detail = {True: "bitwise identical", False: "diverged", None: "one replica group at the end"}[consistent]
    return Check("replicas", consistent is not False, detail)


def _checkpoints_verify(storage: StorageBackend) -> Check:
    steps = list_committed(storage)
    bad = []
    for step in steps:
        try:
            result = verify_checkpoint(storage, step)
        except CheckpointError as error:
            bad.append(f"step {step}: {error}")
            continue
        bad += [f"step {step}: {key}: {what}" for key, what in result.problems]
    return Check("checkpoints", not bad, f"{len(steps)} committed, all verify" if not bad else "; ".join(bad[:5]))


def ray_leftovers(
    storage: StorageBackend | None = None,
    *,
    actor_classes: tuple[str, ...] = ("RankActor", "StoreHost"),
    wait_s=10.0,
    driver_lease_s: float | None = None,
) -> list[str]:
    """What a finished run left on the cluster: live actors of ``actor_classes``, detached actors
    of any run's namespace, placement groups not removed, multipart uploads still open under
    ``storage``. Ray's state lags a little behind the kills: looks again for up to ``wait_s``.
    ``driver_lease_s``: a run whose last driver died (``runtime.survive_driver_loss``) leaves its
    detached actors until their lease runs out: they are left behind only if they outlive it."""
    import ray

    from orchestrator.driver.adoption import RUN_NAMESPACE_PREFIX
    from orchestrator.driver.ray_compat import live_actors

    deadline = time.monotonic() + wait_s + (driver_lease_s or 0.0)
    while True:
        found = [f"actor {name} {actor_id[:8]}" for name, actor_id in live_actors() if name in actor_classes]
        found += [
            f"detached actor {entry['namespace']}/{entry['name']}"
            for entry in ray.util.list_named_actors(all_namespaces=True)
            if str(entry.get("namespace", "")).startswith(RUN_NAMESPACE_PREFIX)
        ]
        found += [
            f"placement group {group_id[:8]} ({group['state']})"
            for group_id, group in ray.util.placement_group_table().items()
            if group["state"] != "REMOVED"
        ]
        if storage is not None:
            found += [f"multipart upload {upload.key}" for upload in storage.list_pending_uploads()]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)
