"""A LoRA model's forward is PEFT's: the same base weights and adapters give the same logits.

    python -m pytest tests/unit/test_lora_peft.py -q

Single process, world size 1, real gloo. A random Llama-3-style model is saved by
``transformers``; a Trainer with adapters on all seven linear layers of each block loads it as
its base (``model.init_from``) and gets nonzero adapters; ``peft.get_peft_model`` wraps the same
``transformers`` model with the same ``LoraConfig`` and receives the adapters under PEFT's own
names (``set_peft_model_state_dict`` with no missing or unexpected key). Float32 logits within 1e-5.
The adapters' dropout applies in training steps, not in evaluation.
"""

from __future__ import annotations

import peft
import pytest
import torch
import torch.distributed as dist

from elastic.spec import MeshSpec
from tests.hf_models import reference_logits, save_random_model
from tests.unit.lora_trainers import give_adapters_values, lora_trainer_on
from workers.data import SyntheticSource
from workers.models import resolve_family
from workers.parallelize import local_slice
from workers.runtime import init_generation
from workers.spec import PRESETS, TrainSpec
from workers.spec.lora import LORA_TARGETS, LoraSpec, is_adapter
from workers.trainer import Trainer

LORA = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=LORA_TARGETS)


@pytest.fixture
def one_rank_world():
    if dist.is_initialized():
        dist.destroy_process_group()
    init_generation(store=dist.HashStore(), generation=0, rank=0, world_size=1, backend="gloo", timeout_s=30)
    yield
    dist.destroy_process_group()


def test_adapter_forward_equals_peft(one_rank_world, tmp_path):
    reference = save_random_model("llama3", tmp_path)
    trainer = lora_trainer_on(tmp_path, LORA)
    model, spec = trainer.spec.model, trainer.spec
    adapters = {name: param for name, param in trainer.modules[0].named_parameters() if is_adapter(name)}
    assert adapters and all(not local_slice(param).any() for name, param in adapters.items() if ".lora_B." in name)
    for name, param in adapters.items():  # A as PEFT draws it: kaiming_uniform(a=sqrt(5)), within 1/sqrt(in)
        if ".lora_A." in name:
            bound = 1 / param.shape[1] ** 0.5
            assert 0.9 * bound < local_slice(param).abs().max() <= bound
    give_adapters_values(trainer)

    peft_model = peft.get_peft_model(
        reference,
        peft.LoraConfig(
            r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=LORA.dropout, target_modules=list(LORA_TARGETS)
        ),
    )
    family = resolve_family(model.family)
    state = {f"base_model.model.{family.hf_name(name)}": local_slice(param).clone() for name, param in adapters.items()}
    loaded = peft.set_peft_model_state_dict(peft_model, state)
    assert loaded.unexpected_keys == []
    assert [key for key in loaded.missing_keys if "lora_" in key] == []

    tokens = torch.randint(0, model.vocab_size, (2, spec.seq_len), generator=torch.Generator().manual_seed(1))
    ours = trainer.logits(tokens)
    assert ours is not None
    torch.testing.assert_close(ours, reference_logits(peft_model, tokens), rtol=1e-5, atol=1e-5)
    # The adapters matter: without them the logits are the base model's, and differ.
    with peft_model.disable_adapter():
        assert not torch.allclose(ours, reference_logits(peft_model, tokens), rtol=1e-3, atol=1e-3)


def test_adapter_dropout_applies_in_training_steps_only(one_rank_world):
    """With dropout, two forward passes of a step differ; evaluation's (no gradients) do not."""
    spec = TrainSpec(
        model=PRESETS["debug"], steps=1, global_batch=2, seq_len=16, microbatch_size=2, lora=LoraSpec(dropout=0.5)
    )
    source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
    trainer = Trainer(spec, MeshSpec(dp_shard=1, tp=1, pp=1), 0, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    with torch.no_grad():  # B starts at zero: make the adapters count
        for name, param in trainer.modules[0].named_parameters():
            if ".lora_B." in name:
                local_slice(param).fill_(0.1)
    tokens = torch.randint(0, spec.model.vocab_size, (2, spec.seq_len), generator=torch.Generator().manual_seed(1))
    assert torch.equal(trainer.logits(tokens), trainer.logits(tokens))
    module = trainer.modules[0]
    assert not torch.equal(module(tokens).detach(), module(tokens).detach())
