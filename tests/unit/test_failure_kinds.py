"""A failed rank says why, by exception type and by what the rank knows, never by message text.

Each error is classified with the function the actor uses
(``workers.rank_failures.classify_failure``); the errors real gloo collectives raise in spawned
ranks are classified in tests/ranks/test_collective_failures.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch.distributed as dist

from checkpointing import errors
from workers.faults import InjectedFault
from workers.rank_failures import classify_failure
from workers.rendezvous import CommitVoteTimeout, StepCommitter
from workers.spec.messages import FailureKind, failure_kind_of
from workers.trainer import StepAborted


def test_a_commit_vote_that_times_out_is_the_rank_own_timeout():
    committer = StepCommitter(dist.HashStore(), generation=0, world_size=2, timeout_s=0.2)
    with pytest.raises(CommitVoteTimeout, match="no commit decision within 0.2 s") as raised:
        committer.vote(1)  # the other rank never votes
    assert classify_failure(raised.value, aborted=False) == FailureKind.TIMEOUT


def test_after_the_driver_aborted_the_generation_every_error_is_a_peer_failure():
    assert classify_failure(RuntimeError("anything at all"), aborted=True) == FailureKind.PEER_FAILURE
    assert classify_failure(CommitVoteTimeout("late"), aborted=True) == FailureKind.PEER_FAILURE


@pytest.mark.parametrize(
    "error, kind",
    [
        (
            errors.CorruptCheckpointError("bad checksum", key="step-00000004/rank-00001.safetensors"),
            FailureKind.CORRUPT_CHECKPOINT,
        ),
        (errors.StorageUnreachableError("s3://bucket: no answer"), FailureKind.STORAGE),
        (errors.StorageCredentialsError("s3://bucket: access denied"), FailureKind.STORAGE),
        (InjectedFault("injected fault raise@3"), FailureKind.INJECTED),
        (StepAborted(3), FailureKind.PEER_FAILURE),
        (ValueError("a bug"), FailureKind.OWN_ERROR),
        # Timeout-like words in an untyped error say nothing: it is the rank's own error.
        (RuntimeError("the data loader timed out"), FailureKind.OWN_ERROR),
        (dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed."), FailureKind.PEER_FAILURE),
        (dist.DistStoreError("wait timeout after 500ms, keys: /gen1/step/4"), FailureKind.TIMEOUT),
    ],
)
def test_declared_and_typed_errors_keep_their_kind(error, kind):
    assert classify_failure(error, aborted=False) == kind


def _raised_from(cause: BaseException, wrapper: BaseException) -> BaseException:
    try:
        raise wrapper from cause
    except BaseException as error:  # noqa: BLE001 - the test keeps it
        return error


def test_a_pipeline_stage_wrapping_a_peer_closed_connection_is_a_peer_failure():
    """torch's pipeline stage re-raises the gloo error of a killed neighbour as a plain
    RuntimeError; the healthy rank must not be counted as a failure of its own."""
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:50399"
    )
    stage = _raised_from(gloo, RuntimeError("\n[Stage 0] failed to run forward:\nargs: ()\nkwargs: {}"))
    assert classify_failure(stage, aborted=False) == FailureKind.PEER_FAILURE
    # A typed error keeps its own kind whatever caused it; a cause of its own stays the rank's.
    storage = _raised_from(gloo, errors.StorageUnreachableError("s3://bucket: no answer"))
    assert classify_failure(storage, aborted=False) == FailureKind.STORAGE
    assert classify_failure(_raised_from(ValueError("a bug"), RuntimeError("wrapped")), aborted=False) == (
        FailureKind.OWN_ERROR
    )


def test_every_declared_checkpoint_failure_kind_is_a_failure_kind():
    for _, error_type in inspect.getmembers(errors, inspect.isclass):
        declared = getattr(error_type, "failure_kind", None)
        if declared is not None:
            assert declared in FailureKind._value2member_map_, error_type
    assert failure_kind_of(errors.CheckpointNotFoundError("no checkpoint")) == FailureKind.OWN_ERROR
