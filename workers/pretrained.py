"""Fill a fresh trainer from released Hugging Face weights (``model.init_from``), or a LoRA
run's frozen base from its source whenever a rank needs it.

Runs on every rank, inside ``configure`` of a fresh start, with no collective: each rank
reads only the byte ranges of the slices it owns in the current mesh (ranged GETs on S3, plain
reads on disk), through the same reader as a checkpoint restore, converting dtype on the way.
The full model is never held by one process. The family says which Hugging Face tensor feeds
each parameter.
"""

from __future__ import annotations

import time

import torch

from checkpointing.hf_format import load_hf_tensors, open_hf_checkpoint
from checkpointing.storage import open_storage
from workers.spec import PretrainedLoadReport
from workers.spec.lora import is_adapter
from workers.spec.train import PretrainedSource
from workers.trainer import Trainer


def fill_from_source(trainer: Trainer) -> PretrainedLoadReport | None:
    """The model as a fresh run starts it: the released weights of ``model.init_from`` (then, with
    LoRA, adapters initialised beside them), else every parameter drawn from the run's seed.

    Runs on every rank inside ``configure``, no collective: at a fresh start, and in a LoRA run
    also before a restore, a peer's copy or a memory snapshot fills the adapters (those hold no
    base). Returns the load's report, or None when nothing was read.
    """
    if trainer.spec.init_from is None:
        trainer.init_weights()
        return None
    report = load_pretrained(trainer, trainer.spec.init_from)
    trainer.init_weights(adapters_only=True)
    return report


def load_pretrained(trainer: Trainer, source: PretrainedSource) -> PretrainedLoadReport:
    """Overwrite every parameter of ``trainer`` but the LoRA adapters with its slice of the released weights."""
    started = time.monotonic()
    storage = open_storage(source.uri, endpoint_url=source.endpoint_url, region=source.region)
    try:
        checkpoint = open_hf_checkpoint(storage)
        params: dict[str, torch.Tensor] = {
            fqn: param for module in trainer.modules for fqn, param in module.named_parameters() if not is_adapter(fqn)
        }
        names = trainer.family.hf_source_names(trainer.spec.model, sorted(params), set(checkpoint.tensors))
        bytes_read = load_hf_tensors(storage, checkpoint, params, names)
    finally:
        storage.close()
    # Every tensor of the released model, this rank's pipeline stage or not: the whole download.
    total = sum(tensor.end - tensor.start for tensor in checkpoint.tensors.values())
    return PretrainedLoadReport(
        rank=trainer.rank,
        time=time.time(),
        uri=source.uri,
        bytes_read=bytes_read,
        bytes_total=total,
        seconds=time.monotonic() - started,
    )
