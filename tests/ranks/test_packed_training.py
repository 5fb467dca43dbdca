"""Training on a masked corpus gives the same losses and gradients on any mesh: packed by documents,
one rank accumulating two rounds against two data-parallel ranks, replica groups, tensor and
context parallelism; cut in windows, one rank against a pipeline (whose schedule computes each
microbatch's loss) and tensor parallelism. The first step's loss is the plain mean over the
global batch's trained labels (``transformers``' definition, ``ignore_index=-100``), not a mean
of microbatch means.

Spawned processes on real gloo (``tests/ranks/packing_ranks.py``); the packing itself and the
logits against ``transformers``: tests/unit/test_packed_documents.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from checkpointing.storage import open_storage
from elastic.spec import CpMethod, MeshSpec
from tests.marks import slow_when_named
from tests.ranks import packing_ranks
from tests.ranks.spawned_ranks import spawn_ranks
from tests.token_corpus import masked_corpus
from workers.data import IGNORE_INDEX, local_batch
from workers.initial_values import init_weights
from workers.models import resolve_family
from workers.spec.tokens import Packing
from workers.token_source import TokenSource

LAYOUTS = {
    "documents-dp_shard2": (MeshSpec(dp_shard=2), Packing.DOCUMENTS),
    "documents-dp_replicate2": (MeshSpec(dp_replicate=2, dp_shard=1), Packing.DOCUMENTS),
    "documents-tp2": (MeshSpec(dp_shard=1, tp=2), Packing.DOCUMENTS),
    "documents-cp2": (MeshSpec(dp_shard=1, cp=2), Packing.DOCUMENTS),
    "windows-pp2": (MeshSpec(dp_shard=1, pp=2), Packing.WINDOWS),
    "windows-pp2-tp2": (MeshSpec(dp_shard=1, pp=2, tp=2), Packing.WINDOWS),
    "documents-ulysses-cp2": (MeshSpec(dp_shard=1, cp=2), Packing.DOCUMENTS),
    "documents-ring-cp2": (MeshSpec(dp_shard=1, cp=2), Packing.DOCUMENTS),
}
# Layouts whose context parallelism is not the default all-gather (``parallelism.cp_method``).
CP_METHODS = {"documents-ulysses-cp2": CpMethod.ULYSSES, "documents-ring-cp2": CpMethod.RING}


@pytest.fixture(scope="module")
def corpus_uri(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("masked-corpus")
    masked_corpus(open_storage(str(directory)), shard_tokens=500)
    return str(directory)


@pytest.fixture(scope="module")
def single_rank_runs(tmp_path_factory, corpus_uri) -> dict[Packing, tuple]:
    runs = {}
    for packing in Packing:
        store = tmp_path_factory.mktemp(f"single-{packing}") / "store"
        run = functools.partial(
            packing_ranks.run_rank, mesh=MeshSpec(dp_shard=1), corpus_uri=corpus_uri, packing=packing
        )
        runs[packing] = spawn_ranks(run, world_size=1, store_path=str(store))[0]
    return runs


def plain_first_step_loss(corpus_uri: str) -> tuple[float, int]:
    """One process, no mesh: the seeded model's mean cross entropy over step 1's trained labels."""
    spec = packing_ranks.packing_train_spec(corpus_uri)
    assert spec.tokens is not None
    family = resolve_family(spec.model.family)
    model = family.build(spec.model)
    init_weights(model, family, spec.model, seed=spec.seed)
    source = TokenSource(spec.tokens, seq_len=spec.seq_len, seed=spec.seed)
    try:
        batch = local_batch(source, step=1, global_batch=spec.global_batch, dp_rank=0, dp=1)
    finally:
        source.close()
    with torch.no_grad():
        logits = model(batch.inputs, batch.documents)
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX)
    return loss.item(), int((batch.labels != IGNORE_INDEX).sum())


def test_one_rank_loss_is_the_mean_over_the_global_batchs_trained_labels(single_rank_runs, corpus_uri):
    losses, _, trained_tokens, _, _ = single_rank_runs[Packing.DOCUMENTS]
    expected_loss, expected_tokens = plain_first_step_loss(corpus_uri)
    assert trained_tokens[0] == expected_tokens < 8 * 64  # the prompts and the padding do not train
    assert losses[0] == pytest.approx(expected_loss, rel=1e-5)
    assert losses[-1] < losses[0]


# windows-pp2-tp2 (4-10 s on 2 cores) combines two layouts shown apart: CI runs it (make test-all), make test not.
@pytest.mark.parametrize(
    "layout",
    slow_when_named(
        LAYOUTS,
        {"windows-pp2-tp2", "documents-dp_replicate2", "documents-cp2", "documents-ulysses-cp2", "documents-ring-cp2"},
    ),
)
def test_masked_training_matches_one_rank(layout, single_rank_runs, corpus_uri, tmp_path):
    mesh, packing = LAYOUTS[layout]
    cp_method = CP_METHODS.get(layout, CpMethod.ALLGATHER)
    run = functools.partial(
        packing_ranks.run_rank, mesh=mesh, corpus_uri=corpus_uri, packing=packing, cp_method=cp_method
    )
    ranks = spawn_ranks(run, world_size=mesh.world_size, store_path=str(tmp_path / "s"))
    expected_losses, expected_norms, expected_tokens, expected_eval, expected_eval_tokens = single_rank_runs[packing]
    reported = [values[0] for values in ranks.values() if values[0][0] is not None]
    assert len(reported) == mesh.dp
    # Each slice reports its share x dp; the driver's mean over slices is the global loss.
    assert [sum(step) / mesh.dp for step in zip(*reported)] == pytest.approx(expected_losses, rel=1e-5)
    for rank, (_, norms, tokens, evaluation, eval_tokens) in ranks.items():
        assert norms == pytest.approx(expected_norms, rel=1e-4), f"rank {rank}: the gradients differ"
        assert tokens == expected_tokens
        assert evaluation == pytest.approx(expected_eval, rel=1e-5) and eval_tokens == expected_eval_tokens
