"""A family from outside meshpilot (tests/families/gpt2.py): its model on one process, and its
shape checks as the config reports them.

    python -m pytest tests/unit/test_user_family.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from tests.families.gpt2 import Gpt2Family
from tests.jobs import DEMO_CONFIG
from workers.initial_values import init_weights

FAMILY = "model.family=tests.families.gpt2:Gpt2Family"


def test_a_logit_depends_only_on_its_token_and_earlier_ones():
    family = Gpt2Family()
    spec = dataclasses.replace(family.preset("debug"), max_seq_len=32)
    model = family.build(spec)
    init_weights(model, family, spec, seed=0)
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % spec.vocab_size
    with torch.no_grad():
        logits, changed_logits = model(tokens), model(changed)
    assert logits.shape == (2, 16, spec.vocab_size)
    torch.testing.assert_close(changed_logits[:, :10], logits[:, :10], rtol=0, atol=1e-6)
    for position in range(10, 16):
        assert (changed_logits[:, position] - logits[:, position]).abs().max() > 1e-4, position


def test_its_args_count_the_parameters_it_builds():
    """The planner counts this family's own block: position embedding, biases, two-matrix MLP."""
    family = Gpt2Family()
    spec = family.preset("debug")
    with torch.device("meta"):
        model = family.build(spec)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert spec.embedding_params == sum(p.numel() for name in ("wte", "wpe") for p in getattr(model, name).parameters())


def test_a_shape_key_of_another_family_is_refused_by_name():
    with pytest.raises(ConfigError) as raised:
        load_config(DEMO_CONFIG, [FAMILY, "model.rope_theta=10000"])
    assert "model.rope_theta is not a shape key of model family tests.families.gpt2:Gpt2Family" in str(raised.value)


def test_the_family_names_a_shape_key_it_cannot_build():
    with pytest.raises(ConfigError) as raised:
        load_config(DEMO_CONFIG, [FAMILY, "model.n_kv_heads=2"])
    assert (
        "model.n_kv_heads=2 must equal model.n_heads=4: gpt2-test has no grouped-query attention "
        "(leave model.n_kv_heads unset)"
    ) in str(raised.value)
