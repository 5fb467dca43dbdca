"""Which checkpoints a LoRA job resumes from: its own adapters on the same base, nothing else.

    python -m pytest tests/unit/test_lora_checkpoints.py -q

The driver's choice (``choose_restore``, as ``DriverCheckpoints.choose_resume`` calls it) over a
directory holding one committed manifest; the ranks check the same again as they restore
(tests/ranks/test_lora_training.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from checkpointing.catalog import choose_restore
from checkpointing.errors import ForeignCheckpointError
from checkpointing.manifest import LORA, LORA_BASE, build_manifest
from checkpointing.spec import manifest_key
from checkpointing.storage import open_storage
from workers.spec.lora import LoraBase, LoraSpec

BASE = LoraBase(source="s3://models/llama-3.2-1b", sha256="a" * 64)


def _commit(directory, extra: dict) -> None:
    manifest = build_manifest([], step=7, world_size=1, mesh={}, model={}, config_hash=None)
    manifest = dataclasses.replace(manifest, extra=extra)
    assert open_storage(str(directory)).put_if_absent(manifest_key(7), manifest.to_json())


def test_a_lora_checkpoint_on_the_same_base_is_chosen(tmp_path):
    _commit(tmp_path, {LORA: LoraSpec().to_dict(), LORA_BASE: BASE.to_dict()})
    chosen = choose_restore(open_storage(str(tmp_path)), lora_base=BASE.to_dict())
    assert chosen is not None and chosen.lora_base == BASE.to_dict() and chosen.lora == LoraSpec().to_dict()


def test_a_lora_checkpoint_on_another_base_is_refused_naming_both(tmp_path):
    _commit(tmp_path, {LORA: LoraSpec().to_dict(), LORA_BASE: BASE.to_dict()})
    other = LoraBase(source="s3://models/llama-3.2-1b-instruct", sha256="b" * 64)
    with pytest.raises(ForeignCheckpointError) as refused:
        choose_restore(open_storage(str(tmp_path)), lora_base=other.to_dict())
    assert str(refused.value) == (
        f"checkpoint {tmp_path} step 7 holds LoRA adapters trained on the base s3://models/llama-3.2-1b (sha256 "
        f"{'a' * 64}), but this job's base s3://models/llama-3.2-1b-instruct has sha256 {'b' * 64}: point "
        "model.init_from at the base the adapters were trained on, or use a fresh checkpoint.uri"
    )


def test_a_checkpoint_of_every_weight_is_refused_by_a_lora_job(tmp_path):
    _commit(tmp_path, {})
    with pytest.raises(ForeignCheckpointError, match="holds every weight, not LoRA adapters"):
        choose_restore(open_storage(str(tmp_path)), lora_base=BASE.to_dict())
    assert choose_restore(open_storage(str(tmp_path))) is not None  # a full job takes it


class _RecordingTrainer:
    """What ``configure`` asks of the trainer as it fills it: the calls, in order."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.calls: list[str] = []

    def init_weights(self, *, adapters_only: bool = False) -> None:
        self.calls.append("adapters" if adapters_only else "seeded model")

    def ensure_optimizer_state(self) -> None:
        self.calls.append("optimizer state")


class _RecordingCheckpoints:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def restore(self, step: int) -> dict:
        self.calls.append(f"checkpoint {step}")
        return {}


@pytest.mark.parametrize("lora", [None, LoraSpec()], ids=["full", "lora"])
@pytest.mark.parametrize("mode", ["peer", "checkpoint"])
def test_a_rank_filled_from_a_peer_or_a_checkpoint_draws_a_lora_base_first(lora, mode, monkeypatch):
    """Peers and checkpoints hold what trains: a LoRA rank's base comes from its source first (here
    the seed), then the adapters; a full run's rank takes everything from them."""
    import logging
    import signal

    import torch

    from orchestrator.config import load_config
    from orchestrator.driver.train_spec import train_spec
    from tests.jobs import DEMO_CONFIG
    from workers.actor import RankActor
    from workers.reporting import RankLogHandler
    from workers.spec.messages import StartFrom, StartMode

    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the actor's SIGTERM watch is its process's
    spec = dataclasses.replace(train_spec(load_config(DEMO_CONFIG, [])), lora=lora)
    threads = torch.get_num_threads()  # a rank actor takes one; the tests after this one keep theirs
    try:
        actor = RankActor(spec=spec, data=None)
    finally:
        torch.set_num_threads(threads)
        logger = logging.getLogger("meshpilot")
        for handler in [h for h in logger.handlers if isinstance(h, RankLogHandler)]:
            logger.removeHandler(handler)
    trainer = _RecordingTrainer(spec)
    start = StartFrom(StartMode.PEER if mode == "peer" else StartMode.CHECKPOINT, step=6)
    actor._fill_state(start, trainer, _RecordingCheckpoints(trainer.calls))
    restored = "optimizer state" if mode == "peer" else "checkpoint 6"
    assert trainer.calls == (["seeded model", restored] if lora else [restored])
    assert actor.last_step == 6
