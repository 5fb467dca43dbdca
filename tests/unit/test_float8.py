"""training.float8: refused where it cannot run (one line, no traceback); on the ranks, torchao's
float8 layers leave every name, shape and dtype a checkpoint holds as it was, with the output head
and a router in high precision. The trainer test runs on the CPU with torchao's emulated casts
(float8 values, float32 matmuls) past the device check: the GPU's code path, without a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torchao.float8
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from elastic.spec import MeshSpec
from orchestrator.cli import main
from orchestrator.driver.detector import group_errors
from tests.jobs import DEMO_CONFIG, REPO
from workers import float8
from workers import parallelize as par
from workers.data import SyntheticSource
from workers.models import resolve_family
from workers.runtime import init_generation
from workers.spec import PRESETS, TrainSpec
from workers.trainer import Trainer

NEEDS = "training.float8 needs a CUDA GPU of compute capability 8.9 or higher (Ada, Hopper or newer)"


def test_float8_on_cpu_ranks_is_one_line_naming_the_device_and_the_fix(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    # The demo job has tp=2 too, which float8 does not take: on the CPU only the CPU is said.
    code = main(["train", str(DEMO_CONFIG), "--set", "training.float8=true"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    [line] = err.strip().splitlines()
    assert "this job's ranks run on the CPU (runtime.gpus_per_rank=0, gloo): set training.float8=false" in line


@pytest.mark.parametrize("capability", [(8, 0), (8, 6)], ids=["A100", "A10"])
def test_a_rank_refuses_a_gpu_below_compute_capability_8_9_in_one_line(capability, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(float8.Float8Unavailable) as refused:
        float8.apply_float8(nn.Linear(16, 16), enabled=True, device=torch.device("cuda", 0))
    message = str(refused.value)
    assert message == (
        f"{NEEDS}; this rank's NVIDIA A100-SXM4-80GB has {capability[0]}.{capability[1]}: "
        "set training.float8=false, or run on such GPUs"
    )
    # What the driver's failed configuration says: every rank's identical refusal once.
    reason = group_errors({rank: f"Float8Unavailable: {message}" for rank in range(8)})
    assert reason == f"[Rank 0, 1, 2, 3, 4, 5, 6, 7]: Float8Unavailable: {message}"


def test_a_rank_on_hopper_passes_unless_torchao_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert float8.float8_problem(torch.device("cuda", 0)) is None
    monkeypatch.setattr(float8, "find_spec", lambda name: None)
    assert "pip install 'meshpilot[float8]' on every node" in str(float8.float8_problem(torch.device("cuda", 0)))
    assert (
        float8.float8_problem(torch.device("cpu")) == f"{NEEDS}; this rank runs on the CPU: set training.float8=false"
    )


@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
def test_float8_layers_keep_every_name_shape_and_dtype_and_the_head_and_router_stay(preset, monkeypatch):
    monkeypatch.setattr(float8, "float8_problem", lambda device: None)
    model = PRESETS[preset]
    [plan] = par.stage_plans(model, pp=1, pp_rank=0, stages_per_rank=1)
    stage = par.build_stage_module(resolve_family(model.family), model, plan)
    before = {name: (param.shape, param.dtype) for name, param in stage.named_parameters()}
    float8.apply_float8(stage, enabled=True, device=torch.device("cpu"))
    assert {name: (param.shape, param.dtype) for name, param in stage.named_parameters()} == before
    converted = {name for name, module in stage.named_modules() if isinstance(module, Float8Linear)}
    assert {"layers.0.self_attn.q_proj", "layers.3.self_attn.o_proj"} <= converted
    assert "lm_head" not in converted and isinstance(stage.lm_head, nn.Linear)
    if preset == "debug-moe":
        assert not {"layers.0.mlp.gate", "layers.0.mlp.shared_expert_gate"} & converted  # router; 64 x 1
        assert "layers.0.mlp.shared_expert.up_proj" in converted
    else:
        assert "layers.0.mlp.down_proj" in converted


SPEC = TrainSpec(model=PRESETS["debug"], steps=2, global_batch=2, seq_len=16, microbatch_size=1, microbatches=2)


@pytest.fixture
def world():
    init_generation(store=dist.HashStore(), generation=0, rank=0, world_size=1, backend="gloo", timeout_s=30)
    yield
    dist.destroy_process_group()


def trainer(*, float8_on: bool) -> Trainer:
    spec = dataclasses.replace(SPEC, float8=float8_on)
    source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
    built = Trainer(spec, MeshSpec(), 0, device=torch.device("cpu"), source=source)
    built.init_weights()
    return built


def test_a_float8_run_trains_and_its_state_resumes_without_float8_and_back(world, monkeypatch):
    monkeypatch.setattr(float8, "float8_problem", lambda device: None)
    precomputed: list[nn.Module] = []
    precompute = torchao.float8.precompute_float8_dynamic_scale_for_fsdp
    monkeypatch.setattr(
        torchao.float8, "precompute_float8_dynamic_scale_for_fsdp", lambda m: precomputed.append(m) or precompute(m)
    )
    in_float8, plain = trainer(float8_on=True), trainer(float8_on=False)
    float8_losses = [in_float8.train_step(step).loss for step in (1, 2)]
    plain_losses = [plain.train_step(step).loss for step in (1, 2)]
    assert float8_losses == pytest.approx(plain_losses, rel=1e-3) and float8_losses != plain_losses
    assert precomputed == in_float8.modules * 2  # the scales, after each optimizer step
    shapes = {name: (value.shape, value.dtype) for name, value in in_float8.named_state().items()}
    assert shapes == {name: (value.shape, value.dtype) for name, value in plain.named_state().items()}
    resumed = trainer(float8_on=False)
    resumed.load_local_shards(in_float8.local_shards())
    assert resumed.state_digest() == in_float8.state_digest()
    back = trainer(float8_on=True)
    back.load_local_shards(plain.local_shards())
    assert back.state_digest() == plain.state_digest()
    assert back.train_step(3).loss == pytest.approx(plain.train_step(3).loss, rel=1e-3)
