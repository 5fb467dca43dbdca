"""A real run (Ray, gloo, dp_shard=2) on a prompt-completion corpus: the driver reads only the
manifest and packs by documents by default, the ranks pack and mask it themselves, and each step
event says how many labels trained, exactly as many as the step's samples hold; the loss falls."""

from __future__ import annotations

import pytest

from checkpointing.storage import open_storage
from tests.jobs import single_rank, train
from tests.token_corpus import masked_corpus
from workers.data import local_batch
from workers.spec.tokens import Packing
from workers.spec.train import TokenCorpusSource
from workers.token_source import TokenSource

STEPS = 8
GLOBAL_BATCH = 16  # the demo config's
SEQ_LEN = 64


@pytest.mark.slow  # one real 2-rank job, ~20 s on 2 cores; the ranks tier shows the same arithmetic in seconds
def test_a_prompt_completion_corpus_trains_packed_and_masked(ray_cluster, tmp_path):
    corpus_dir = tmp_path / "corpus"
    masked_corpus(open_storage(str(corpus_dir)), shard_tokens=500)
    result, events = train(
        tmp_path / "run",
        *single_rank("parallelism.dp_shard=2", "parallelism.microbatches=1"),
        f"training.steps={STEPS}",
        f"training.seq_len={SEQ_LEN}",
        "training.lr=3e-3",
        "data.source=tokens",
        f"data.uri={corpus_dir}",
        "eval.interval_steps=4",
        "eval.batches=1",
    )
    assert result.exit_code == 0, result.reason
    steps = [e for e in events if e["event"] == "step"]
    source = TokenSource(TokenCorpusSource(str(corpus_dir), packing=Packing.DOCUMENTS), seq_len=SEQ_LEN, seed=0)
    try:
        expected = [
            local_batch(source, step=step, global_batch=GLOBAL_BATCH, dp_rank=0, dp=1).trained_tokens
            for step in range(1, STEPS + 1)
        ]
    finally:
        source.close()
    assert [e["trained_tokens"] for e in steps] == expected
    assert all(0 < e["trained_tokens"] < e["tokens"] == GLOBAL_BATCH * SEQ_LEN for e in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [4, STEPS] and evals[-1]["loss"] < steps[0]["loss"]
