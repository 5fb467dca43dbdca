"""``data.source: tokens`` on a rank: the windows it trains on are the corpus stream's, bit for bit,
from disk and from S3; the next step's samples are read ahead; closing leaves no thread behind."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from checkpointing.storage import open_storage
from tests.token_corpus import Corpus, documents, small_corpus, write_corpus
from workers.data import Sample, local_batch, local_samples
from workers.runtime import make_source
from workers.spec import PRESETS, TrainSpec
from workers.spec.tokens import TokenCorpusError, WindowOrder, window_count
from workers.spec.train import TokenCorpusSource
from workers.token_source import TokenSource

SEQ_LEN = 32


def expected_train(corpus: Corpus, index: int, *, seed: int = 0) -> np.ndarray:
    """Sample ``index`` by the format's definition, from the whole train stream in memory."""
    windows = window_count(len(corpus.train), SEQ_LEN)
    start = WindowOrder(windows, seed=seed).window(index) * SEQ_LEN
    return corpus.train[start : start + SEQ_LEN + 1]


def window_of(sample: Sample) -> np.ndarray:
    """The ``seq_len + 1`` stream tokens an unmasked window sample was cut from."""
    assert torch.equal(sample.labels[:-1], sample.inputs[1:]), "every label is the next input"
    return np.append(sample.inputs.numpy(), sample.labels[-1].item())


def assert_stream_windows(source: TokenSource, corpus: Corpus) -> None:
    windows = window_count(len(corpus.train), SEQ_LEN)
    # two epochs: every window once per epoch, each equal to its slice of the stream
    for index in range(2 * windows):
        got = source.sample(index)
        assert got.inputs.dtype == torch.int64 and got.inputs.shape == got.labels.shape == (SEQ_LEN,)
        assert got.documents is None
        assert np.array_equal(window_of(got), expected_train(corpus, index)), f"sample {index}"
    validation_windows = window_count(len(corpus.validation), SEQ_LEN)
    for index in range(validation_windows + 2):  # in order, wrapping around
        start = (index % validation_windows) * SEQ_LEN
        assert np.array_equal(window_of(source.eval_sample(index)), corpus.validation[start : start + SEQ_LEN + 1])


def test_local_corpus_windows_equal_the_stream(tmp_path):
    corpus = small_corpus(open_storage(str(tmp_path)), shard_tokens=50)  # windows cross shard boundaries
    source = TokenSource(TokenCorpusSource(str(tmp_path)), seq_len=SEQ_LEN, seed=0)
    try:
        assert_stream_windows(source, corpus)
    finally:
        source.close()


def test_wide_vocabulary_corpus_reads_uint32_tokens(tmp_path):
    vocab = 70_000
    corpus = write_corpus(
        open_storage(str(tmp_path)),
        train=documents(30, vocab_size=vocab, seed=3),
        validation=documents(3, vocab_size=vocab, seed=4),
        vocab_size=vocab,
        shard_tokens=77,
    )
    assert corpus.manifest.dtype == "uint32" and corpus.train.max() >= 1 << 16
    source = TokenSource(TokenCorpusSource(str(tmp_path)), seq_len=SEQ_LEN, seed=0)
    try:
        assert_stream_windows(source, corpus)
    finally:
        source.close()


def test_s3_corpus_windows_equal_the_stream(s3_bucket):
    storage = open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url)
    corpus = small_corpus(storage, shard_tokens=300)
    storage.close()
    source = TokenSource(TokenCorpusSource(s3_bucket.uri, s3_bucket.endpoint_url), seq_len=SEQ_LEN, seed=0)
    try:
        assert_stream_windows(source, corpus)
    finally:
        source.close()


def test_the_seed_changes_the_order_not_the_windows(tmp_path):
    corpus = small_corpus(open_storage(str(tmp_path)))
    source = TokenSource(TokenCorpusSource(str(tmp_path)), seq_len=SEQ_LEN, seed=5)
    try:
        assert np.array_equal(window_of(source.sample(3)), expected_train(corpus, 3, seed=5))
        assert not np.array_equal(window_of(source.sample(3)), expected_train(corpus, 3, seed=0))
    finally:
        source.close()


def test_next_steps_samples_are_prefetched_while_a_step_runs(s3_bucket):
    storage = open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url)
    corpus = small_corpus(storage)
    storage.close()
    source = TokenSource(TokenCorpusSource(s3_bucket.uri, s3_bucket.endpoint_url), seq_len=SEQ_LEN, seed=0)
    try:
        batch = dict(global_batch=8, dp_rank=1, dp=2)
        first = local_batch(source, step=1, **batch)  # read when asked: nothing was hinted yet
        assert (source.stats.read_on_demand, source.stats.prefetched) == (4, 0)
        for step in range(2, 6):
            rows = local_batch(source, step=step, **batch)
            expected = np.stack([expected_train(corpus, i) for i in local_samples(step=step, **batch)])
            assert np.array_equal(rows.inputs.numpy(), expected[:, :-1])
            assert np.array_equal(rows.labels.numpy(), expected[:, 1:])
        assert source.stats.read_on_demand == 4 and source.stats.prefetched == 16  # every later step came prefetched
        assert first.inputs.shape == (4, SEQ_LEN)
    finally:
        source.close()


class SlowReads:
    """Wraps a shard reader: every read takes ``delay_s`` (a far bucket)."""

    def __init__(self, reader, delay_s: float) -> None:
        self.reader, self.delay_s = reader, delay_s

    def read(self, key, begin, end):
        time.sleep(self.delay_s)
        return self.reader.read(key, begin, end)

    def close(self):
        self.reader.close()


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("meshpilot-prefetch")]


def test_close_ends_the_prefetch_thread_and_drops_pending_reads(tmp_path):
    small_corpus(open_storage(str(tmp_path)))
    before = prefetch_threads()
    for _ in range(3):  # one source per generation
        source = TokenSource(TokenCorpusSource(str(tmp_path)), seq_len=SEQ_LEN, seed=0)
        source.reader = SlowReads(source.reader, delay_s=0.05)
        source.prefetch(range(100))
        source.close()  # waits for the read in flight only, not for the 99 others
    assert prefetch_threads() == before


def test_make_source_opens_the_corpus_named_in_the_spec(tmp_path):
    corpus = small_corpus(open_storage(str(tmp_path)))
    spec = TrainSpec(
        model=PRESETS["debug"],
        steps=1,
        global_batch=2,
        seq_len=SEQ_LEN,
        microbatch_size=1,
        data_source="tokens",
        tokens=TokenCorpusSource(str(tmp_path)),
        seed=0,
    )
    source = make_source(spec, None)
    try:
        assert np.array_equal(window_of(source.sample(0)), expected_train(corpus, 0))
    finally:
        source.close()


def test_a_directory_without_a_corpus_names_the_fix(tmp_path):
    with pytest.raises(TokenCorpusError, match="manifest.json is missing.*meshpilot data prepare"):
        TokenSource(TokenCorpusSource(str(tmp_path)), seq_len=SEQ_LEN, seed=0)
