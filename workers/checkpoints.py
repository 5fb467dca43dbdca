"""When and what a rank saves, and how it restores: the trainer's side of ``checkpointing/``.

Runs on every rank, in the actor's loop thread; one object per generation (the writer knows
the rank and the mesh). ``RankCheckpoints.after_step`` stages this rank's slices at the
configured interval (the only stall) and lets the writer upload in the background;
``restore`` fills a freshly built trainer from any committed step, whatever mesh wrote it.
``NoCheckpoints`` is the null object for jobs without ``checkpoint.uri``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from checkpointing.catalog import load_manifest
from checkpointing.errors import ForeignCheckpointError, StorageUnreachableError
from checkpointing.manifest import LORA, LORA_BASE, Manifest
from checkpointing.reader import restore
from checkpointing.spec import OPTIMIZER_PREFIX
from checkpointing.storage import StorageBackend, open_storage
from checkpointing.writer import CheckpointWriter
from workers.reporting import ReportChannel
from workers.spec import TrainSpec
from workers.spec.train import CheckpointTarget

if TYPE_CHECKING:
    from workers.faults import FaultInjector
    from workers.trainer import Trainer

log = logging.getLogger("meshpilot")


def owns_plain_tensors(trainer: Trainer) -> bool:
    """Whether this rank saves the plain tensors (optimizer step counters): they are the same on
    every rank of a pipeline stage, so one rank per stage writes them."""
    coords = trainer.coords
    return coords.dp_replicate == 0 and coords.dp_shard == 0 and coords.cp == 0 and coords.tp == 0


class NoCheckpoints:
    def after_step(self, step: int, *, last: bool, emergency: bool) -> float | None:
        return None

    def restore(self, step: int) -> dict[str, Any]:
        raise ValueError("checkpoint.uri is not set: there is nothing to restore from")

    def close(self, *, wait: bool) -> None:
        return None


def rank_checkpoints(
    spec: TrainSpec, trainer: Trainer, rank: int, generation: int, channel: ReportChannel, faults: FaultInjector
) -> RankCheckpoints | NoCheckpoints:
    """The generation's checkpoints of this rank: saves and restores with ``checkpoint.uri``, else none."""
    if spec.checkpoint is None:
        return NoCheckpoints()
    return RankCheckpoints(
        spec, trainer, rank=rank, generation=generation, channel=channel, storage_down=faults.storage_down
    )


class RankCheckpoints:
    def __init__(
        self,
        spec: TrainSpec,
        trainer: Trainer,
        *,
        rank: int,
        channel: ReportChannel,
        generation: int = 0,
        storage_down: Callable[[], bool] = lambda: False,
    ) -> None:
        target = spec.checkpoint
        assert target is not None, "built only for a job with checkpoint.uri (else NoCheckpoints)"
        self.spec = spec
        self.target = target
        self.trainer = trainer
        self.storage = _Outage(rank_storage(target), storage_down)
        self.writer = CheckpointWriter(
            self.storage,
            rank=rank,
            # Stamped with this generation: an upload that ends after the next one began is told
            # apart from that one's save of the same step (a redo).
            report=functools.partial(channel.checkpoint_upload, generation=generation),
            pin_memory=trainer.device.type == "cuda",
            max_in_flight=target.max_in_flight,
            mesh=trainer.world_mesh,
        )
        self.owns_plain_tensors = owns_plain_tensors(trainer)

    def after_step(self, step: int, *, last: bool, emergency: bool) -> float | None:
        """Save if this step is due (interval, last step, or an emergency); returns the stall."""
        due = step % self.target.interval_steps == 0 or last
        if not (due or emergency):
            return None
        state = self.trainer.checkpoint_state()
        extra = self._extra(step)
        if emergency or not self.target.async_save:
            return self.writer.save_sync(step, state, extra=extra, owns_plain_tensors=self.owns_plain_tensors)
        return self.writer.save(step, state, extra=extra, owns_plain_tensors=self.owns_plain_tensors)

    def restore(self, step: int) -> dict[str, Any]:
        """Fill the trainer with committed step ``step``, resharded to this mesh; returns its extra.

        A weights-only step (an imported model) fills the parameters only: the optimizer is left
        as built, so it starts fresh as on a first step. A LoRA step fills the adapters and their
        optimizer state, beside a base the trainer already read from its source: the one the
        checkpoint names, or the restore is refused.
        """
        manifest = load_manifest(self.storage, step)
        check_lora_base(manifest, self.spec, uri=self.storage.uri)
        if not manifest.weights_only:
            self.trainer.ensure_optimizer_state()
        state = self.trainer.checkpoint_state()
        if manifest.weights_only:
            state = {fqn: value for fqn, value in state.items() if not fqn.startswith(OPTIMIZER_PREFIX)}
        restore(self.storage, manifest, state, model=self.spec.model.to_dict())
        return manifest.extra

    def close(self, *, wait: bool) -> None:
        self.writer.close(wait=wait)

    def _extra(self, step: int) -> dict[str, Any]:
        """What resuming needs besides tensors: the data cursor is the step (see workers/data.py)."""
        return {
            "step": step,
            "data_cursor": step * self.spec.global_batch,
            "global_batch": self.spec.global_batch,
            "lr": self.spec.lr_at(step),
            "seed": self.spec.seed,
            "mesh": self.trainer.mesh.as_dict(),
            **lora_extra(self.spec),
        }


def lora_extra(spec: TrainSpec) -> dict[str, Any]:
    """A LoRA run's checkpoints name their settings and frozen base (``Manifest.lora``,
    ``Manifest.lora_base``); a full run's add nothing."""
    if spec.lora is None or spec.lora_base is None:
        return {}
    return {LORA: spec.lora.to_dict(), LORA_BASE: spec.lora_base.to_dict()}


def check_lora_base(manifest: Manifest, spec: TrainSpec, *, uri: str) -> None:
    """Refuse a LoRA checkpoint trained beside another base than this job's (its hash differs)."""
    if spec.lora_base is None or manifest.lora_base is None:
        return
    if manifest.lora_base.get("sha256") != spec.lora_base.sha256:
        raise ForeignCheckpointError(
            f"checkpoint step {manifest.step} under {uri} holds LoRA adapters trained on the base "
            f"{manifest.lora_base.get('source')} (sha256 {manifest.lora_base.get('sha256')}), but this job's base "
            f"{spec.lora_base.source} has sha256 {spec.lora_base.sha256}: point model.init_from at the base the "
            "adapters were trained on, or use a fresh checkpoint.uri"
        )


@functools.cache
def rank_storage(target: CheckpointTarget) -> StorageBackend:
    """The rank process's storage client for ``target``, kept across generations.

    Building a client costs 0.07-0.25 s on the configure path of every generation, and a new
    one's first request also pays for connections and the credential chain, which made a
    rank's first upload the slowest. The first call starts warming it on a daemon thread (one
    bucket check); an error there is left for the first save to report.
    """
    storage = open_storage(
        target.uri,
        endpoint_url=target.endpoint_url,
        region=target.region,
        part_size=target.part_size_bytes,
        concurrency=target.upload_concurrency,
    )
    threading.Thread(target=_warm, args=(storage,), name="meshpilot-storage-warm", daemon=True).start()
    return storage


def _warm(storage: StorageBackend) -> None:
    try:
        storage.check_access()
    except Exception as error:  # noqa: BLE001 - the first save retries and reports it
        log.debug("warming %s: %s", storage.uri, error)


class _Outage:
    """The storage backend, failing every request while an injected outage lasts."""

    def __init__(self, inner: StorageBackend, down: Callable[[], bool]) -> None:
        self._inner = inner
        self._down = down
        self.uri = inner.uri

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            if self._down():
                raise StorageUnreachableError(f"{self.uri}: injected storage outage")
            return attribute(*args, **kwargs)

        return call
