"""The token corpus format's arithmetic: window order, shard ranges, manifest round trip."""

from __future__ import annotations

import pytest

from workers.spec.tokens import (
    ShardEntry,
    SplitIndex,
    TokenCorpusError,
    TokenizerInfo,
    TokenManifest,
    WindowOrder,
    is_validation,
    parse_token_manifest,
    shard_ranges,
    window_count,
    window_tokens,
)


@pytest.mark.parametrize("windows", [1, 2, 3, 17, 1000, 4097])
def test_window_order_is_a_permutation_per_epoch(windows):
    order = WindowOrder(windows, seed=7)
    for epoch in range(2):
        drawn = [order.window(epoch * windows + i) for i in range(windows)]
        assert sorted(drawn) == list(range(windows))
    if windows > 16:
        first = [order.window(i) for i in range(windows)]
        assert first != list(range(windows))  # shuffled
        assert first != [order.window(windows + i) for i in range(windows)]  # another order next epoch
        assert first != [WindowOrder(windows, seed=8).window(i) for i in range(windows)]  # seeded


def test_windows_cover_every_label_once():
    seq_len, tokens = 4, 23
    count = window_count(tokens, seq_len)
    labels = [t for w in range(count) for t in range(*window_tokens(w, seq_len))[1:]]
    assert labels == list(range(1, 1 + count * seq_len)) and 1 + count * seq_len <= tokens


def test_shard_ranges_cross_shard_boundaries():
    shards = (ShardEntry("train/00000.bin", 10, "a"), ShardEntry("train/00001.bin", 5, "b"))
    assert shard_ranges(shards, 8, 13, 2) == [("train/00000.bin", 16, 20), ("train/00001.bin", 0, 6)]
    assert shard_ranges(shards, 0, 3, 4) == [("train/00000.bin", 0, 12)]


def test_manifest_round_trip_and_errors():
    manifest = TokenManifest(
        dtype="uint16",
        tokenizer=TokenizerInfo(sha256="ab", vocab_size=300, eos_token="<eos>", eos_id=0),
        validation_fraction=0.1,
        split_seed=0,
        splits={
            "train": SplitIndex(3, 10, (ShardEntry("train/00000.bin", 10, "x"),)),
            "validation": SplitIndex(1, 2, (ShardEntry("validation/00000.bin", 2, "y"),)),
        },
        inputs=("a.jsonl",),
    )
    assert parse_token_manifest(manifest.to_json(), "m") == manifest
    with pytest.raises(TokenCorpusError, match="is not a meshpilot token corpus"):
        parse_token_manifest(b'{"format": "other"}', "s3://b/c/manifest.json")
    with pytest.raises(TokenCorpusError, match="is not a valid token corpus manifest"):
        parse_token_manifest(b"not json", "m")


def test_validation_split_depends_only_on_the_document():
    held = [is_validation(0, 0, d, 0.1) for d in range(2000)]
    assert 100 < sum(held) < 300
    assert held == [is_validation(0, 0, d, 0.1) for d in range(2000)]
