"""The training loop's checkpoint stall on GPUs: staging into pinned host memory (what the
rank does) against a plain device-to-host copy of the same shards (``tensor.to("cpu")``, into
pageable memory).

    make test-gpu        # or: python -m pytest tests/gpu/test_checkpoint_stall.py -s

A real job (FSDP over up to two GPUs, one rank per GPU, a ~135M-parameter model so that a stall is
milliseconds, not noise) saves every 10 steps; its ``checkpoint_staged`` events carry the
slowest rank's stall. The plain copy is timed afterwards in this process on one GPU, for the
same per-rank tensors (parameters and both AdamW moments, float32, each rank's share).
"""

from __future__ import annotations

import statistics
import time

import torch

from orchestrator.config import load_config
from tests.faults.harness import of_kind
from tests.gpu.layouts import ON_GPUS, data_parallel_layout
from tests.jobs import DEMO_CONFIG, train

STEPS = 50
# Saves far enough apart, with room for two in flight, that no save waits on the last upload
# (back-pressure is a stall of its own, not the staging copy measured here).
INTERVAL_STEPS = 10
MODEL = ("model.dim=1024", "model.n_layers=8", "model.ffn_dim=4096")
# Pinned staging may be at most this much slower than the plain copy before the test fails;
# it is expected to be faster (pinned copies run at the link's full rate).
MARGIN_RATIO, MARGIN_S = 1.25, 0.005
ROUNDS = 5


def per_rank_shards(overrides: tuple[str, ...], dp_shard: int) -> list[int]:
    """Element counts of one rank's slices: each parameter and its two AdamW moments."""
    model = load_config(DEMO_CONFIG, list(overrides)).model_spec
    kv = model.n_kv_heads * model.head_dim
    layer = [model.dim * model.dim, model.dim * kv, model.dim * kv, model.dim * model.dim]
    layer += [model.dim * model.ffn_dim] * 3 + [model.dim, model.dim]
    params = [model.vocab_size * model.dim, *layer * model.n_layers, model.dim, model.vocab_size * model.dim]
    return [-(-numel // dp_shard) for numel in params for _ in range(3)]


def plain_copy_stall(numels: list[int]) -> float:
    """Median seconds to copy the tensors to host with ``.to("cpu")`` (the copy blocks until done)."""
    device = torch.device("cuda", 0)
    tensors = [torch.randn(numel, device=device) for numel in numels]
    times = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        copies = [tensor.to("cpu") for tensor in tensors]
        times.append(time.perf_counter() - started)
        del copies
    return statistics.median(times)


def test_pinned_staging_stalls_no_longer_than_a_plain_copy(tmp_path):
    layout = data_parallel_layout()
    overrides = (*MODEL, *layout, "training.dtype=float32")
    result, events = train(
        tmp_path / "run",
        *ON_GPUS,
        *overrides,
        f"training.steps={STEPS}",
        f"checkpoint.uri={tmp_path / 'ckpt'}",
        f"checkpoint.interval_steps={INTERVAL_STEPS}",
        "checkpoint.max_in_flight=2",
        "checkpoint.keep_last=1",
    )
    assert result.exit_code == 0, result.reason
    stalls = [e["stall_s"] for e in of_kind(events, "checkpoint_staged")]
    assert len(stalls) >= 4
    pinned = statistics.median(stalls[1:])  # the first save also allocates the pinned buffer
    numels = per_rank_shards(overrides, dp_shard=load_config(DEMO_CONFIG, list(layout)).mesh.dp_shard)
    plain = plain_copy_stall(numels)
    print(
        f"checkpoint stall per save, {sum(numels) * 4 / 2**20:.0f} MiB per rank: pinned staging "
        f"{pinned * 1e3:.1f} ms (first save {stalls[0] * 1e3:.1f} ms) vs plain .to('cpu') {plain * 1e3:.1f} ms "
        f"(x{pinned / plain:.2f})"
    )
    assert pinned <= plain * MARGIN_RATIO + MARGIN_S, (pinned, plain)
