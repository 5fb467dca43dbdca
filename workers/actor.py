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
       ``shutdown()`` at the end.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import sys
import threading
import time
import traceback
import warnings
from typing import Any

from elastic.spec import MeshSpec
from workers.faults import FaultInjector, FaultSpec
from workers.notices import InstanceActionWatcher, watch_sigterm
from workers.reporting import RankLogHandler, ReportChannel
from workers.sockets import shutdown_sockets, socket_inodes
from workers.spec import TrainSpec
from workers.spec.messages import FailureKind, Heartbeat, RunOutcome, StartFrom, failure_kind_of

log = logging.getLogger("meshpilot.rank")


# Messages of errors that a rank sees because *another* rank failed (a closed socket, a
# vetoed vote that timed out): such a rank is a survivor, not a cause.
PEER_FAILURE_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/transport",
    "Socket Timeout", "timed out", "Timeout", "NCCL communicator was aborted", "ProcessGroupNCCL",
)


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
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        import torch._dynamo  # noqa: F401  -- imported lazily by the first FSDP step otherwise (~1 s)

        self.spec = spec
        self.data = data
        self.channel = ReportChannel()
        logging.getLogger("meshpilot").addHandler(RankLogHandler(self.channel))
        logging.getLogger("meshpilot").setLevel(logging.INFO)
        self.rank = -1
        self.generation = -1
        self.mesh: MeshSpec | None = None
        self.trainer = None
        self.checkpoints = None
        self.store = None
        self.committer = None
        self.last_step = 0
        self._kept_shards: dict | None = None
        self._stop = threading.Event()
        # Set when the driver aborted this generation's groups: any error the loop sees after
        # that is a consequence of another rank's failure, whatever torch's message says.
        self._aborted = threading.Event()
        self._phase = ("starting", time.monotonic())
        self._loop_thread: int | None = None
        self._drain_reported = False
        watch_sigterm(self._drain_notice)
        self._instance_watcher = None
        if spec.instance_action_url:
            import ray

            url = spec.instance_action_url.replace("{node_id}", ray.get_runtime_context().get_node_id())
            self._instance_watcher = InstanceActionWatcher(url, interval_s=spec.instance_action_poll_s,
                                                           on_notice=self._drain_notice).start()
        # Sockets opened by this generation's process groups (see workers/sockets.py).
        self._group_sockets: set[str] = set()
        self.faults = FaultInjector((), rank=-1)

    # ------------------------------------------------------------------ control
    def info(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def poll(self) -> Heartbeat:
        phase, since = self._phase
        waiting, where = self._loop_position() if phase == "step" else (None, None)
        return Heartbeat(rank=self.rank, phase=phase, step=self.last_step, phase_age_s=time.monotonic() - since,
                         reports=tuple(self.channel.drain()), waiting=waiting, where=where)

    def _drain_notice(self, reason: str) -> None:
        if not self._drain_reported:
            self._drain_reported = True
            self.channel.report("drain_notice", reason=reason)

    def request_stop(self) -> None:
        """Stop after the step in flight (Ctrl-C, end of job)."""
        self._stop.set()

    def configure(self, *, generation: int, rank: int, mesh: MeshSpec, store_address: tuple[str, int],
                  start: StartFrom, sync_replicas: bool = False, faults: tuple[FaultSpec, ...] = ()) -> int:
        """Collective over the new world. Returns the last applied step of the state it holds."""
        from workers.checkpoints import NoCheckpoints, RankCheckpoints
        from workers.parallelize import forget_old_meshes
        from workers.rendezvous import StepCommitter, connect_store
        from workers.runtime import init_generation, make_source, pick_device
        from workers.trainer import Trainer

        self._set_phase("configuring")
        if self.trainer is not None:  # still in an earlier generation (a retried configure)
            self._drop_process_groups(keep_shards=start.mode == "kept")
        self.rank, self.generation, self.mesh = rank, generation, mesh
        self.channel.rank = rank
        self._stop.clear()
        self._aborted.clear()
        forget_old_meshes()
        if self.store is None:
            self.store = connect_store(*store_address)
        sockets_before = socket_inodes()
        init_generation(store=self.store, generation=generation, rank=rank, world_size=mesh.world_size,
                        backend=self.spec.backend, timeout_s=self.spec.collective_timeout_s)
        self.committer = StepCommitter(self.store, generation=generation,
                                       world_size=mesh.world_size, timeout_s=self.spec.collective_timeout_s)
        self.trainer = Trainer(self.spec, mesh, rank, device=pick_device(self.spec.backend),
                               source=make_source(self.spec, self.data), committer=self.committer)
        self._group_sockets = socket_inodes() - sockets_before
        self.faults = FaultInjector(faults, rank=rank,
                                    on_fire=lambda f: log.warning("firing injected fault %s", f.describe()))
        self.checkpoints = (RankCheckpoints(self.spec, self.trainer, rank=rank, channel=self.channel,
                                            storage_down=self.faults.storage_down)
                            if self.spec.checkpoint else NoCheckpoints())
        if start.mode == "kept" and self._kept_shards is not None:
            self.trainer.load_local_shards(self._kept_shards)
        elif start.mode == "fresh":
            self.trainer.init_weights()
            self.last_step = 0
        elif start.mode == "peer":
            self.trainer.ensure_optimizer_state()
            self.last_step = start.step
        elif start.mode == "checkpoint":
            self.checkpoints.restore(start.step)
            self.last_step = start.step
        else:
            raise ValueError(f"cannot start from {start!r} on rank {rank}")
        self._kept_shards = None
        if sync_replicas:
            self.trainer.sync_from_first_replica()
        self._set_phase("ready")
        return self.last_step

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
            outcome = RunOutcome("aborted", self.last_step)
        except Exception as error:  # noqa: BLE001 - reported to the driver, never swallowed
            peer = self._aborted.is_set() or _caused_by_peer(error)
            outcome = RunOutcome("failed", self.last_step, error=_describe(error), error_type=type(error).__name__,
                                 failure_kind=FailureKind.PEER_FAILURE if peer else failure_kind_of(error))
        # Outside the except block: the exception and its traceback (which pin the blocked
        # collective and its process group) are gone by now.
        self._loop_thread = None
        if outcome.status != "finished":
            self._drop_process_groups(keep_shards=outcome.status != "failed" or outcome.caused_by_peer)
        self._set_phase(outcome.status)
        return outcome

    def _loop(self, last_step: int) -> RunOutcome:
        trainer = self.trainer
        while self.last_step < last_step:
            if self._stop.is_set():
                return RunOutcome("stopped", self.last_step)
            step = self.last_step + 1
            self._set_phase("step")
            self.faults.before_step(step)
            result = trainer.train_step(step)
            self.last_step = step
            self._set_phase("checkpoint")
            stall = self.checkpoints.after_step(step, last=step == self.spec.steps,
                                                emergency=result.checkpoint_before_pause)
            self.channel.report("step", step=step, loss=result.loss, dp_rank=trainer.dp_rank,
                                step_time_s=result.step_time_s, lr=result.lr, grad_norm=result.grad_norm,
                                phases=result.phases, checkpoint_stall_s=stall)
            if result.pause:
                self.checkpoints.close(wait=True)  # uploads of this generation are reported before it ends
                return RunOutcome("paused", self.last_step, state_digest=trainer.state_digest())
        self.checkpoints.close(wait=True)
        return RunOutcome("finished", self.last_step, state_digest=trainer.state_digest())

    def shutdown(self) -> None:
        self._drop_process_groups(keep_shards=False)
        self._set_phase("shutdown")

    # ------------------------------------------------------------------ helpers
    def abort_collectives(self, generation: int) -> None:
        """Control thread, any time: abort every process group of this rank in ``generation``.

        Shuts the rank's process-group connections down, so its own blocked collective fails
        at once and so do peers blocked on it, instead of waiting for the collective timeout.
        The driver calls it on every survivor when a generation fails: the whole generation
        unblocks in well under a second. A call that arrives late, once the rank has moved on
        to a later generation, is ignored.
        """
        if generation != self.generation:
            return
        self._aborted.set()
        shutdown_sockets(self._group_sockets)
        _abort_all_groups()

    def _drop_process_groups(self, *, keep_shards: bool) -> None:
        """Leave the generation: keep the slices as plain tensors, drop every object holding a
        process group, shut the groups' connections down, then abort and destroy the groups.
        Destroying (or aborting) alone does not close gloo's connections while FSDP2 and
        DeviceMesh internals still hold the backends; without the shutdown, peers blocked on
        this rank would wait for the collective timeout."""
        import torch.distributed as dist

        if self.checkpoints is not None:
            self.checkpoints.close(wait=False)  # in-flight uploads finish and report on their own
            self.checkpoints = None
        if self.trainer is not None:
            if keep_shards:
                self._kept_shards = self.trainer.local_shards()
            self.trainer.close()
        self.trainer = None
        self.committer = None
        shutdown_sockets(self._group_sockets)
        self._group_sockets = set()
        _abort_all_groups()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as error:  # noqa: BLE001 - an aborted group may refuse a clean destroy
                log.debug("destroy_process_group after abort: %s", error)
        gc.collect()

    def _set_phase(self, phase: str) -> None:
        self._phase = (phase, time.monotonic())

    def _loop_position(self) -> tuple[bool | None, str | None]:
        """Where the loop thread is now: (waiting on peers?, innermost frame as file:line)."""
        frame = sys._current_frames().get(self._loop_thread) if self._loop_thread else None
        if frame is None:
            return None, None
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        path = frame.f_code.co_filename.replace(os.sep, "/")
        waiting = "torch/distributed/" in path or path.endswith("workers/rendezvous.py")
        return waiting, where


def _abort_all_groups() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as error:  # noqa: BLE001 - already aborted, or a backend without abort
            log.debug("abort of process groups: %s", error)


def _caused_by_peer(error: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(error, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    text = str(error)
    return any(marker in text for marker in PEER_FAILURE_MARKERS)


def _describe(error: BaseException) -> str:
    frames = traceback.format_exception(type(error), error, error.__traceback__, limit=-6)
    return "".join(frames).strip()
