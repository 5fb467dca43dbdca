"""How the driver plans shards from pieces: the same cut as one stream of tokens, whatever the pieces.

    python -m pytest tests/unit/test_data_prep_writing.py -q

No Ray, no storage: pieces are byte strings in memory, documents random.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from orchestrator.data_prep.writing import SplitPlan


@pytest.mark.parametrize("seed", range(5))
def test_shards_planned_from_pieces_equal_the_stream_cut_every_shard_tokens(seed):
    rng = random.Random(seed)
    shard_tokens = rng.choice([1, 3, 7, 64])
    pieces: dict[str, list[int]] = {}
    stream: list[int] = []
    plan = SplitPlan("train", shard_tokens)
    for number in range(rng.randint(1, 12)):  # pieces, as tasks write them: several documents each
        key = f".pieces/run/{number:05d}.bin"
        pieces[key] = []
        for _ in range(rng.randint(1, 6)):
            document = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
            if rng.random() < 0.3:  # a held-out document: in the piece, not in this split
                pieces[key] += document
                continue
            plan.append(key, len(pieces[key]), len(document), trained=len(document) // 2)
            pieces[key] += document
            stream += document
    shards = plan.finish()

    assert [shard.key for shard in shards] == [f"train/{n:05d}.bin" for n in range(len(shards))]
    cut = [stream[start : start + shard_tokens] for start in range(0, len(stream), shard_tokens)]
    built = [[t for piece, start, stop in shard.segments for t in pieces[piece][start:stop]] for shard in shards]
    assert built == cut and [shard.tokens for shard in shards] == [len(part) for part in cut]
    # Neighbouring documents of one piece are one range: one read each.
    for shard in shards:
        assert all(a[0] != b[0] or a[2] != b[1] for a, b in zip(shard.segments, shard.segments[1:]))
    assert np.frombuffer(plan.document_lengths(), "<u4").sum() == len(stream) == plan.tokens


class MemoryPieces:
    """Pieces in memory, counting the ranged reads a shard costs."""

    def __init__(self, pieces: dict[str, bytes]) -> None:
        self.pieces = pieces
        self.reads: list[tuple[str, int, int]] = []

    def get_range(self, key: str, start: int, end: int) -> bytes:
        self.reads.append((key, start, end))
        return self.pieces[key][start:end]


def test_a_shard_reads_near_ranges_of_a_piece_together_and_far_ones_apart():
    from orchestrator.data_prep.pieces import GAP_BYTES, join_segments

    far = GAP_BYTES // 2 + 10  # in uint16 tokens: more than GAP_BYTES away
    pieces = {"a": bytes(range(256)) * (4 * far // 256 + 1), "b": bytes(range(7, 207))}
    storage = MemoryPieces(pieces)
    segments = [["a", 0, 10], ["a", 12, 20], ["b", 0, 50], ["a", 20 + far, 30 + far], ["b", 60, 61]]
    data = join_segments(storage, segments, 2, lambda piece: piece)
    assert data == b"".join(pieces[piece][2 * start : 2 * stop] for piece, start, stop in segments)
    assert storage.reads == [("a", 0, 40), ("b", 0, 122), ("a", 2 * (20 + far), 2 * (30 + far))]
