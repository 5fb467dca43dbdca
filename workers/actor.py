"""The rank actor: one Ray actor per rank, holding that rank's process, state and loop.

Runs on the worker side; the driver imports this module only for the class handle, so the
heavy imports (torch, torch.distributed) happen inside the methods, in the actor's process.

The actor is threaded (``max_concurrency`` > 1): ``run`` occupies one thread with the training
loop while ``poll`` (reports + heartbeat), ``request_stop`` and friends are answered on others,
even when the loop is blocked inside a collective. Call sequence, driver side:

    1. all ranks: ``configure(generation, rank, mesh, store address, start)`` — collective:
       joins the generation's process group, builds the Trainer, then initialises, restores
       or rebinds the state;
    2. all ranks: ``run(last_step)`` — the loop; returns when done, paused, aborted or failed
       (never raises: errors come back as an outcome, so no exception object keeps a dead
       process group alive). Unless it finished, the rank leaves the generation on the way
       out, keeping its slices for a ``configure(start=kept)``;
    3. any time, from the driver: ``poll()``, ``request_stop()``, ``abort_collectives(generation)``;
       ``shutdown()`` at the end. With ``runtime.survive_driver_loss`` the actor is detached and
       exits when no driver renews its lease (``renew_lease``, every poll); a new driver finds it
       by name, reads ``live_state()`` and ``adopt()``s it, then configures the next generation.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any

from elastic.spec import MeshSpec
from workers.device import PeerWaitMarker
from workers.driver_lease import DriverLease, exit_process, start_watch
from workers.faults import REPORTS_BEFORE_KILL_S, FaultInjector, FaultSpec
from workers.group_abort import abort_groups, release_collectives, watch_abort
from workers.notices import InstanceActionWatcher, watch_sigterm
from workers.peer_snapshots import SnapshotStore, StaleSnapshotError
from workers.rank_failures import PeerFailedWhileConfiguring, classify_failure, describe_error
from workers.reporting import RankLogHandler, ReportChannel
from workers.sockets import GroupSockets
from workers.spec import TrainSpec
from workers.spec.messages import (
    FailureKind,
    Heartbeat,
    LiveRank,
    NoticeScope,
    Phase,
    RunOutcome,
    RunStatus,
    SnapshotPlan,
    SnapshotReport,
    StartFrom,
    StartMode,
)

if TYPE_CHECKING:  # for annotations only: the actor's process imports these inside the methods
    import torch
    import torch.distributed as dist

    from workers.checkpoints import NoCheckpoints, RankCheckpoints
    from workers.data import SampleSource
    from workers.device import RankDevice
    from workers.evaluation import Evaluator
    from workers.peer_snapshots import RankSnapshots
    from workers.rendezvous import StepCommitter
    from workers.trainer import Trainer

log = logging.getLogger("meshpilot.rank")


class RankActor:
    """One rank. Construct with ``ray.remote(RankActor).options(max_concurrency=4, ...)``."""

    def __init__(self, *, spec: TrainSpec, data: bytes | None) -> None:
        import torch

        # A native crash (a segfault in a backend thread) prints every Python thread's stack to
        # the worker's log, not only the crashing thread's (Ray's default), which may have none.
        faulthandler.enable(all_threads=True)
        # Ray sets OMP_NUM_THREADS=1; torch's intra-op pool must agree or ranks oversubscribe cores.
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        import torch._dynamo  # noqa: F401  -- imported lazily by the first FSDP step otherwise (~1 s)

        from checkpointing.torch_compat import REDISTRIBUTE_LOGGER

        logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)

        self.spec = spec
        self.data = data
        self.channel = ReportChannel()
        logging.getLogger("meshpilot").addHandler(RankLogHandler(self.channel))
        logging.getLogger("meshpilot").setLevel(logging.INFO)
        self.rank, self.generation = -1, -1
        self.mesh: MeshSpec | None = None
        self.trainer: Trainer | None = None
        self.source: SampleSource | None = None  # the generation's samples (the trainer reads them)
        self.checkpoints: RankCheckpoints | NoCheckpoints | None = None
        # Peer-memory snapshots: this rank's and its peers' copies (kept across generations),
        # and the current generation's writer (None: snapshots off).
        self.snapshot_store = SnapshotStore()
        self.snapshots: RankSnapshots | None = None
        self.store: dist.Store | None = None
        self.committer: StepCommitter | None = None
        self.last_step = 0
        self._kept_shards: dict[str, torch.Tensor] | None = None
        self._stop = threading.Event()
        # Set when the driver aborted this generation's groups: any error the loop sees after
        # that is a consequence of another rank's failure, whatever torch's message says.
        self._aborted = threading.Event()
        self._aborted_generation = -1  # the latest one aborted: its abort may overtake its configure
        self._phase = (Phase.STARTING, time.monotonic())
        self._loop_thread: int | None = None
        # Where the loop waits for its peers, marked by the trainer (hang blame reads it).
        self._peer_waits = PeerWaitMarker()
        # The device of the current (or last) generation: synced and emptied after leaving one.
        self.device: RankDevice | None = None
        self._drain_reported = False
        watch_sigterm(lambda reason: self._drain_notice(reason, NoticeScope.PROCESS))
        self._instance_watcher = None
        if spec.instance_action_url:
            import ray

            url = spec.instance_action_url.replace("{node_id}", ray.get_runtime_context().get_node_id())
            self._instance_watcher = InstanceActionWatcher(
                url, interval_s=spec.instance_action_poll_s, on_notice=self._drain_notice
            ).start()
        # Whether the trainer holds the job's state (its configure filled it).
        self._filled = False
        # Sockets opened by this generation's process groups (workers/sockets.py), and those before.
        self._group_sockets: set[str] = set()
        self._sockets_before_join: set[str] = set()
        self.faults = FaultInjector((), rank=-1)
        # runtime.survive_driver_loss: a detached actor, alive while some driver renews its lease.
        self.lease: DriverLease | None = None
        if spec.driver_lease_s is not None:
            self.lease = DriverLease(spec.driver_lease_s)
            start_watch(self.lease, holder=f"rank actor (pid {os.getpid()})", on_expiry=self._lease_ran_out)
        if spec.compile:
            import ray

            from workers.compile import use_job_caches

            use_job_caches(spec.compile_cache_dir, ray.get_runtime_context().get_node_id())

    # ------------------------------------------------------------------ control
    def info(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def poll(self) -> Heartbeat:
        self.renew_lease()
        phase, since = self._phase
        waiting, where = (
            self._peer_waits.position(self._loop_thread) if phase in (Phase.STEP, Phase.EVAL) else (None, None)
        )
        return Heartbeat(
            rank=self.rank,
            phase=phase,
            step=self.last_step,
            phase_age_s=time.monotonic() - since,
            reports=tuple(self.channel.drain()),
            waiting=waiting,
            where=where,
        )

    def renew_lease(self) -> None:
        """Control thread, from the driver (every poll, and twice a second): the driver lives."""
        if self.lease is not None:
            self.lease.renew()

    def _lease_ran_out(self) -> None:
        """Lease watch thread: no driver for ``runtime.driver_lease_s``. The rank's placement group
        goes first (detached too, it would hold its resources for ever), which ends this actor and
        the others in it; then this process, whatever its loop is blocked in."""
        import ray

        group = ray.util.get_current_placement_group()
        if group is not None:
            ray.util.remove_placement_group(group)
        exit_process("rank actor", self.lease.lease_s if self.lease is not None else 0.0)

    def live_state(self) -> LiveRank:
        """Control thread, from a driver looking for the run's live ranks to adopt
        (``orchestrator/driver/adoption.py``): where this rank stands."""
        self.renew_lease()
        phase, _ = self._phase
        return LiveRank(
            rank=self.rank,
            generation=self.generation,
            mesh=self.mesh.as_dict() if self.mesh is not None else None,
            last_step=self.last_step,
            phase=phase,
            # Paused: the slices kept as it left the generation. Finished (a fast run may end
            # before the driver's silence pauses it) or configured and never run (the driver died
            # as the generation configured): its filled trainer's, kept by the next configure.
            holds_state=(phase == Phase.PAUSED and self._kept_shards is not None)
            or (phase in (Phase.FINISHED, Phase.READY) and self.trainer is not None and self._filled),
        )

    def adopt(self) -> None:
        """Control thread, once, from the driver that adopts this rank: it gets the reports the
        dead driver drained last (it may have died before handling them) with those queued since."""
        self.renew_lease()
        self.channel.redeliver_last()

    def _drain_notice(self, reason: str, scope: NoticeScope = NoticeScope.NODE) -> None:
        if not self._drain_reported:
            self._drain_reported = True
            self.channel.drain_notice(reason, scope)

    def keep_snapshot(self, key: str, generation: int, step: int, owner: int, data: Any) -> None:
        """Control thread, called by rank ``owner``'s snapshot copier: hold a copy of its snapshot,
        and say so to the driver (should the owner die before its own report gets there). A copy
        from a generation older than this actor's is refused (``StaleSnapshotError``): fenced by
        generation."""
        if generation < self.generation:
            raise StaleSnapshotError(
                f"rank {owner}'s snapshot of step {step} in generation {generation} refused: "
                f"this actor is in generation {self.generation}"
            )
        self.snapshot_store.put(key, (generation, step), bytes(memoryview(data)))
        self.channel.send(SnapshotReport(owner, time.time(), generation, step, copied=True))

    def read_snapshot(self, key: str, start: int, end: int) -> bytes:
        """Control thread, called by a restoring rank: bytes of a snapshot object held here."""
        return self.snapshot_store.read(key, start, end)

    def request_stop(self) -> None:
        """Stop after the step in flight (Ctrl-C, end of job)."""
        self._stop.set()

    def configure(
        self,
        *,
        generation: int,
        rank: int,
        mesh: MeshSpec,
        store_address: tuple[str, int],
        start: StartFrom,
        sync_replicas: bool = False,
        faults: tuple[FaultSpec, ...] = (),
        snapshots: SnapshotPlan | None = None,
    ) -> int:
        """Collective over the new world. Returns the last applied step of the state it holds."""
        from workers.parallelize import forget_old_meshes
        from workers.peer_snapshots import RankSnapshots
        from workers.rendezvous import connect_store

        self._set_phase(Phase.CONFIGURING)
        if self.trainer is not None:  # still in an earlier generation (a retried configure)
            # A trainer never filled (its configure failed first) holds nothing to keep: the
            # slices kept from before it stay the ones to rebind.
            self._drop_process_groups(keep_shards=start.mode == StartMode.KEPT and self._filled)
        self.rank, self.generation, self.mesh = rank, generation, mesh
        self.channel.rank = rank
        self._stop.clear()
        self._aborted.clear()
        if generation <= self._aborted_generation:  # aborted before this call got here: leave at once
            self._aborted.set()
        forget_old_meshes()
        if self.store is None:
            self.store = connect_store(*store_address)
        try:
            interval = 0 if snapshots is None else snapshots.interval_steps
            # The step this mesh resumes at: a joiner's own last step is not known before its fill.
            resumes_at = max(start.step, self.last_step) + 1
            trainer, checkpoints = self._join_generation(
                faults=faults, snapshot_interval=interval, resumes_at=resumes_at
            )
            self._fill_state(start, trainer, checkpoints)
            if snapshots is not None and snapshots.interval_steps > 0:
                store, channel, hook = self.snapshot_store, self.channel, self.faults.while_snapshotting
                self.snapshots = RankSnapshots(
                    trainer, snapshots, store, channel, generation=generation, while_copying=hook
                )
            self.faults.while_configuring(self.last_step + 1)
            if sync_replicas:
                trainer.sync_from_first_replica()
        except Exception as error:
            if classify_failure(error, aborted=self._aborted.is_set()) == FailureKind.PEER_FAILURE:
                raise PeerFailedWhileConfiguring(f"{type(error).__name__}: {error}") from error
            raise
        self._set_phase(Phase.READY)
        return self.last_step

    def _join_generation(
        self, *, faults: tuple[FaultSpec, ...], snapshot_interval: int, resumes_at: int
    ) -> tuple[Trainer, RankCheckpoints | NoCheckpoints]:
        """Inside ``configure`` (which set the generation, rank, mesh and store), collective: join
        the generation's process group, then build and keep its committer, trainer, fault
        injector and checkpoints (an empty trainer: nothing is filled yet)."""
        from workers.checkpoints import rank_checkpoints
        from workers.rendezvous import StepCommitter, join_barrier
        from workers.runtime import init_generation, make_source, pick_device
        from workers.trainer import Trainer

        store, generation, rank, mesh = self.store, self.generation, self.rank, self.mesh
        assert store is not None and mesh is not None, "configure sets them first"
        timeout_s, world_size = self.spec.collective_timeout_s, mesh.world_size
        self.device = device = pick_device(self.spec.backend)
        join_barrier(
            store,
            generation=generation,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            aborted=self._aborted.is_set,
        )
        self.faults = self._fault_injector(faults, rank)
        self.faults.while_joining(resumes_at)
        group_sockets = GroupSockets(self.spec.backend)
        init_generation(
            store=store,
            generation=generation,
            rank=rank,
            world_size=world_size,
            backend=self.spec.backend,
            timeout_s=timeout_s,
            device=device,
            layout=mesh if self.spec.compile else None,
        )
        self.committer = committer = StepCommitter(
            store,
            generation=generation,
            world_size=world_size,
            timeout_s=timeout_s,
            snapshot_interval=snapshot_interval,
        )
        self.source = make_source(self.spec, self.data)
        if self.spec.compile:
            from workers.compile import load_published_artifacts

            load_published_artifacts(store, mesh)
        trainer = Trainer(
            self.spec,
            mesh,
            rank,
            device=device,
            source=self.source,
            committer=committer,
            peer_waits=self._peer_waits,
            after_compute=self.faults.after_compute,
        )
        self.trainer = trainer
        self._filled = False
        self._group_sockets, self._sockets_before_join = group_sockets.opened(), group_sockets.before
        checkpoints = rank_checkpoints(self.spec, trainer, rank, generation, self.channel, self.faults)
        self.checkpoints = checkpoints
        return trainer, checkpoints

    def _fault_injector(self, faults: tuple[FaultSpec, ...], rank: int) -> FaultInjector:
        """This rank's faults of the generation; a kill first waits for the driver to poll its reports."""
        return FaultInjector(
            faults,
            rank=rank,
            on_fire=lambda f: log.warning("firing injected fault %s", f.describe()),
            before_kill=self._before_kill,
            slowdown=self.faults.slowdown,  # a slowed process stays slow in every generation
        )

    def _before_kill(self) -> None:
        """Just before an injected kill. On the loop thread (``kill@S``), the peer-memory snapshot
        of step S - 1 is let finish first: it is copied while step S's forward and backward run,
        so ``kill@S`` stands for a crash during that compute, after the copy, as a crash at a
        random moment of a step is unless it falls within the copy; a crash within it is
        ``kill@S-1/snapshot`` (one step redone). Then the driver polls the reports."""
        snapshots = self.snapshots
        if snapshots is not None and threading.get_ident() == self._loop_thread:
            snapshots.flush()
        self.channel.wait_delivered(REPORTS_BEFORE_KILL_S)

    def _fill_state(self, start: StartFrom, trainer: Trainer, checkpoints: RankCheckpoints | NoCheckpoints) -> None:
        """Inside ``configure``: fill the new generation's trainer as ``start`` says (the kept
        slices, a fresh initialisation, a peer's step or a checkpoint) and set ``last_step``.
        Collective where the trainer's calls are (a restore reshards)."""
        if start.mode == StartMode.KEPT and self._kept_shards is not None:
            trainer.load_local_shards(self._kept_shards)
        elif start.mode == StartMode.FRESH:
            self._fill_from_source(trainer)
            self.last_step = 0
        elif start.mode in (StartMode.PEER, StartMode.CHECKPOINT) or (
            start.mode == StartMode.MEMORY and start.memory is not None
        ):
            self._fill_step(start, trainer, checkpoints)
        else:
            raise ValueError(f"cannot start from {start!r} on rank {self.rank}")
        self._kept_shards = None
        self._filled = True

    def _fill_step(self, start: StartFrom, trainer: Trainer, checkpoints: RankCheckpoints | NoCheckpoints) -> None:
        """Inside ``_fill_state``: step ``start.step`` from a peer replica (the sync after
        ``configure`` copies it; here the optimizer state is only allocated), a checkpoint or a
        memory snapshot. Those hold what trains: a LoRA run reads its frozen base from its source first."""
        from workers.peer_snapshots import restore_from_memory

        if self.spec.lora is not None:
            self._fill_from_source(trainer)
        if start.mode == StartMode.PEER:
            trainer.ensure_optimizer_state()
        elif start.mode == StartMode.CHECKPOINT:
            checkpoints.restore(start.step)
        else:
            restore_from_memory(trainer, start, self.snapshot_store, self.channel)
        self.last_step = start.step

    def _fill_from_source(self, trainer: Trainer) -> None:
        """Inside ``configure``: the model as a fresh run starts it (released weights or the seed)."""
        from workers.pretrained import fill_from_source

        report = fill_from_source(trainer)
        if report is not None:
            self.channel.send(report)

    def run(self, *, last_step: int) -> RunOutcome:
        """The training loop, from the step after ``self.last_step`` to ``last_step``.

        Unless it finished, the rank leaves the generation on the way out: it keeps its slices
        and frees every process group, which also releases peers still blocked on it.
        """
        from workers.parallelize import forget_old_meshes
        from workers.trainer import StepAborted

        forget_old_meshes()  # this thread's DTensor caches may hold an earlier generation's meshes
        self._loop_thread = threading.get_ident()
        outcome: RunOutcome
        try:
            outcome = self._loop(last_step)
        except StepAborted:
            outcome = RunOutcome(RunStatus.ABORTED, self.last_step)
        except Exception as error:  # noqa: BLE001 - reported to the driver, never swallowed
            outcome = RunOutcome(
                RunStatus.FAILED,
                self.last_step,
                error=describe_error(error),
                error_type=type(error).__name__,
                failure_kind=classify_failure(error, aborted=self._aborted.is_set()),
            )
        # Outside the except block: the exception and its traceback (which pin the blocked
        # collective and its process group) are gone by now.
        self._loop_thread = None
        if outcome.status != RunStatus.FINISHED:
            self._drop_process_groups(keep_shards=outcome.status != RunStatus.FAILED or outcome.caused_by_peer)
        self._set_phase(Phase(outcome.status))
        return outcome

    def _loop(self, last_step: int) -> RunOutcome:
        from workers.evaluation import Evaluator
        from workers.trainer import NO_STATE_COPIES

        trainer = self.trainer
        assert trainer is not None, "run follows a configure"
        evaluator = Evaluator(trainer, batches=self.spec.eval.batches)
        # The boundary this run resumes from (0: before step 1); a pause or a failure there skipped its evaluation.
        self._evaluate_if_due(evaluator, self.last_step)
        while self.last_step < last_step:
            if self._stop.is_set():
                return RunOutcome(RunStatus.STOPPED, self.last_step)
            step = self.last_step + 1
            self._set_phase(Phase.STEP)
            snapshots = self.snapshots
            self.faults.before_step(step)
            result = trainer.train_step(step, copies=snapshots or NO_STATE_COPIES)
            self.last_step = step
            self._set_phase(Phase.CHECKPOINT)
            if snapshots is not None:
                snapshots.after_step(step, due=result.decision.snapshot, step_time_s=result.step_time_s)
            stall = self._live_checkpoints().after_step(
                step, last=step == self.spec.steps, emergency=result.decision.checkpoint_before_pause
            )
            self.channel.step(
                step=step,
                loss=result.loss,
                dp_rank=trainer.dp_rank,
                step_time_s=result.step_time_s,
                lr=result.lr,
                grad_norm=result.grad_norm,
                phases=result.phases,
                checkpoint_stall_s=stall,
                sample_indices=tuple(result.samples) if self.spec.record_samples else None,
                expert_load=result.expert_load,
                trained_tokens=result.trained_tokens,
                compiled=result.compiled,
            )
            if result.compiled and result.compiled.compiled:
                self._publish_compiled()
            if result.decision.pause:
                if snapshots is not None:
                    snapshots.flush()  # the boundary's snapshot is complete before the mesh changes
                # Uploads in flight go on and report while the next mesh configures: the driver
                # commits them with this mesh (a pause loses no rank). An emergency save is
                # already durable (saved synchronously).
                return RunOutcome(RunStatus.PAUSED, self.last_step, state_digest=trainer.state_digest())
            self._evaluate_if_due(evaluator, step)
        self._live_checkpoints().close(wait=True)
        return RunOutcome(RunStatus.FINISHED, self.last_step, state_digest=trainer.state_digest())

    def _publish_compiled(self) -> None:
        """Loop thread, after a step in which this rank compiled graphs: its cache artifacts go on
        the job's store for ranks that join this layout elsewhere (``workers/compile.py``)."""
        from workers.compile import publish_artifacts

        assert self.store is not None and self.mesh is not None, "a configured rank"
        size = publish_artifacts(self.store, self.mesh, self.rank)
        log.info("published %d bytes of compile artifacts for %s", size, self.mesh.describe())

    def _evaluate_if_due(self, evaluator: Evaluator, step: int) -> None:
        """Loop thread, collective: evaluate at the boundary after ``step`` when the job asks for it
        there (every rank decides the same from the step number); rank 0 reports the result.

        An error here ends the run call like an error in a step: the step is applied, so the
        driver recovers the generation at this boundary, and the next run call starts by
        evaluating it (the driver keeps one ``eval`` event per boundary).
        """
        if not self.spec.eval.due(step, last_step=self.spec.steps):
            return
        self._set_phase(Phase.EVAL)
        result = evaluator.evaluate()
        if self.rank == 0:
            self.channel.evaluated(step=step, loss=result.loss, tokens=result.tokens, eval_s=result.eval_s)

    def _live_checkpoints(self) -> RankCheckpoints | NoCheckpoints:
        """Loop thread: the generation's checkpoints, read from the actor at each use rather than
        held, because ``shutdown`` (another thread) may drop them while the loop runs."""
        checkpoints = self.checkpoints
        assert checkpoints is not None, "the rank left its generation while the loop ran"
        return checkpoints

    def shutdown(self) -> None:
        self._drop_process_groups(keep_shards=False)
        self._set_phase(Phase.SHUTDOWN)

    # ------------------------------------------------------------------ helpers
    def abort_collectives(self, generation: int) -> None:
        """Control thread, any time: abort every process group of this rank in ``generation``.

        With gloo, shuts the rank's process-group connections down, so its own blocked
        collective fails at once and so do peers blocked on it, instead of waiting for the
        collective timeout; with NCCL, aborting the communicators releases the kernels queued
        on them. The driver calls it on every survivor when a generation fails: the whole
        generation unblocks in well under a second. A late call (the rank moved on) is ignored;
        one that overtook its generation's configure (still dropping the last groups) ends that
        configure at once. The loop thread syncs and empties the device as it leaves the
        generation (``_drop_process_groups``): this answers on a control thread and returns at
        once. A timer checks a few seconds later that the loop did leave (``group_abort.py``).
        """
        self._aborted_generation = max(self._aborted_generation, generation)
        if generation != self.generation:
            return
        self._aborted.set()
        release_collectives(self._group_sockets, self.spec.backend)
        watch_abort(
            rank=self.rank,
            generation=generation,
            still_in=lambda: self.generation == generation and self._loop_thread is not None,
            sockets=self._group_sockets,
            before_join=self._sockets_before_join,
            backend=self.spec.backend,
        )

    def _drop_process_groups(self, *, keep_shards: bool) -> None:
        """Leave the generation: keep the slices as plain tensors, drop every object holding a
        process group, shut the groups' connections down, then abort and destroy the groups.
        Destroying (or aborting) alone does not close gloo's connections while FSDP2 and
        DeviceMesh internals still hold the backends; without the shutdown, peers blocked on
        this rank would wait for the collective timeout (NCCL's abort needs no shutdown: no
        sockets are noted for it). Last, the device: synced, so that nothing of the aborted
        work still runs, and emptied, so that the next generation's communicators and trainer
        find its memory."""
        import torch.distributed as dist

        if self.checkpoints is not None:
            self.checkpoints.close(wait=False)  # in-flight uploads finish and report on their own
            self.checkpoints = None
        if self.snapshots is not None:
            self.snapshots.close(wait=False)  # a copy in flight finishes (or fails) and reports
            self.snapshots = None
        if self.trainer is not None:
            if keep_shards:
                self._kept_shards = self.trainer.local_shards()
            self.trainer.close()
            if self.spec.compile and self.mesh is not None:
                from workers.compile import forget_compiled_graphs

                forget_compiled_graphs(self.mesh)
        self.trainer = None
        if self.source is not None:
            self.source.close()  # its prefetch thread ends here
            self.source = None
        self.committer = None
        abort_groups(self._group_sockets)
        self._group_sockets = set()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as error:  # noqa: BLE001 - an aborted group may refuse a clean destroy
                log.debug("destroy_process_group after abort: %s", error)
        gc.collect()
        if self.device is not None:
            self.device.settle(f"after leaving generation {self.generation}")

    def _set_phase(self, phase: Phase) -> None:
        self._phase = (phase, time.monotonic())
