"""Ranks (spawned processes, real gloo, no Ray) that load released weights and compute logits.

For tests/ranks/test_pretrained_load.py: each rank builds the Trainer for its mesh, fills it
from a Hugging Face directory with ``load_pretrained`` (its own slices only), runs the forward
pass on fixed tokens and reports the logits (on the last stage) and the bytes it read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.spec import MeshSpec
from tests.ranks.spawned_ranks import join_gloo
from workers.data import SyntheticSource
from workers.models import family_for_architecture
from workers.pretrained import load_pretrained
from workers.spec import TrainSpec
from workers.spec.train import PretrainedSource
from workers.trainer import Trainer

TOKENS_SHAPE = (2, 32)


def fixed_tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, TOKENS_SHAPE, generator=torch.Generator().manual_seed(3))


def run_rank(rank: int, store_path: str, results, *, model_dir: str, mesh: MeshSpec, ep: int = 1) -> None:
    join_gloo(rank, store_path, mesh)
    results.put((rank, *_load_and_forward(rank, model_dir, mesh, ep)))
    _exit(results)


def run_rank_over_models(rank: int, store_path: str, results, *, model_dirs: list[str], mesh: MeshSpec) -> None:
    """``run_rank`` for several models, one after the other in one job: one spawn and one gloo
    join for them all. Reports ``(rank, [(logits, bytes_read, bytes_total) per model])``."""
    join_gloo(rank, store_path, mesh)
    results.put((rank, [_load_and_forward(rank, model_dir, mesh, 1) for model_dir in model_dirs]))
    _exit(results)


def _load_and_forward(rank: int, model_dir: str, mesh: MeshSpec, ep: int) -> tuple:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    family = family_for_architecture(config["architectures"][0])
    assert family is not None, config["architectures"]
    model = family.spec_from_hf_config(config, "config.json")
    spec = TrainSpec(model=model, steps=1, global_batch=4, seq_len=32, microbatch_size=1, microbatches=2, ep=ep)
    source = SyntheticSource(vocab_size=model.vocab_size, seq_len=spec.seq_len, seed=0)
    trainer = Trainer(spec, mesh, rank, device=torch.device("cpu"), source=source)
    report = load_pretrained(trainer, PretrainedSource(model_dir))
    logits = trainer.logits(fixed_tokens(model.vocab_size))
    return None if logits is None else logits.numpy().copy(), report.bytes_read, report.bytes_total


def _exit(results) -> None:
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)
