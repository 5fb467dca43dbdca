"""bfloat16 on GPUs trains like float32 on GPUs: per-step losses within bf16 tolerance.

    make test-gpu        # or: python -m pytest tests/gpu/test_bf16_parity.py

FSDP over up to two GPUs (dp_shard=2, NCCL; one rank on a one-GPU machine), the demo model and
text, 20 steps, once with bfloat16 parameters (float32 gradient reduction, the GPU default) and
once all in float32.
"""

from __future__ import annotations

import pytest

from tests.gpu.layouts import ON_GPUS, data_parallel_layout
from tests.jobs import losses, train

STEPS = 20
# bfloat16 keeps 8 significant bits (a relative step of 2**-8 = 0.4%); 20 steps of drift in
# the parameters' rounding stay within a few of those steps in the loss.
BF16_REL = 2e-2


def test_bf16_losses_track_float32(tmp_path):
    runs = {}
    for dtype in ("float32", "bfloat16"):
        result, events = train(
            tmp_path / dtype, *ON_GPUS, *data_parallel_layout(), f"training.steps={STEPS}", f"training.dtype={dtype}"
        )
        assert result.exit_code == 0, result.reason
        runs[dtype] = losses(events)
    fp32, bf16 = runs["float32"], runs["bfloat16"]
    print({"float32": fp32, "bfloat16": bf16})
    assert sorted(bf16) == sorted(fp32) == list(range(1, STEPS + 1))
    for step in fp32:
        assert bf16[step] == pytest.approx(fp32[step], rel=BF16_REL), f"step {step}"
    assert bf16[STEPS] < bf16[1] - 0.5  # it trained: the loss fell on the text
