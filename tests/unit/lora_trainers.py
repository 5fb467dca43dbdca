"""One-process LoRA trainers on released weights, for the adapter tests (PEFT forward, exports).

trainer = lora_trainer_on(base_dir, LORA)     # world size 1 already joined (gloo)
adapters = give_adapters_values(trainer)      # B starts at zero: every adapter made to matter
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from elastic.spec import MeshSpec
from workers.data import SyntheticSource
from workers.parallelize import local_slice
from workers.pretrained import fill_from_source
from workers.spec import TrainSpec
from workers.spec.families import spec_from_hf_config
from workers.spec.lora import LoraBase, LoraSpec, is_adapter
from workers.spec.train import PretrainedSource
from workers.trainer import Trainer

ONE_RANK = MeshSpec(dp_shard=1, tp=1, pp=1)


def lora_trainer_on(base_dir: Path, lora: LoraSpec, *, lora_base: LoraBase | None = None) -> Trainer:
    """A one-rank Trainer with ``lora``'s adapters beside the Hugging Face model in ``base_dir``,
    filled as a fresh run fills it (the base read from there, the adapters initialised)."""
    model = spec_from_hf_config(json.loads((base_dir / "config.json").read_text()), "config.json")
    spec = TrainSpec(
        model=model,
        steps=1,
        global_batch=2,
        seq_len=16,
        microbatch_size=2,
        init_from=PretrainedSource(str(base_dir)),
        lora=lora,
        lora_base=lora_base,
    )
    source = SyntheticSource(vocab_size=model.vocab_size, seq_len=spec.seq_len, seed=0)
    trainer = Trainer(spec, ONE_RANK, 0, device=torch.device("cpu"), source=source)
    fill_from_source(trainer)
    return trainer


def give_adapters_values(trainer: Trainer, *, seed: int = 5) -> dict[str, torch.nn.Parameter]:
    """Overwrite every adapter with seeded values (B starts at zero, so untrained adapters change
    nothing); returns them by name. One rank: each local slice is the whole tensor."""
    adapters = {name: param for name, param in trainer.modules[0].named_parameters() if is_adapter(name)}
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in adapters.values():
            local_slice(param).copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return adapters
