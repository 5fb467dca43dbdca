"""The two stages that move tokens, both in Ray Data tasks: tokenized batches -> pieces, pieces -> shards.

No token passes through the driver. ``write_pieces`` runs after ``tokenize.tokenize_documents``: each
batch's tokens (and mask bytes) are written as one *piece* under ``.pieces/RUN/`` in ``--out``, and only
each document's place in it (piece key, position, length, trained count) goes on to the driver. The
driver, which takes those rows in input order, gives each document its split and plans every shard as
a list of piece ranges (``writing.SplitPlan``). ``assemble_shards`` then builds each planned shard from
ranged reads of its pieces and stores it (and its mask shard) or, against a committed corpus, checks
it. The shard cut is the one the stream of tokens gives, so the bytes are the same whatever the tasks
and chunks; the pieces are deleted once the run ends, committed or not.

Why pieces: a document's split and its place in a shard depend on every document before it in the
input (the split hashes its number in its input; shards are cut every ``shard_tokens`` of a split's
stream), which a task learns only when the ones before it are done. Writing the tokens once where they
are made, and reading back the ranges each shard needs, keeps the bandwidth in the tasks.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Any

import numpy as np

from orchestrator.data_prep.reading import RecordFields, open_input_storage, read_documents
from workers.spec.tokens import mask_key

PIECES_PREFIX = ".pieces/"
GAP_BYTES = 256 << 10  # ranges of a piece closer than this are read together: about one request's latency


class Stored(StrEnum):
    """What storing one object came to."""

    WRITTEN = "written"  # a fresh corpus: written
    KEPT = "kept"  # a committed corpus: found there, identical
    REPAIRED = "repaired"  # a committed corpus: missing, written again with the same bytes
    DIFFERS = "differs"  # a committed corpus: the inputs now give other bytes (nothing written)


def abort_key(run: str) -> str:
    """The marker the driver writes when the run has failed: tasks that start after it do no work."""
    return f"{PIECES_PREFIX}{run}/aborted"


def aborted(out_root: str, run: str, endpoint_url: str | None, region: str | None) -> bool:
    return bool(open_input_storage(out_root, endpoint_url, region).exists(abort_key(run)))


def read_unless_aborted(
    batch: dict[str, np.ndarray],
    *,
    out_root: str,
    run: str,
    fields: RecordFields,
    endpoint_url: str | None,
    region: str | None,
) -> dict[str, np.ndarray]:
    """Ray Data stage: ``reading.read_documents``, or no documents once the run has failed (nothing left to do)."""
    if aborted(out_root, run, endpoint_url, region):
        return {
            "input": np.zeros(0, np.int32),
            "offset": np.zeros(0, np.int64),
            "span": np.zeros(0, np.int64),
            "text": np.empty(0, dtype=object),
            "error": np.empty(0, dtype=object),
        }
    return read_documents(batch, fields=fields, endpoint_url=endpoint_url, region=region)


def piece_key(run: str, input_number: int, offset: int) -> str:
    """The piece of the batch whose first document is at ``offset`` of input ``input_number``."""
    return f"{PIECES_PREFIX}{run}/{input_number:05d}-{offset:013d}.bin"


def write_pieces(
    batch: dict[str, np.ndarray],
    *,
    out_root: str,
    run: str,
    itemsize: int,
    masked: bool,
    endpoint_url: str | None,
    region: str | None,
) -> dict[str, np.ndarray]:
    """Ray Data stage: a tokenized batch -> its piece in ``--out``; the rows keep each document's place in it."""
    errors, tokens, masks = batch["error"], batch["tokens"], batch["mask"]
    rows = len(errors)
    positions, lengths, trained = np.zeros(rows, np.int64), np.zeros(rows, np.int64), np.zeros(rows, np.int64)
    keys = np.empty(rows, dtype=object)
    keys[:] = ""
    good = [row for row in range(rows) if not errors[row]]
    if good and not aborted(out_root, run, endpoint_url, region):
        key = piece_key(run, int(batch["input"][good[0]]), int(batch["offset"][good[0]]))
        storage = open_input_storage(out_root, endpoint_url, region)
        data = b"".join(tokens[row] for row in good)
        storage.put_stream(key, [data], size=len(data))
        if masked:
            mask = b"".join(masks[row] for row in good)
            storage.put_stream(mask_piece(key), [mask], size=len(mask))
        position = 0
        for row in good:
            count = len(tokens[row]) // itemsize
            keys[row], positions[row], lengths[row] = key, position, count
            trained[row] = count - masks[row].count(0) if masked else count
            position += count
    return {
        "input": batch["input"],
        "offset": batch["offset"],
        "span": batch["span"],
        "error": errors,
        "piece": keys,
        "position": positions,
        "length": lengths,
        "trained": trained,
    }


def mask_piece(key: str) -> str:
    return key.removesuffix(".bin") + ".mask"


def store(storage: Any, key: str, data: bytes, *, expected: str | None, stored_size: int) -> tuple[str, Stored]:
    """Write ``data`` (a fresh corpus: ``expected`` None) or check it against the committed sha256; (sha256, what)."""
    sha256 = hashlib.sha256(data).hexdigest()
    if expected is None:
        storage.put_stream(key, [data], size=len(data))
        return sha256, Stored.WRITTEN
    if sha256 != expected:
        return sha256, Stored.DIFFERS
    if stored_size == len(data):
        return sha256, Stored.KEPT
    storage.put_stream(key, [data], size=len(data))  # the committed bytes are gone: the same ones again
    return sha256, Stored.REPAIRED


def assemble_shards(
    batch: dict[str, np.ndarray],
    *,
    out_root: str,
    itemsize: int,
    masked: bool,
    endpoint_url: str | None,
    region: str | None,
) -> dict[str, np.ndarray]:
    """Ray Data stage: planned shards (``writing.ShardPlan.to_row``) -> stored; each row's sha256s and outcome."""
    storage = open_input_storage(out_root, endpoint_url, region)
    rows = len(batch["key"])
    out: dict[str, list[str]] = {"key": [], "sha256": [], "mask_sha256": [], "stored": []}
    for row in range(rows):
        key = str(batch["key"][row])
        segments = json.loads(str(batch["segments"][row]))
        data = join_segments(storage, segments, itemsize, lambda piece: piece)
        checking = bool(batch["checking"][row])
        expected = str(batch["expected"][row]) if checking else None
        sha256, outcome = store(storage, key, data, expected=expected, stored_size=int(batch["stored_size"][row]))
        mask_sha256 = ""
        if masked and outcome != Stored.DIFFERS:
            mask = join_segments(storage, segments, 1, mask_piece)
            expected_mask = str(batch["expected_mask"][row]) if checking else None
            stored_mask = int(batch["stored_mask_size"][row])
            mask_sha256, mask_outcome = store(
                storage, mask_key(key), mask, expected=expected_mask, stored_size=stored_mask
            )
            if mask_outcome == Stored.DIFFERS or (mask_outcome == Stored.REPAIRED and outcome == Stored.KEPT):
                outcome = mask_outcome
        out["key"].append(key)
        out["sha256"].append(sha256)
        out["mask_sha256"].append(mask_sha256)
        out["stored"].append(str(outcome))
    return {name: np.asarray(values, dtype=object) for name, values in out.items()}


def join_segments(storage: Any, segments: list[list[Any]], itemsize: int, key_of: Any) -> bytes:
    """The segments' bytes, in order, reading neighbouring ranges of a piece together.

    A piece's segments in one shard are its documents of this split; documents of the other split lie
    between them. Two ranges less than ``GAP_BYTES`` apart are read as one (the gap costs less than
    another request); farther ones apart (a held-out document here and there in the validation split)
    are read alone, so no piece is read whole for a few documents.
    """
    reads: list[tuple[str, int, int]] = []  # (piece, first, last) in tokens
    where: list[tuple[int, int]] = []  # each segment: (which read, its offset in it)
    by_piece: dict[str, int] = {}  # the last read of each piece
    for piece, start, stop in segments:
        last = by_piece.get(piece)
        if last is not None and 0 <= (start - reads[last][2]) * itemsize <= GAP_BYTES:
            reads[last] = (piece, reads[last][1], max(reads[last][2], stop))
        else:
            by_piece[piece] = last = len(reads)
            reads.append((piece, start, stop))
        where.append((last, start - reads[last][1]))
    data = [storage.get_range(key_of(piece), first * itemsize, last * itemsize) for piece, first, last in reads]
    return b"".join(
        data[read][offset * itemsize : (offset + stop - start) * itemsize]
        for (read, offset), (_, start, stop) in zip(where, segments)
    )
