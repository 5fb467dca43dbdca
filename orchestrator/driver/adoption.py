"""A driver that can die: finding a run's live ranks and adopting them (``runtime.survive_driver_loss``).

Runs on the driver. With the option on, the run's rank actors, their placement groups and the
rendezvous store's actor are detached and named in the run's Ray namespace (``run_namespace``:
the job's name and config hash, so a retried Ray job finds its run by its config alone). They
outlive the driver under a lease (``workers/driver_lease.py``) that ``LeaseKeeper`` renews twice a
second from a thread of its own, so a busy driver loop never lets it lapse. When the driver is
gone the store pauses the generation at the next step boundary (the commit vote's pause): every
rank applies the step being decided, leaves the generation keeping its slices and waits.

A driver started again for the same run (``Adoption.adopt``, from ``Controller._start``):

    1. finds the store by name and reads its ``DriverRecord`` (the run's config, record
       directory, generation, last step); a config that differs is refused (one line, exit 2);
    2. finds the rank actors by name and reads each one's ``LiveRank``; ranks still in a step
       are asked to pause at the next boundary, and read again;
    3. ``decide``: every rank of the last generation alive and holding its state at the same step
       -> adopt: the controller configures the next generation on the same actors, every rank
       starting from its kept slices (like the resume after a drain's pause): 0 steps lost.
       Anything else -> the leftovers are stopped and the run resumes from the checkpoint as a
       new driver does without the option (or starts fresh), and says which.

Without the option the controller holds a ``NoAdoption`` and nothing here runs.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import ray
import yaml

from elastic.spec import MeshSpec
from orchestrator.config import JobConfig
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.driver.states import NextGeneration
from orchestrator.driver.worker_group import RANK_ACTOR_PREFIX, STORE_HOST_NAME, AdoptedActor
from orchestrator.errors import ConfigError
from orchestrator.observe.events import EventLog, read_events
from workers.spec.messages import DriverRecord, LiveRank, Phase, StartFrom, StartMode

log = logging.getLogger("meshpilot")

# Seconds between the driver's lease renewals (the store pauses after a few missed ones).
RENEW_INTERVAL_S = 0.5
# Seconds a driver waits for every live rank to reach a step boundary before it gives up adopting.
PAUSE_WAIT_S = 60.0
# Keys that may differ between the adopted run's config and the adopting driver's: where the
# driver connects, where its record, metrics and tracking go.
_FREE_KEYS = ("runtime.address", "runtime.run_dir", "metrics.", "tracking.")


RUN_NAMESPACE_PREFIX = "meshpilot-"


def run_namespace(config: JobConfig) -> str:
    """The Ray namespace of ``config``'s detached actors: the same config names the same run."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", config.name)
    return f"{RUN_NAMESPACE_PREFIX}{name}-{config.config_hash()[:12]}"


def differing_keys(recorded: dict[str, Any], config: JobConfig) -> list[str]:
    """The config keys (dotted) whose values differ between a run's recorded config and ``config``,
    leaving out those an adopting driver may change (``_FREE_KEYS``)."""
    old, new = _flatten(recorded), _flatten(config.to_dict())
    keys = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
    return [key for key in keys if not key.startswith(_FREE_KEYS)]


def check_same_config(recorded_yaml: str, config: JobConfig, *, where: str) -> None:
    """Raise ConfigError (one line, exit 2) when the run recorded at ``where`` had another config."""
    keys = differing_keys(yaml.safe_load(recorded_yaml) or {}, config)
    if keys:
        shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        raise ConfigError(
            f"the run at {where} was started with another config ({shown} differ): adopt it with the "
            "config it was started with (its config.yaml), or start a new run under another name"
        )


class AdoptingGroup(Protocol):
    """What adoption needs of the worker group (``WorkerGroup``; a fake in the unit tests)."""

    store_host: Any
    slots: Any  # every actor of the run, each with an ``actor`` handle

    def take_over(self, ranks: Sequence[AdoptedActor], store_host: Any, store_address: tuple[str, int]) -> None: ...


def adoption_for(
    config: JobConfig, group: Any, router: ReportRouter, events: EventLog, progress: Callable[[], tuple[int, int]]
) -> Adoption | NoAdoption:
    """The controller's adoption: ``Adoption`` with ``runtime.survive_driver_loss``, else ``NoAdoption``."""
    if not config.runtime.survive_driver_loss:
        return NoAdoption()
    return Adoption(config, group=group, router=router, events=events, progress=progress)


# Phases a rank leaves on its own, for a step boundary (the store's pause) or a configured generation.
BETWEEN_BOUNDARIES = (Phase.STEP, Phase.EVAL, Phase.CHECKPOINT, Phase.CONFIGURING)


@dataclass(frozen=True)
class Adopt:
    """Every rank of ``generation`` is alive and holds its state after ``step``: take them over."""

    generation: int
    mesh: MeshSpec
    step: int


@dataclass(frozen=True)
class AwaitBoundary:
    """Some ranks are still in a step (the store's pause has not reached them yet): look again."""

    generation: int


@dataclass(frozen=True)
class Decline:
    """The live ranks cannot carry the run on (``reason``): stop them, resume as without them."""

    reason: str


def decide(ranks: Sequence[LiveRank]) -> Adopt | AwaitBoundary | Decline:
    """What to do with the run's live ranks (pure: the unit tests call it with plain values)."""
    if not ranks:
        return Decline("no rank of the run is alive")
    generation = max(rank.generation for rank in ranks)
    current = [rank for rank in ranks if rank.generation == generation]
    mesh_dict = current[0].mesh
    if generation <= 0 or mesh_dict is None:
        return Decline("the live ranks never joined a generation")
    mesh = MeshSpec.from_dict(mesh_dict)
    numbers = sorted(rank.rank for rank in current)
    if numbers != list(range(mesh.world_size)):
        missing = sorted(set(range(mesh.world_size)) - set(numbers))
        return Decline(f"ranks {missing} of generation {generation} are gone")
    if any(rank.phase in BETWEEN_BOUNDARIES for rank in current):
        return AwaitBoundary(generation)
    if not all(rank.holds_state for rank in current):
        idle = sorted(rank.rank for rank in current if not rank.holds_state)
        return Decline(f"ranks {idle} of generation {generation} hold no state at a step boundary")
    steps = {rank.last_step for rank in current}
    if len(steps) != 1:
        return Decline(f"the ranks of generation {generation} stopped at different steps {sorted(steps)}")
    return Adopt(generation=generation, mesh=mesh, step=steps.pop())


@dataclass(frozen=True)
class Adopted:
    """What the controller continues from: the adopted generation's number and the next one to configure."""

    generation: int
    next: NextGeneration


@dataclass(frozen=True)
class LiveRun:
    """A run's detached actors found in its namespace: the store, its record, the rank actors."""

    store: Any
    record: DriverRecord
    actors: list[tuple[str, Any]]  # (name, handle)


class NoAdoption:
    """``runtime.survive_driver_loss`` off: the actors die with the driver; nothing to adopt or renew."""

    def adopt(self, resume_step: int | None) -> Adopted | None:
        return None

    def close(self) -> None:
        pass


class Adoption:
    """Driver side, with ``runtime.survive_driver_loss``: adopts a live run at the start (or says
    why not), then keeps the run's leases renewed until ``close``."""

    def __init__(
        self,
        config: JobConfig,
        *,
        group: AdoptingGroup,
        router: ReportRouter,
        events: EventLog,
        progress: Callable[[], tuple[int, int]],
    ) -> None:
        """``progress``: the controller's generation and last step, read at each renewal."""
        self.config = config
        self.group = group
        self.router = router
        self.events = events
        self.keeper = LeaseKeeper(group, progress, config_yaml=config.to_yaml(), run_dir=_run_dir(events))

    def adopt(self, resume_step: int | None) -> Adopted | None:
        """Driver, in ``Controller._start``: take the run's live ranks over, or None (after an
        ``adoption`` event saying what the run resumes from instead: ``resume_step``'s checkpoint,
        or a fresh start). Raises ConfigError when the live run had another config."""
        began = time.monotonic()
        # The driver's Ray namespace: the run's (``cluster.connect`` joined it), unless the caller
        # had connected already (a test in its own process, which no later driver adopts).
        namespace = ray.get_runtime_context().namespace
        try:
            live = find_live_run(namespace)
            if live is None:
                self._declined(f"no live run in Ray namespace {namespace}", resume_step, quiet=True)
                return None
            check_same_config(live.record.config_yaml, self.config, where=f"Ray namespace {namespace}")
            decision, states = self._await_boundary(live)
            if not isinstance(decision, Adopt):
                stop_live_run(live)
                self._declined(decision.reason, resume_step)
                return None
            return self._take_over(live, decision, states, began)
        finally:
            self.keeper.start()

    def _await_boundary(self, live: LiveRun) -> tuple[Adopt | Decline, dict[int, tuple[Any, str, LiveRank]]]:
        """Read the live ranks until every one is at a step boundary (asking their generation to
        pause at the next one meanwhile), for up to ``PAUSE_WAIT_S``."""
        deadline = time.monotonic() + PAUSE_WAIT_S
        while True:
            states = live_states(live.actors)
            decision = decide([state for _, _, state in states.values()])
            if not isinstance(decision, AwaitBoundary):
                return decision, states
            if time.monotonic() > deadline:
                return Decline(f"the live ranks did not reach a step boundary within {PAUSE_WAIT_S:g} s"), states
            live.store.request_pause.remote(decision.generation)
            time.sleep(0.2)

    def _take_over(
        self, live: LiveRun, decision: Adopt, states: dict[int, tuple[Any, str, LiveRank]], began: float
    ) -> Adopted:
        ranks = [states[rank] for rank in range(decision.mesh.world_size)]
        adopted = [_adopted_actor(actor, name) for actor, name, _ in ranks]
        store_address = ray.get(live.store.address.remote(), timeout=30)
        ray.get(live.store.clear_pause.remote(decision.generation + 1), timeout=30)  # the one configured next
        self.group.take_over(adopted, live.store, store_address)
        ray.get([actor.adopt.remote() for actor, _, _ in ranks], timeout=30)
        # Steps the dead driver recorded are not recorded again; those after it come from the
        # ranks' queued reports.
        recorded = _recorded_step(live.record)
        self.router.rewind(recorded)
        # Close the leftovers (spares, actors of earlier generations): actors not in the adopted
        # mesh, and their placement groups unless an adopted rank sits in one.
        adopted_names = {name for _, name, _ in ranks}
        leftovers = [(name, actor) for name, actor in live.actors if name not in adopted_names]
        _stop_actors(leftovers, keep_groups={actor.placement_group_name for actor in adopted})
        message = (
            f"adopted {decision.mesh.world_size} live ranks of generation {decision.generation} at step "
            f"{decision.step} (the previous driver recorded up to step {recorded}): 0 steps lost"
        )
        log.warning("%s", message)
        self.events.emit(
            "adopted",
            generation=decision.generation,
            step=decision.step,
            recorded_step=recorded,
            world_size=decision.mesh.world_size,
            mesh=decision.mesh.as_dict(),
            previous_run_dir=live.record.run_dir,
            lost_steps=0,
            adopt_s=round(time.monotonic() - began, 3),
        )
        starts = (StartFrom(StartMode.KEPT, decision.step),) * decision.mesh.world_size
        # Paused after the step with every rank alive: its saves still commit (the shards the ranks
        # report from here on; those the dead driver took along never complete).
        following = NextGeneration(decision.mesh, starts, paused_after=decision.step)
        return Adopted(generation=decision.generation, next=following)

    def _declined(self, reason: str, resume_step: int | None, *, quiet: bool = False) -> None:
        source = "fresh" if resume_step is None else "checkpoint"
        resumes = "starts fresh" if resume_step is None else f"resumes from checkpoint step {resume_step}"
        (log.info if quiet else log.warning)("no live ranks to adopt (%s): the run %s", reason, resumes)
        self.events.emit("adoption", adopted=False, reason=reason, source=source, step=resume_step)

    def close(self) -> None:
        """Driver, at the end of the run (after the group's shutdown): stop renewing."""
        self.keeper.stop()


class LeaseKeeper:
    """A driver thread renewing the store's and every rank actor's lease twice a second."""

    def __init__(
        self, group: AdoptingGroup, progress: Callable[[], tuple[int, int]], *, config_yaml: str, run_dir: str | None
    ) -> None:
        self.group = group
        self.progress = progress
        self.config_yaml = config_yaml
        self.run_dir = run_dir
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._recorded_for: Any = None  # the store told the run's config and record directory

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="driver-lease", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(RENEW_INTERVAL_S):
            try:
                self.renew()
            except Exception as error:  # noqa: BLE001 - a failed renewal is retried next second
                log.debug("lease renewal failed: %s", error)

    def renew(self) -> None:
        """One renewal (fire and forget: a dead actor's is dropped)."""
        store = self.group.store_host
        if store is not None:
            if self._recorded_for is not store:
                store.begin_record.remote(self.config_yaml, self.run_dir)
                self._recorded_for = store
            generation, last_step = self.progress()
            store.renew_lease.remote(generation, last_step)
        for slot in list(self.group.slots):
            slot.actor.renew_lease.remote()


def find_live_run(namespace: str) -> LiveRun | None:
    """The run's detached store and rank actors in ``namespace``, or None without a live store."""
    try:
        store: Any = ray.get_actor(STORE_HOST_NAME, namespace=namespace)
        record: DriverRecord = ray.get(store.driver_record.remote(), timeout=30)
    except (ValueError, ray.exceptions.RayError):
        return None
    names = [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry.get("namespace") == namespace and entry["name"].startswith(RANK_ACTOR_PREFIX)
    ]
    actors = []
    for name in names:
        try:
            actors.append((name, ray.get_actor(name, namespace=namespace)))
        except ValueError:
            continue  # gone since the listing
    return LiveRun(store=store, record=record, actors=actors)


def live_states(actors: Sequence[tuple[str, Any]]) -> dict[int, tuple[Any, str, LiveRank]]:
    """Each answering actor's ``LiveRank``, by its rank in its generation (the newest generation wins)."""
    refs = [actor.live_state.remote() for _, actor in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10) if refs else ([], [])
    states: dict[int, tuple[Any, str, LiveRank]] = {}
    for (name, actor), ref in zip(actors, refs):
        if ref not in ready:
            continue
        try:
            state: LiveRank = ray.get(ref)
        except ray.exceptions.RayError:
            continue  # died since it was found
        known = states.get(state.rank)
        if state.rank >= 0 and (known is None or known[2].generation < state.generation):
            states[state.rank] = (actor, name, state)
    return states


def stop_live_run(live: LiveRun) -> None:
    """End a live run that cannot be adopted: its actors and their placement groups."""
    _stop_actors(live.actors, keep_groups=set())
    ray.kill(live.store, no_restart=True)


def _stop_actors(actors: Sequence[tuple[str, Any]], *, keep_groups: set[str]) -> None:
    """Kill these rank actors, and remove their placement groups but ``keep_groups`` (detached,
    a group would otherwise hold its resources for ever)."""
    for _, actor in actors:
        ray.kill(actor, no_restart=True)
    for group_name in {_parse_name(name)[0] for name, _ in actors} - keep_groups:
        try:
            ray.util.remove_placement_group(ray.util.get_placement_group(group_name))
        except ValueError:
            continue  # already gone


def _adopted_actor(actor: Any, name: str) -> AdoptedActor:
    group_name, bundle_index = _parse_name(name)
    info = ray.get(actor.info.remote(), timeout=30)
    return AdoptedActor(
        actor=actor,
        placement_group=ray.util.get_placement_group(group_name),
        placement_group_name=group_name,
        bundle_index=bundle_index,
        node_id=info["node_id"],
    )


def _parse_name(name: str) -> tuple[str, int]:
    """A rank actor's placement group name and bundle (``worker_group.rank_actor_name``)."""
    _, group_name, bundle, _ = name.split("|")
    return group_name, int(bundle)


def _recorded_step(record: DriverRecord) -> int:
    """The last step event the dead driver wrote: read from its record when it is on this
    machine, else the last step it renewed its lease with (a step may then be recorded twice)."""
    if record.run_dir is not None:
        path = Path(record.run_dir) / "events.jsonl"
        if path.exists():
            steps = [event["step"] for event in read_events(path) if event["event"] == "step"]
            return max(steps, default=0)
    return record.last_step


def _run_dir(events: EventLog) -> str | None:
    return str(events.path.parent.resolve()) if events.path else None


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat
