"""A rank is SIGKILLed on a GPU job and the job goes on.

    make test-gpu        # or: python -m pytest tests/gpu/test_recovery.py

With two GPUs or more: the job shrinks in place, grows back to its starting layout once the
GPU is free again, and ends with replica groups that are bitwise identical. Ray frees a killed
rank's GPU, the controller starts a replacement actor on it and the mesh grows back: the same
layout as generation 0, which is where stale per-thread DTensor caches (CUDA runs backward on
autograd's device thread) and communicators of an aborted NCCL generation would show.

On one GPU: the only rank is killed, and a new actor on the same GPU restores the newest
checkpoint (read into CUDA tensors) and trains on with the uninterrupted run's losses.
"""

from __future__ import annotations

import pytest

from tests.faults.harness import assert_completed_like, of_kind, run_job
from tests.gpu.layouts import ON_GPUS, replica_size, replicated_layout, two_gpus_or_skip_reason
from tests.jobs import losses

# Long enough for the replacement actor to start (CUDA init included) and join before the end.
STEPS = 400
KILL_STEP = 4
needs_two_gpus = pytest.mark.skipif(bool(two_gpus_or_skip_reason()), reason=two_gpus_or_skip_reason())

# One GPU: checkpoints every 3 steps, the rank killed as step 7 starts; snapshots off, so the
# state comes from storage (a one-rank job has no peer on another process to hold a snapshot).
ONE_GPU_STEPS = 12
ONE_GPU_JOB = (
    "parallelism.dp_replicate=1",
    "parallelism.dp_shard=1",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "training.seq_len=64",
    "training.dtype=float32",
    f"training.steps={ONE_GPU_STEPS}",
    "checkpoint.interval_steps=3",
    "elastic.snapshot_interval_steps=0",
)


def _kill_last_rank() -> tuple[str, int]:
    """The fault for the highest rank (in the second replica group), and that rank."""
    last = 2 * replica_size() - 1
    return f"kill@{KILL_STEP}:{last}", last


def _assert_shrunk_then_grew_back(events, *, starting_mesh: dict, rank: int) -> None:
    [failure] = of_kind(events, "failure")
    assert failure["kind"] == "rank_died" and failure["ranks"] == [rank]
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0 and recovered["new_mesh"]["dp_replicate"] == 1
    [grow] = of_kind(events, "grow")
    assert grow["new_mesh"] == starting_mesh
    after_grow = events[events.index(grow) :]
    trained_after = [e for e in of_kind(after_grow, "step") if e["mesh"] == starting_mesh]
    assert len(trained_after) >= 10, "the grown-back mesh trained on"
    assert events[-1]["replicas_consistent"] is True  # both replica groups bitwise equal at the end


@pytest.fixture(scope="module")
def float32_reference(tmp_path_factory):
    layout = replicated_layout(inner="dp_shard")
    result, events = run_job(
        tmp_path_factory.mktemp("uninterrupted"), *ON_GPUS, *layout, "training.dtype=float32", f"training.steps={STEPS}"
    )
    assert result.exit_code == 0, result.reason
    return losses(events), of_kind(events, "step")[0]["mesh"]


@needs_two_gpus
def test_sigkill_shrinks_in_place_and_replicas_end_bitwise_equal(float32_reference, tmp_path):
    reference, starting_mesh = float32_reference
    layout = replicated_layout(inner="dp_shard")
    fault, rank = _kill_last_rank()
    result, events = run_job(
        tmp_path, *ON_GPUS, *layout, "training.dtype=float32", f"training.steps={STEPS}", faults=(fault,)
    )
    assert result.exit_code == 0, result.reason
    # float32 on GPUs: a reduction over fewer replicas sums in another order, so not bitwise
    # equal to the uninterrupted run, but within float32 rounding of it.
    assert_completed_like(events, reference, STEPS, rel=1e-3)
    _assert_shrunk_then_grew_back(events, starting_mesh=starting_mesh, rank=rank)


@needs_two_gpus
def test_recovery_back_to_the_same_layout_in_bf16_with_tensor_parallel(tmp_path):
    """The GPU defaults (bfloat16, NCCL); with 4 GPUs or more each replica group is tp=2, so
    backward on the grown-back mesh runs DTensor ops of the same layout as generation 0."""
    layout = replicated_layout(inner="tp")
    fault, rank = _kill_last_rank()
    result, events = run_job(tmp_path, *ON_GPUS, *layout, f"training.steps={STEPS}", faults=(fault,))
    assert result.exit_code == 0, result.reason
    steps = of_kind(events, "step")
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    _assert_shrunk_then_grew_back(events, starting_mesh=steps[0]["mesh"], rank=rank)


def test_the_only_rank_killed_restores_its_checkpoint_on_the_same_gpu(tmp_path):
    runs = {}
    for name, faults in (("uninterrupted", ()), ("killed", ("kill@7:0",))):
        checkpoints = f"checkpoint.uri={tmp_path / name / 'ckpt'}"
        result, events = run_job(tmp_path / name, *ON_GPUS, *ONE_GPU_JOB, checkpoints, faults=faults)
        assert result.exit_code == 0, result.reason
        runs[name] = events
    reference = losses(runs["uninterrupted"])
    events = runs["killed"]
    [failure] = of_kind(events, "failure")
    assert failure["kind"] == "rank_died" and failure["ranks"] == [0]
    [restored] = of_kind(events, "restored")
    assert restored["source"] == "storage" and restored["step"] in (3, 6)
    # Steps after the restored one are trained again; the last loss of each step is what stands.
    final = losses(events)
    assert sorted(final) == list(range(1, ONE_GPU_STEPS + 1))
    for step in final:
        assert final[step] == pytest.approx(reference[step], rel=1e-3), f"step {step}"
