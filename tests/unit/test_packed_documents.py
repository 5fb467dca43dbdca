"""Packing by documents and the masked loss, on one process: what a packed sample holds, that the
model sees each document as if it were alone (logits equal ``transformers``' for each document
run by itself), and that the loss over masked labels is ``transformers``' loss with ``-100``.

Across ranks (the loss and gradients equal on any mesh): tests/ranks/test_packed_training.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from checkpointing.storage import open_storage
from elastic.spec import MeshSpec
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.driver.sample_ledger import SampleLedger, read_ledger
from orchestrator.observe.events import EventLog
from tests.hf_models import reference_logits, save_random_model
from tests.token_corpus import Corpus, masked_corpus, small_corpus
from workers.data import IGNORE_INDEX, Batch, Sample, local_batch, local_samples
from workers.models import LlamaFamily
from workers.spec.messages import StepReport
from workers.spec.tokens import Packing, ShardEntry, best_fit_decreasing, pack_documents, shard_ends, shard_ranges
from workers.spec.train import TokenCorpusSource
from workers.token_source import TokenSource

SEQ_LEN = 64


# ----------------------------------------------------------------------------- the plan
def test_every_document_piece_is_packed_once_and_long_documents_are_cut():
    lengths = np.random.default_rng(0).integers(1, 150, size=2_000)
    plan = pack_documents(lengths, SEQ_LEN)
    # Pieces are the documents, those longer than seq_len cut into seq_len pieces (the last shorter),
    # tiling the stream in order.
    expected = np.concatenate([[SEQ_LEN] * (length // SEQ_LEN) + [length % SEQ_LEN] for length in lengths])
    assert np.array_equal(np.diff(plan.piece_starts), expected[expected > 0])
    assert plan.piece_starts[0] == 0 and plan.piece_starts[-1] == lengths.sum()
    assert plan.cut_documents == int(np.count_nonzero(lengths > SEQ_LEN))
    # Every piece is in exactly one sample; a sample holds at most seq_len tokens, its pieces in stream order.
    by_sample = [plan.pieces_of(sample) for sample in range(plan.samples)]
    assert sorted(np.concatenate(by_sample).tolist()) == list(range(plan.pieces))
    assert all(np.all(np.diff(pieces) > 0) for pieces in by_sample)
    # Samples come in the order of their first pieces (evaluation reads a split's first samples).
    assert np.all(np.diff([pieces[0] for pieces in by_sample]) > 0) and by_sample[0][0] == 0
    for sample in range(plan.samples):
        ranges = plan.piece_ranges(sample)
        assert [stop - start for start, stop in ranges] == plan.piece_lengths(sample).tolist()
        assert 0 < plan.piece_lengths(sample).sum() <= SEQ_LEN


def test_best_fit_packing_leaves_far_less_padding_than_taking_documents_in_stream_order():
    """Documents of 8 to 600 tokens (the bench's mix) at seq_len 1024: taking them in stream order
    while they fit (next fit) pads about 20% of every sample; best fit decreasing about 0.1%."""
    lengths = np.random.default_rng(1).integers(8, 601, size=2_000)
    plan = pack_documents(lengths, 1024)
    assert 1 - plan.fill < 0.01
    next_fit_samples, room = 1, 1024
    for length in lengths.tolist():
        next_fit_samples, room = (
            (next_fit_samples, room - length) if length <= room else (next_fit_samples + 1, 1024 - length)
        )
    assert plan.samples < 0.85 * next_fit_samples
    # A pure function of (lengths, seq_len): the same plan, array for array, every time.
    again = pack_documents(lengths.copy(), 1024)
    assert all(
        np.array_equal(getattr(plan, name), getattr(again, name))
        for name in ("piece_starts", "sample_pieces", "first_piece")
    )


def textbook_best_fit_decreasing(sizes: list[int], capacity: int) -> list[int]:
    """One item at a time: largest first (ties: lower number), into the bin with the least room
    that holds it (ties: the bin that came to that room first), else a new bin."""
    waiting: dict[int, list[int]] = {}  # room -> bins with that room, in the order they came to it
    bins, opened = [0] * len(sizes), 0
    for item in sorted(range(len(sizes)), key=lambda item: (-sizes[item], item)):
        rooms = [room for room, queue in waiting.items() if queue and room >= sizes[item]]
        if rooms:
            room = min(rooms)
            bins[item] = waiting[room].pop(0)
        else:
            room, bins[item], opened = capacity, opened, opened + 1
        waiting.setdefault(room - sizes[item], []).append(bins[item])
    return bins


def test_best_fit_decreasing_by_sizes_equals_the_textbook_one_item_at_a_time():
    generator = np.random.default_rng(2)
    for trial in range(150):
        capacity = int(generator.integers(1, 60 if trial % 4 else 10_000))  # and long contexts
        sizes = generator.integers(1, capacity + 1, size=int(generator.integers(0, 300)))
        if trial % 3 == 0:  # many small items: bins take several of one size
            sizes = np.minimum(sizes, max(1, capacity // 4))
        bins, count = best_fit_decreasing(sizes, capacity)
        expected = textbook_best_fit_decreasing(sizes.tolist(), capacity)
        assert bins.tolist() == expected and count == len(set(expected)), (capacity, sizes.tolist())


def test_a_pieces_shards_found_by_bisection_are_those_a_walk_from_the_first_shard_finds():
    generator = np.random.default_rng(3)
    shards = tuple(
        ShardEntry(f"train/{n:05d}.bin", int(tokens), "") for n, tokens in enumerate(generator.integers(1, 50, 80))
    )
    ends = shard_ends(shards)
    for _ in range(2_000):
        start = int(generator.integers(0, ends[-1]))
        stop = int(generator.integers(start + 1, ends[-1] + 1))
        assert shard_ranges(shards, start, stop, 2, ends) == shard_ranges(shards, start, stop, 2)


def test_a_packed_sample_restarts_at_each_document_and_pads_with_nothing_to_train():
    tokens = torch.tensor([5, 6, 7, 8, 9, 10])
    trained = torch.tensor([0, 1, 0, 1, 1, 1])  # a prompt token, then trained ones
    sample = Sample.packed(tokens, [2, 3, 1], seq_len=8, trained=trained)
    assert sample.inputs.tolist() == [5, 6, 7, 8, 9, 10, 0, 0]
    assert sample.documents is not None and sample.documents.tolist() == [0, 0, 1, 1, 1, 2, 3, 3]
    # No label crosses a document boundary; a label trains only where its token's mask is 1.
    assert sample.labels.tolist() == [6, -100, 8, 9, -100, -100, -100, -100]


def packed_source(tmp_path, corpus_maker=masked_corpus, *, seed: int = 0) -> tuple[TokenSource, Corpus]:
    corpus = corpus_maker(open_storage(str(tmp_path)), shard_tokens=300)
    source = TokenSource(TokenCorpusSource(str(tmp_path), packing=Packing.DOCUMENTS), seq_len=SEQ_LEN, seed=seed)
    return source, corpus


def test_an_epoch_of_packed_samples_trains_every_trained_token_of_the_corpus_once(tmp_path):
    source, corpus = packed_source(tmp_path)
    try:
        samples, plan = source.train_windows, source.plans["train"]
        assert samples == plan.samples < plan.pieces  # short documents share samples
        epoch = [source.sample(index) for index in range(samples)]
        # Whatever the order, the samples hold their pieces' tokens end to end, each piece once.
        seen = []
        for index, sample in enumerate(epoch):
            number = source.order.window(index)
            ranges = plan.piece_ranges(number)
            expected_tokens = np.concatenate([corpus.train[start:stop] for start, stop in ranges])
            assert np.array_equal(sample.inputs.numpy()[: len(expected_tokens)], expected_tokens)
            assert (sample.labels[len(expected_tokens) :] == IGNORE_INDEX).all()  # the padding trains nothing
            seen.extend(plan.pieces_of(number).tolist())
        assert sorted(seen) == list(range(plan.pieces))
        assert plan.fill > 0.9  # short documents fill the samples: little padding
        # Every trained token is a label exactly once, except each piece's first (nothing before
        # it in its piece predicts it): the masked corpus trains the ends of documents only.
        assert corpus.train_mask is not None
        firsts = np.zeros(len(corpus.train), dtype=bool)
        firsts[plan.piece_starts[:-1]] = True
        expected = int((corpus.train_mask.astype(bool) & ~firsts).sum())
        assert sum(sample.trained_tokens for sample in epoch) == expected
        # Labels are the next token of the same piece where the mask trains it.
        sample, number = epoch[0], source.order.window(0)
        offset = 0
        for start, stop in plan.piece_ranges(number):
            labels = sample.labels.numpy()[offset : offset + stop - start - 1]
            kept = labels != IGNORE_INDEX
            assert np.array_equal(labels[kept], corpus.train[start + 1 : stop][kept])
            assert corpus.train_mask[start + 1 : stop][kept].all()
            offset += stop - start
    finally:
        source.close()


def test_sample_i_is_a_pure_function_of_the_corpus_the_seed_and_i(tmp_path):
    source, _ = packed_source(tmp_path, seed=3)
    again = TokenSource(TokenCorpusSource(str(tmp_path), packing=Packing.DOCUMENTS), seq_len=SEQ_LEN, seed=3)
    other_seed = TokenSource(TokenCorpusSource(str(tmp_path), packing=Packing.DOCUMENTS), seq_len=SEQ_LEN, seed=4)
    try:
        again.prefetch(range(7, 12))  # read ahead or on demand: the same samples
        for index in (0, 9, source.train_windows + 2):
            first, second = source.sample(index), again.sample(index)
            assert all(torch.equal(a, b) for a, b in zip(vars(first).values(), vars(second).values()))
        # The seed orders the same packed samples differently; the plan does not depend on it.
        ours_plan, theirs_plan = source.plans["train"], other_seed.plans["train"]
        assert np.array_equal(ours_plan.first_piece, theirs_plan.first_piece)
        assert np.array_equal(ours_plan.sample_pieces, theirs_plan.sample_pieces)
        epoch = source.train_windows
        ours = sorted(tuple(source.sample(i).inputs.tolist()) for i in range(epoch))
        theirs = [tuple(other_seed.sample(i).inputs.tolist()) for i in range(epoch)]
        assert ours == sorted(theirs)
        assert [list(t) for t in theirs] != [source.sample(i).inputs.tolist() for i in range(epoch)]
    finally:
        for opened in (source, again, other_seed):
            opened.close()


def test_exactly_once_across_a_kill_and_a_grow_with_documents_packing(tmp_path):
    """dp=4, a replica lost (dp=2), one back (dp=4): every step's global batch is the samples of an
    uninterrupted one-rank run, so each packed sample is trained once, none skipped."""
    source, _ = packed_source(tmp_path)
    try:
        meshes = {1: 4, 2: 4, 3: 2, 4: 2, 5: 4, 6: 4}  # data-parallel degree per step
        uninterrupted = [local_batch(source, step=step, global_batch=8, dp_rank=0, dp=1) for step in meshes]
        for (step, dp), whole in zip(meshes.items(), uninterrupted):
            slices = [local_batch(source, step=step, global_batch=8, dp_rank=rank, dp=dp) for rank in range(dp)]
            joined = Batch(
                inputs=torch.cat([s.inputs for s in slices]),
                labels=torch.cat([s.labels for s in slices]),
                documents=torch.cat([s.documents for s in slices if s.documents is not None]),
            )
            assert torch.equal(joined.inputs, whole.inputs) and torch.equal(joined.labels, whole.labels)
            assert whole.documents is not None and torch.equal(joined.documents, whole.documents)
        seen = [tuple(row.tolist()) for batch in uninterrupted for row in batch.inputs]
        assert len(seen) == len(set(seen)) == 48  # 6 steps x 8, no sample twice within the epoch
    finally:
        source.close()


def test_packed_samples_read_from_s3_ahead_of_time_equal_those_read_from_disk(tmp_path, s3_bucket):
    """Ranged GETs piece by piece (tokens and mask), several samples at once in the prefetch
    threads: the same samples, bit for bit, as the mapped files on disk give."""
    storage = open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url)
    masked_corpus(storage, shard_tokens=300)
    storage.close()
    on_disk, _ = packed_source(tmp_path)
    in_s3 = TokenSource(
        TokenCorpusSource(s3_bucket.uri, s3_bucket.endpoint_url, packing=Packing.DOCUMENTS), seq_len=SEQ_LEN, seed=0
    )
    try:
        for step in range(1, 4):
            ours = local_batch(in_s3, step=step, global_batch=8, dp_rank=1, dp=2)
            theirs = local_batch(on_disk, step=step, global_batch=8, dp_rank=1, dp=2)
            assert all(torch.equal(a, b) for a, b in zip(vars(ours).values(), vars(theirs).values()))
        assert (in_s3.stats.read_on_demand, in_s3.stats.prefetched) == (4, 8)  # after step 1, read ahead
    finally:
        in_s3.close()
        on_disk.close()


def test_documents_packing_refuses_a_corpus_without_document_lengths(tmp_path):
    small_corpus(open_storage(str(tmp_path)))
    (tmp_path / "train" / "documents.bin").unlink()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for split in manifest["splits"].values():
        split.pop("documents_sha256")
    manifest["version"] = 1
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="stores no document lengths .* prepare it again with meshpilot data prepare"):
        TokenSource(TokenCorpusSource(str(tmp_path), packing=Packing.DOCUMENTS), seq_len=SEQ_LEN, seed=0)


def test_masked_windows_train_only_the_masked_in_labels(tmp_path):
    corpus = masked_corpus(open_storage(str(tmp_path)), shard_tokens=300)
    source = TokenSource(TokenCorpusSource(str(tmp_path)), seq_len=SEQ_LEN, seed=0)
    try:
        assert not source.every_label_trains
        window = source.order.window(5)
        start = window * SEQ_LEN
        sample = source.sample(5)
        assert corpus.train_mask is not None
        trains = corpus.train_mask[start + 1 : start + SEQ_LEN + 1].astype(bool)
        expected = np.where(trains, corpus.train[start + 1 : start + SEQ_LEN + 1], IGNORE_INDEX)
        assert np.array_equal(sample.labels.numpy(), expected)
        assert np.array_equal(sample.inputs.numpy(), corpus.train[start : start + SEQ_LEN])
    finally:
        source.close()


# ----------------------------------------------------------------------------- the model
def llama_pair(tmp_path, name: str = "llama3"):
    """A random ``transformers`` model and ours with its weights (copied by Hugging Face names)."""
    hf_model = save_random_model(name, tmp_path)
    family = LlamaFamily()
    spec = family.spec_from_hf_config(json.loads((tmp_path / "config.json").read_text()), "config.json")
    model = family.build(spec)
    hf_state = hf_model.state_dict()
    names = family.hf_source_names(spec, [n for n, _ in model.named_parameters()], set(hf_state))
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            param.copy_(hf_state[names[fqn]])
    return hf_model, model, spec


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_packed_logits_equal_each_document_run_alone_through_transformers(name, tmp_path):
    hf_model, model, spec = llama_pair(tmp_path, name)
    generator = torch.Generator().manual_seed(2)
    rows = [[7, 12, 1, 19], [32, 20]]  # per row: its documents' lengths (then padding)
    samples, documents_by_row = [], []
    for lengths in rows:
        documents = [torch.randint(0, spec.vocab_size, (length,), generator=generator) for length in lengths]
        samples.append(Sample.packed(torch.cat(documents), lengths, seq_len=SEQ_LEN))
        documents_by_row.append(documents)
    batch = Batch.stack(samples)
    with torch.no_grad():
        packed = model(batch.inputs, batch.documents)
    for row, documents in enumerate(documents_by_row):
        start = 0
        for document in documents:
            alone = reference_logits(hf_model, document[None])[0]
            torch.testing.assert_close(packed[row, start : start + len(document)], alone, rtol=0, atol=1e-5)
            start += len(document)


def test_masked_loss_equals_transformers_loss_with_ignored_labels(tmp_path):
    """Our loss over a batch (sum over the trained labels of every microbatch / their count, as the
    trainer scales it) against ``transformers``' own loss for the same tokens and -100 labels."""
    hf_model, model, spec = llama_pair(tmp_path)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, spec.vocab_size, (4, 33), generator=generator)
    trained = torch.rand(4, 33, generator=generator) < 0.3
    trained[0] = False  # a row with nothing to train weighs nothing
    batch = Batch.stack([Sample.window(row, mask) for row, mask in zip(tokens, trained)])
    count = int((batch.labels != IGNORE_INDEX).sum())
    with torch.no_grad():
        ours = (
            sum(
                F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.labels.flatten(), reduction="sum", ignore_index=-100)
                for mb in batch.chunk(2)  # microbatches with different trained counts
            )
            / count
        )
        # transformers takes labels aligned with its inputs and shifts them itself.
        theirs = hf_model(input_ids=tokens, labels=torch.where(trained, tokens, -100)).loss
    assert 0 < count < 4 * 32
    assert float(ours) == pytest.approx(float(theirs), abs=1e-5)


def test_the_sample_ledger_across_a_kill_and_a_grow_covers_each_packed_sample_once(tmp_path):
    """The driver's ledger (RUN_DIR/samples.jsonl) through a shrink after a rank died unreported and
    a grow, mapped to the packed samples the ranks read for those indices: every packed sample of
    the epoch trained once, none twice, whatever the mesh when it was."""
    source, _ = packed_source(tmp_path / "corpus")
    global_batch, epoch = 8, source.train_windows
    router = ReportRouter(EventLog(None), mesh=MeshSpec(dp_replicate=2, dp_shard=2), tokens_per_step=1)
    router.ledger = SampleLedger(tmp_path / "samples.jsonl", global_batch=global_batch)
    steps = -(-epoch // global_batch)
    try:
        for step in range(1, steps + 1):
            mesh = MeshSpec(dp_replicate=1 if steps // 3 < step <= 2 * steps // 3 else 2, dp_shard=2)
            if mesh != router.mesh:
                router.set_mesh(mesh)  # the kill shrinks to one replica, the grow brings it back
            ranks = range(mesh.world_size)
            if step == steps // 3:
                ranks = range(mesh.world_size - 1)  # the rank about to die applied the step, unreported
            router.route([ledger_report(rank, step, mesh, global_batch) for rank in ranks])
            router.flush(step)
        indices = [index for line in read_ledger(tmp_path / "samples.jsonl") for index in line["indices"]]
        assert sorted(indices) == list(range(steps * global_batch))
        packed = [source.order.window(index) for index in indices if index < epoch]
        assert sorted(packed) == list(range(epoch))  # each packed sample of the epoch once
        # ... so each document piece of the train split once.
        plan = source.plans["train"]
        covered = np.concatenate([plan.pieces_of(window) for window in packed])
        assert sorted(covered.tolist()) == list(range(plan.pieces))
        assert plan.piece_starts[-1] == source.manifest.splits["train"].tokens
    finally:
        source.close()


def ledger_report(rank: int, step: int, mesh: MeshSpec, global_batch: int) -> StepReport:
    dp_rank = mesh.dp_rank(rank)
    indices = local_samples(step=step, global_batch=global_batch, dp_rank=dp_rank, dp=mesh.dp)
    return StepReport(
        rank=rank,
        time=float(step),
        step=step,
        loss=1.0,
        dp_rank=dp_rank,
        step_time_s=0.1,
        sample_indices=tuple(indices),
    )
