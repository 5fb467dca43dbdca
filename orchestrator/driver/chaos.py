"""A seeded chaos schedule: N overlapping faults drawn reproducibly over a run.

Runs on the driver, before the controller starts. ``--chaos SEED[:N]`` on ``meshpilot train``
(or ``chaos=`` of ``meshpilot.train``) draws N faults (default 6) from the kinds the cluster
allows, at distinct steps over the run, on ranks of the starting mesh; about one in three
step faults that start a recovery is followed by a ``/configure`` fault that lands during that
recovery (kill or raise while the new mesh configures). Faults at nearby steps overlap with the
drains, grows, uploads and restores that earlier ones set off. The same seed, config and kinds
give the same schedule: it is logged, and recorded as the run's ``fault_schedule`` event, so a
failing seed replays exactly (``--chaos`` again, or each fault with ``--inject``).

A fault whose rank is not in the mesh of its step (the mesh shrank) does not fire.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from orchestrator.errors import UserError
from workers.faults import CONFIGURE_KINDS, NETWORK_KINDS, SLOW_FACTOR, FaultKind, FaultPhase, FaultSpec

DEFAULT_FAULTS = 6
# Faults keep off the first steps (start-up) and the last one.
FIRST_FAULT_STEP = 3
# Kinds after which the mesh is rebuilt for the step the fault interrupted (redone), and kinds
# after which it is rebuilt after the step completed (a pause at the boundary, a node lost after
# its step): a ``/configure`` fault follows at that step.
REDONE_STEP_KINDS = (FaultKind.KILL, FaultKind.RAISE, FaultKind.HANG)
NEXT_STEP_KINDS = (FaultKind.SIGTERM, FaultKind.DRAIN, FaultKind.NODE)
DURING_RECOVERY_ODDS = 1 / 3
# A drawn partition lasts this long (past the driver's detection, short of Ray's ~15 s verdict, so
# the node comes back), and a drawn slow link is capped at this rate for the rest of the run.
CHAOS_PARTITION_S = 8.0
CHAOS_THROTTLE_MBIT = 50.0


def parse_chaos(text: str) -> tuple[int, int]:
    """``SEED[:N]`` -> (seed, count); ``UserError`` naming the fix."""
    seed_text, _, count_text = text.partition(":")
    try:
        seed = int(seed_text)
        count = int(count_text) if count_text else DEFAULT_FAULTS
    except ValueError:
        raise UserError(f"--chaos {text!r}: expected SEED[:N] with integers, e.g. --chaos 7:6") from None
    if seed < 0 or count < 1:
        raise UserError(f"--chaos {text!r}: SEED must be >= 0 and N >= 1")
    return seed, count


def chaos_kinds(*, storage: bool, nodes: bool, network: bool = False) -> tuple[FaultKind, ...]:
    """The kinds a run can meet: a rank slowed ``SLOW_FACTOR`` times (a straggler) always;
    storage outages only with checkpoints to upload; drains and node losses only with other
    nodes to go to (a multi-node cluster); partitions and slow links only on nodes with networks
    of their own (tests/fixtures/netns_nodes.py)."""
    kinds = [FaultKind.KILL, FaultKind.RAISE, FaultKind.HANG, FaultKind.SIGTERM, FaultKind.SLOW]
    if storage:
        kinds.append(FaultKind.S3_OUTAGE)
    if nodes:
        kinds += [FaultKind.DRAIN, FaultKind.NODE]
    if network:
        kinds += [FaultKind.PARTITION, FaultKind.THROTTLE]
    return tuple(kinds)


def chaos_schedule(
    seed: int,
    count: int,
    *,
    steps: int,
    world_size: int,
    replica_size: int,
    kinds: Sequence[FaultKind],
    network_nodes: int = 2,
) -> tuple[FaultSpec, ...]:
    """``count`` faults for a run of ``steps`` steps on ``world_size`` ranks, drawn from ``seed``.
    A network fault's NODE is one of the run's first ``network_nodes`` worker nodes.

    ``/configure`` faults pick a rank below ``replica_size``: the first replica group's ranks are
    the ones every later mesh still has.
    """
    last = steps - 1
    if last - FIRST_FAULT_STEP + 1 < count:
        raise UserError(
            f"--chaos: {count} faults need at least {count + FIRST_FAULT_STEP} steps (training.steps={steps}); "
            "ask for fewer faults or more steps"
        )
    rng = random.Random(seed)
    steps_drawn = sorted(rng.sample(range(FIRST_FAULT_STEP, last + 1), count))
    faults: list[FaultSpec] = []
    for step in steps_drawn:
        if len(faults) == count:
            break
        kind = rng.choice(list(kinds))
        if kind in NETWORK_KINDS:
            faults.append(_network_fault(kind, step, rng.randrange(network_nodes)))
            continue
        factor = SLOW_FACTOR if kind == FaultKind.SLOW else 0.0
        faults.append(FaultSpec(kind, step, rng.randrange(world_size), factor=factor))
        if len(faults) < count and rng.random() < DURING_RECOVERY_ODDS:
            recovery_step = step if kind in REDONE_STEP_KINDS else step + 1 if kind in NEXT_STEP_KINDS else None
            if recovery_step is not None and recovery_step <= last:
                faults.append(
                    FaultSpec(
                        rng.choice(CONFIGURE_KINDS), recovery_step, rng.randrange(replica_size), FaultPhase.CONFIGURE
                    )
                )
    return tuple(faults)


def _network_fault(kind: FaultKind, step: int, node: int) -> FaultSpec:
    value = CHAOS_PARTITION_S if kind == FaultKind.PARTITION else CHAOS_THROTTLE_MBIT
    return FaultSpec(kind, step, node, values=(value,))
