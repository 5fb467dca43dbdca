"""The GPU benchmark and the torchrun reference, as far as a CPU machine can see them: the
jobs they build are valid, NCCL ranks get their own GPU, and without CUDA one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench.gpu import PRESETS, job_config
from bench.torchrun_reference import rank_device
from orchestrator.driver.train_spec import train_spec
from tests.jobs import REPO


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_benchmark_jobs_put_one_rank_on_each_gpu_with_nccl(preset, gpus):
    config = job_config(preset, gpus)
    assert config.mesh.world_size == gpus and config.runtime.gpus_per_rank == 1
    spec = train_spec(config)
    assert (spec.backend, spec.dtype) == ("nccl", "bfloat16")


def test_torchrun_reference_drives_the_gpu_of_its_local_rank():
    assert rank_device("nccl", {"LOCAL_RANK": "3"}) == torch.device("cuda", 3)
    assert rank_device("gloo", {"LOCAL_RANK": "3"}) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_benchmark_without_cuda_exits_2_with_one_line():
    process = subprocess.run(
        [sys.executable, "bench/gpu.py", "--quick"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [f"bench/gpu.py needs CUDA GPUs; torch {torch.__version__} sees none"]


def test_a_bad_override_exits_2_with_one_line_before_looking_for_gpus():
    process = subprocess.run(
        [sys.executable, "bench/gpu.py", "--quick", "--set", "nonsense"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [
        "bench/gpu.py: invalid config: --set 'nonsense': expected dotted.key=value, e.g. --set parallelism.tp=4"
    ]
