"""Training from a token corpus in S3 while the mesh changes: every sample is consumed exactly once.

A rank is killed mid-run on dp_replicate=2 x dp_shard=2, the job shrinks in place and grows back
when replacement actors are up; then a run resumes from a checkpoint onto another data-parallel
degree. ``RUN_DIR/samples.jsonl`` (``data.record_samples``) must list every global sample index up
to the last step exactly once, and the losses must equal those of an uninterrupted run.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from checkpointing.storage import open_storage
from orchestrator.driver.sample_ledger import read_ledger
from tests.faults.harness import ELASTIC_LAYOUT, assert_completed_like, of_kind, run_job
from tests.jobs import losses
from tests.token_corpus import documents, write_corpus

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 16  # the demo config's
# Long enough for replacement actors to start and grow the mesh back before the end: the mesh grew
# back at steps 10 and 13 in two runs on a loaded 2-core machine (120 steps before: the reference
# and the killed run each took twice the steps they need).
STEPS = 60
# While shrunk, 2 data-parallel ranks accumulate two rounds where 4 took one: the summation order
# changes, and float32 rounding with it. Measured here: at most 1.1e-7 relative over 120 steps (the
# other recovery tests allow 1e-4 for the same reason, on deeper meshes).
LOSS_REL = 1e-5


@pytest.fixture(scope="module")
def corpus_uri(ray_cluster, s3_server) -> tuple[str, str]:
    """A corpus of learnable documents in a bucket of its own: (uri, endpoint_url)."""
    bucket = f"corpus-{uuid.uuid4().hex[:16]}"
    s3_server.create_bucket(bucket)
    storage = open_storage(f"s3://{bucket}/tokens", endpoint_url=s3_server.endpoint_url)
    write_corpus(
        storage,
        train=documents(400, vocab_size=256, seed=0),
        validation=documents(20, vocab_size=256, seed=1),
        shard_tokens=4096,
    )
    storage.close()
    return f"s3://{bucket}/tokens", s3_server.endpoint_url


def token_job(corpus_uri: tuple[str, str], *overrides: str) -> tuple[str, ...]:
    uri, endpoint_url = corpus_uri
    return (
        *ELASTIC_LAYOUT,
        "training.seq_len=32",
        "data.source=tokens",
        f"data.uri={uri}",
        f"checkpoint.endpoint_url={endpoint_url}",
        "data.record_samples=true",
        *overrides,
    )


def assert_exactly_once(lines: list[dict[str, Any]], steps: int) -> None:
    """Every global sample of steps 1..``steps`` once; one line per step and data-parallel rank."""
    counts = Counter(index for line in lines for index in line["indices"])
    assert sorted(counts) == list(range(steps * GLOBAL_BATCH)) and set(counts.values()) == {1}
    by_step = Counter(line["step"] for line in lines)
    for line in lines:
        mesh = line["mesh"]
        assert by_step[line["step"]] == mesh["dp_replicate"] * mesh["dp_shard"]


def ledger(run_dir: Path) -> list[dict[str, Any]]:
    return read_ledger(run_dir / "samples.jsonl")


@pytest.fixture(scope="module")
def reference(corpus_uri, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result, events = run_job(run_dir, *token_job(corpus_uri, f"training.steps={STEPS}"))
    assert result.exit_code == 0, result.reason
    assert_exactly_once(ledger(run_dir), STEPS)
    return losses(events)


def test_killed_rank_and_grow_back_consume_every_sample_once(corpus_uri, reference, tmp_path):
    result, events = run_job(tmp_path, *token_job(corpus_uri, f"training.steps={STEPS}"), faults=("kill@4:3",))
    assert result.exit_code == 0, result.reason
    assert_completed_like(events, reference, STEPS, rel=LOSS_REL)
    [failure] = of_kind(events, "failure")
    assert failure["kind"] == "rank_died" and failure["ranks"] == [3]
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0 and recovered["new_mesh"]["dp_replicate"] == 1
    [grow] = of_kind(events, "grow")
    assert grow["new_mesh"]["dp_replicate"] == 2
    lines = ledger(tmp_path)
    assert_exactly_once(lines, STEPS)
    degrees = [line["mesh"]["dp_replicate"] for line in lines if line["dp_rank"] == 0]
    assert degrees[0] == 2 and 1 in degrees and degrees[-1] == 2  # shrunk, then grown back


def test_resume_onto_another_data_parallel_degree_consumes_every_sample_once(corpus_uri, s3_server, tmp_path):
    checkpoints = f"s3://{corpus_uri[0].split('/')[2]}/ckpt-{uuid.uuid4().hex[:8]}"
    saved = (f"checkpoint.uri={checkpoints}", "checkpoint.interval_steps=3")
    first, second = tmp_path / "dp4", tmp_path / "dp2"
    result, _ = run_job(first, *token_job(corpus_uri, "training.steps=6", *saved))
    assert result.exit_code == 0, result.reason
    narrower = ("parallelism.dp_replicate=1", "parallelism.dp_shard=2", "elastic.min_replicas=1")
    result, events = run_job(second, *token_job(corpus_uri, "training.steps=12", *saved, *narrower))
    assert result.exit_code == 0, result.reason
    [restored] = of_kind(events, "restored")
    assert restored["step"] == 6 and restored["to_mesh"]["dp_shard"] == 2 and restored["from_mesh"]["dp_replicate"] == 2
    assert [e["step"] for e in of_kind(events, "step")] == list(range(7, 13))
    before, after = ledger(first), ledger(second)
    assert {line["mesh"]["dp_replicate"] * line["mesh"]["dp_shard"] for line in before} == {4}
    assert {line["mesh"]["dp_replicate"] * line["mesh"]["dp_shard"] for line in after} == {2}
    assert_exactly_once(before + after, 12)
