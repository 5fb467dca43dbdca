"""The rank actor: one Ray actor per rank, holding that rank's process, state and loop.

Runs on the worker side; the driver imports this module only for the class handle, so the
heavy imports (torch, torch.distributed) happen inside the methods, in the actor's process.

The actor is threaded (``max_concurrency`` > 1): ``run`` occupies one thread with the training
loop while ``poll`` (reports + heartbeat), ``request_stop`` and friends are answered on others,
even when the loop is blocked inside a collective. Call sequence, driver side:

    1. all ranks: ``configure(generation, rank, mesh, store address, start)`` — collective:
       joins the generation's process group, builds the Trainer, then initialises, restores
       or rebinds the state;
    2. all ranks: ``run(first_step, last_step)`` — the loop; returns when done, paused,
       aborted or failed (never raises: errors come back as an outcome, so no exception
       object keeps a dead process group alive);
    3. ``release()`` between generations; ``shutdown()`` at the end.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

from elastic.spec import MeshSpec
from workers.reporting import RankLogHandler, ReportChannel
from workers.spec import TrainSpec

log = logging.getLogger("meshpilot.rank")


@dataclass(frozen=True)
class StartFrom:
    """How ``configure`` fills the new trainer's state."""

    # "fresh": seeded init; "kept": rebind the slices this process already holds.
    mode: str = "fresh"
    step: int = 0


@dataclass
class RunOutcome:
    status: str  # finished | paused | aborted | failed | stopped
    last_step: int  # the last step whose optimizer update this rank applied
    error: str | None = None
    error_kind: str | None = None


@dataclass
class Heartbeat:
    rank: int
    phase: str
    step: int
    phase_age_s: float
    reports: list[dict[str, Any]] = field(default_factory=list)


class RankActor:
    """One rank. Construct with ``ray.remote(RankActor).options(max_concurrency=4, ...)``."""

    def __init__(self, *, spec: TrainSpec, data: bytes | None) -> None:
        import torch

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
        self.store = None
        self.committer = None
        self.last_step = 0
        self._kept_shards: dict | None = None
        self._stop = threading.Event()
        self._phase = ("starting", time.monotonic())

    # ------------------------------------------------------------------ control
    def info(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def poll(self) -> Heartbeat:
        phase, since = self._phase
        return Heartbeat(rank=self.rank, phase=phase, step=self.last_step,
                         phase_age_s=time.monotonic() - since, reports=self.channel.drain())

    def request_stop(self) -> None:
        """Stop after the step in flight (Ctrl-C, end of job)."""
        self._stop.set()

    def configure(self, *, generation: int, rank: int, mesh: MeshSpec, store_address: tuple[str, int],
                  start: StartFrom) -> int:
        """Collective over the new world. Returns the last applied step of the state it holds."""
        import torch.distributed as dist

        from workers.rendezvous import StepCommitter, connect_store
        from workers.runtime import init_generation, make_source, pick_device
        from workers.trainer import Trainer

        self._set_phase("configuring")
        self.rank, self.generation, self.mesh = rank, generation, mesh
        self.channel.rank = rank
        self._stop.clear()
        if self.store is None:
            self.store = connect_store(*store_address)
        init_generation(store=self.store, generation=generation, rank=rank, world_size=mesh.world_size,
                        backend=self.spec.backend, timeout_s=self.spec.collective_timeout_s)
        self.committer = StepCommitter(dist.PrefixStore("", self.store), generation=generation,
                                       world_size=mesh.world_size, timeout_s=self.spec.collective_timeout_s)
        self.trainer = Trainer(self.spec, mesh, rank, device=pick_device(self.spec.backend),
                               source=make_source(self.spec, self.data), committer=self.committer)
        if start.mode == "kept" and self._kept_shards is not None:
            self.trainer.load_local_shards(self._kept_shards)
        elif start.mode == "fresh":
            self.trainer.init_weights()
            self.last_step = 0
        else:
            raise ValueError(f"cannot start from {start!r} on rank {rank}")
        self._kept_shards = None
        self._set_phase("ready")
        return self.last_step

    def run(self, *, last_step: int) -> RunOutcome:
        """The training loop, from the step after ``self.last_step`` to ``last_step``."""
        from workers.trainer import StepAborted

        outcome: RunOutcome
        try:
            outcome = self._loop(last_step)
        except StepAborted:
            outcome = RunOutcome("aborted", self.last_step)
        except Exception as error:  # noqa: BLE001 - reported to the driver, never swallowed
            outcome = RunOutcome("failed", self.last_step, error=_describe(error), error_kind=type(error).__name__)
            del error  # a live traceback keeps the blocked collective's process group alive
            self._drop_process_groups(keep_shards=True)
        self._set_phase(outcome.status)
        return outcome

    def _loop(self, last_step: int) -> RunOutcome:
        trainer = self.trainer
        while self.last_step < last_step:
            if self._stop.is_set():
                return RunOutcome("stopped", self.last_step)
            step = self.last_step + 1
            self._set_phase("step")
            result = trainer.train_step(step)
            self.last_step = step
            self.channel.report("step", step=step, loss=result.loss, dp_rank=trainer.dp_rank,
                                step_time_s=result.step_time_s, lr=result.lr, grad_norm=result.grad_norm,
                                phases=result.phases)
            if result.pause:
                return RunOutcome("paused", self.last_step)
        return RunOutcome("finished", self.last_step)

    def release(self, keep_shards: bool = True) -> None:
        """Leave the current generation: keep this rank's slices, drop every process group."""
        self._drop_process_groups(keep_shards=keep_shards)
        self._set_phase("released")

    def shutdown(self) -> None:
        self._drop_process_groups(keep_shards=False)
        self._set_phase("shutdown")

    # ------------------------------------------------------------------ helpers
    def _drop_process_groups(self, *, keep_shards: bool) -> None:
        """Free every socket of every process group this rank is in (FACTS.md: the only way,
        with gloo, to release peers blocked on us): keep the slices as plain tensors, drop
        every object holding a group, destroy the groups, collect."""
        import torch.distributed as dist

        if self.trainer is not None:
            if keep_shards:
                self._kept_shards = self.trainer.local_shards()
            self.trainer.close()
        self.trainer = None
        self.committer = None
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()

    def _set_phase(self, phase: str) -> None:
        self._phase = (phase, time.monotonic())


def _describe(error: BaseException) -> str:
    frames = traceback.format_exception(type(error), error, error.__traceback__, limit=-6)
    return "".join(frames).strip()
