"""``meshpilot plan`` and the cost model price LoRA: a frozen base keeps only its fp32 shard, the
adapters carry gradients and Adam's moments, the backward skips the base's weight gradients, and
FSDP reduces only the adapters' gradients."""

from __future__ import annotations

import json

import pytest

from elastic.cost_model import Assumptions, Cluster, Layout, Workload, estimate
from elastic.hardware import gpu_spec
from elastic.spec import MeshSpec
from orchestrator.cli import main
from workers.spec import model_spec
from workers.spec.lora import LoraSpec

MODEL = model_spec("llama3-1b")
CLUSTER = Cluster(gpus=8, gpus_per_node=8, gpu=gpu_spec("h100-80g"))
LAYOUT = Layout(MeshSpec(dp_replicate=1, dp_shard=8, tp=1, pp=1), microbatches=8)


def _estimate(lora: LoraSpec | None):
    return estimate(Workload(MODEL, 2048, 64, lora=lora), CLUSTER, LAYOUT, Assumptions())


def test_adapter_count_is_rank_times_in_plus_out_per_target():
    lora = LoraSpec(rank=16, target_modules=("q_proj", "down_proj"))
    queries = MODEL.n_heads * MODEL.head_dim
    expected = 16 * (MODEL.dim + queries) + 16 * (MODEL.ffn_dim + MODEL.dim)
    assert Workload(MODEL, 2048, 64, lora=lora).adapter_params_per_layer == expected


def test_lora_state_is_the_frozen_shard_plus_the_adapters_full_state():
    full, lora = _estimate(None), _estimate(LoraSpec(rank=16))
    # Full training: 16 bytes a parameter (bf16 param + grad + fp32 master + moments), sharded 8 ways.
    full_state = full.memory.params + full.memory.grads + full.memory.optimizer
    assert full_state == pytest.approx(16 * MODEL.num_params / 8, rel=1e-6)
    adapters = MODEL.n_layers * Workload(MODEL, 2048, 64, lora=LoraSpec(rank=16)).adapter_params_per_layer
    assert lora.memory.grads == pytest.approx(2 * adapters / 8, rel=1e-6)
    assert lora.memory.optimizer == pytest.approx(12 * adapters / 8, rel=1e-6)
    lora_state = lora.memory.params + lora.memory.grads + lora.memory.optimizer
    assert lora_state < 0.3 * full_state  # 4 of 16 bytes for the base, plus a small adapter share


def test_lora_step_is_cheaper_and_reduces_only_adapter_gradients():
    full, lora = _estimate(None), _estimate(LoraSpec(rank=16))
    assert lora.compute_s < 0.75 * full.compute_s  # no weight gradients: about 4N of 6N
    # The gathers stay, the reduce-scatters shrink to the adapters' gradients.
    assert lora.comm["dp_shard"].bytes_per_step < 0.6 * full.comm["dp_shard"].bytes_per_step


def test_plan_cli_prices_lora_and_names_a_bad_target(capsys):
    assert main(["plan", "--model", "llama3-1b", "--gpus", "8", "--lora-rank", "16", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["lora"]["rank"] == 16 and document["lora"]["target_modules"] == list(LoraSpec().target_modules)
    assert 0 < document["lora"]["trainable_share"] < 0.01
    assert main(["plan", "--model", "llama3-1b", "--gpus", "8", "--lora-targets", "q_proj,w1"]) == 2
    assert (
        "--lora-targets='q_proj,w1': w1 is not a layer of this model that takes an adapter" in capsys.readouterr().err
    )
