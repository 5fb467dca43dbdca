"""The token corpus format that ``meshpilot data prepare`` writes and ``data.source: tokens`` reads.

Plain values and arithmetic, no torch: the driver checks a corpus against the job, the prepare
pipeline writes it, the ranks read windows of it. Layout under a directory or ``s3://`` prefix::

    manifest.json               the commit: written last, once every shard is durable
    train/00000.bin ...         tokens of the training documents
    train/00000.mask ...        (masked corpora) one byte per token of the shard beside it
    train/documents.bin         (version 2) each document's length in tokens, in stream order
    validation/...              the same for the held-out documents

A shard is nothing but tokens, little-endian ``uint16`` (vocabularies up to 65,536) or
``uint32``, no header. A mask shard has one ``uint8`` per token of its token shard (same cut):
1 where the token is a *trained target* (the model is taught to predict it from the tokens
before it: an assistant turn's content and end-of-turn tokens, a completion and its EOS), 0
where it is context only (system, user and tool turns, template scaffolding, a prompt). A corpus
without masks trains on every token. ``documents.bin`` holds one little-endian ``uint32`` per
document, its token count (EOS included): the document boundaries that packing by documents
(``data.packing: documents``) keeps. Version 1 manifests (no ``format``, masks or document
lengths) still load: a text corpus, every token trained, packable only as windows.

Documents are concatenated in input order: a text document followed by the tokenizer's
end-of-text token, a prompt-completion document with the EOS after its completion, a chat document
exactly as its template renders it (each turn ends with the template's end-of-turn tokens; no EOS is
added); a split's token stream is its shards in order. A document goes to the validation split
when a hash of (split seed, input number, document number) falls under ``validation_fraction``, so
the split never depends on how the work was parallelised.

Training samples are packed one of two ways (``data.packing``, ``Packing``):

- ``windows``: windows of ``seq_len + 1`` tokens that start every ``seq_len`` tokens of the train
  stream (inputs ``[:-1]``, labels ``[1:]``: every token but the first is a label exactly once
  per epoch, when its mask says it trains). Windows cross document boundaries (the EOS between
  two documents tells the model where one ends).
- ``documents``: whole documents packed into samples of at most ``seq_len`` tokens
  (``PackingPlan``); a document longer than ``seq_len`` is cut into pieces of ``seq_len`` tokens
  (the last one shorter), each piece packed like a document. The pieces go into samples by best
  fit decreasing (longest first, each into the sample with the least room that holds it), which
  leaves well under 1% padding on realistic length mixes where taking the pieces in stream order
  left about a fifth. A packed sample is a few pieces from anywhere in the stream, laid end to
  end in stream order and read piece by piece; the model restarts positions and fences
  attention at each piece, no label crosses a boundary (the last token of a piece predicts
  nothing) and the padding after the last piece trains nothing. Every piece is in exactly one
  sample. The plan depends on the document lengths and ``seq_len`` only, never on the seed or
  the mesh.

Global sample ``i`` is sample ``order(i mod W)`` of epoch ``i // W`` (``W`` windows or packed
samples), where ``order`` is a seeded permutation of the ``W``, computed per index (a Feistel
network, cycle-walked into ``[0, W)``): nothing of size ``W`` is ever held. Evaluation reads the
validation stream's samples (packed the same way) in order.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections import deque
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import numpy as np

FORMAT = "meshpilot-tokens"
VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_KEY = "manifest.json"
SPLITS = ("train", "validation")
DTYPES = {"uint16": 2, "uint32": 4}
MASK_DTYPE = "uint8"
DOCUMENT_LENGTH_DTYPE = "<u4"  # numpy spelling: little-endian uint32


class CorpusFormat(StrEnum):
    """What the documents of a corpus were: ``meshpilot data prepare --format``."""

    TEXT = "text"  # plain documents, every token trained
    CHAT = "chat"  # message lists rendered with the tokenizer's chat template; assistant turns train
    PROMPT_COMPLETION = "prompt-completion"  # a prompt then a completion + EOS; the completion trains


class Packing(StrEnum):
    """How training samples are cut from a split's stream: ``data.packing`` (see the module)."""

    WINDOWS = "windows"
    DOCUMENTS = "documents"

    @classmethod
    def default_for(cls, corpus_format: CorpusFormat) -> Packing:
        """``windows`` for text (pre-training), ``documents`` for chat and prompt-completion corpora."""
        return cls.WINDOWS if corpus_format == CorpusFormat.TEXT else cls.DOCUMENTS


class TokenCorpusError(ValueError):
    """A corpus that cannot be read as this job needs it; the message names it and the fix."""


def token_dtype(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every token id of the vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_key(split: str, number: int) -> str:
    return f"{split}/{number:05d}.bin"


def mask_key(token_shard_key: str) -> str:
    """The mask shard beside a token shard: ``train/00003.bin`` -> ``train/00003.mask``."""
    return token_shard_key.removesuffix(".bin") + ".mask"


def documents_key(split: str) -> str:
    return f"{split}/documents.bin"


@dataclass(frozen=True)
class ShardEntry:
    key: str
    tokens: int
    sha256: str
    mask_sha256: str | None = None  # of the mask shard (``mask_key(key)``); None: the corpus has no masks


@dataclass(frozen=True)
class SplitIndex:
    documents: int
    tokens: int
    shards: tuple[ShardEntry, ...]
    # Tokens whose mask is 1 (version 1 and unmasked corpora: every token).
    trained_tokens: int | None = None
    # sha256 of ``documents_key(split)``; None in version 1 manifests (no document lengths stored).
    documents_sha256: str | None = None

    @property
    def trained(self) -> int:
        return self.tokens if self.trained_tokens is None else self.trained_tokens


@dataclass(frozen=True)
class TokenizerInfo:
    sha256: str  # of the tokenizer.json the corpus was tokenized with
    vocab_size: int
    eos_token: str
    eos_id: int


@dataclass(frozen=True)
class TokenManifest:
    dtype: str
    tokenizer: TokenizerInfo
    validation_fraction: float
    split_seed: int
    splits: dict[str, SplitIndex]
    inputs: tuple[str, ...] = ()
    corpus_format: CorpusFormat = CorpusFormat.TEXT
    loss_mask: bool = False  # mask shards exist beside the token shards
    # How the records were read (version 2; empty in version 1): the fields taken from each record, in
    # order (text: the text field; chat: the messages field; prompt-completion: prompt, completion),
    # and the sha256 of the chat template rendered (chat only). A re-prepare into the same place compares them.
    fields: tuple[str, ...] = ()
    chat_template_sha256: str | None = None
    version: int = VERSION  # the version it was read as (written: always VERSION)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def has_documents(self) -> bool:
        """Whether document lengths are stored (packing by documents needs them)."""
        return all(split.documents_sha256 is not None for split in self.splits.values())

    def to_json(self) -> bytes:
        body = asdict(self)
        del body["version"]
        body["corpus_format"] = str(self.corpus_format)
        body.update(format=FORMAT, version=VERSION)
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def parse_token_manifest(data: bytes, where: str) -> TokenManifest:
    """The manifest at ``where``; ``TokenCorpusError`` naming what is wrong with it."""
    try:
        body = json.loads(data)
        if body.get("format") != FORMAT or body.get("version") not in READABLE_VERSIONS:
            raise TokenCorpusError(
                f"{where} is not a meshpilot token corpus (format {body.get('format')!r} version "
                f"{body.get('version')!r}); write one with meshpilot data prepare"
            )
        splits = {
            name: SplitIndex(
                documents=int(split["documents"]),
                tokens=int(split["tokens"]),
                shards=tuple(
                    ShardEntry(str(s["key"]), int(s["tokens"]), str(s["sha256"]), s.get("mask_sha256"))
                    for s in split["shards"]
                ),
                trained_tokens=split.get("trained_tokens"),
                documents_sha256=split.get("documents_sha256"),
            )
            for name, split in body["splits"].items()
        }
        manifest = TokenManifest(
            dtype=str(body["dtype"]),
            tokenizer=TokenizerInfo(**body["tokenizer"]),
            validation_fraction=float(body["validation_fraction"]),
            split_seed=int(body["split_seed"]),
            splits=splits,
            inputs=tuple(body.get("inputs", ())),
            corpus_format=CorpusFormat(body.get("corpus_format", CorpusFormat.TEXT)),
            loss_mask=bool(body.get("loss_mask", False)),
            fields=tuple(str(name) for name in body.get("fields", ())),
            chat_template_sha256=body.get("chat_template_sha256"),
            version=int(body["version"]),
        )
    except TokenCorpusError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise TokenCorpusError(f"{where} is not a valid token corpus manifest ({error!r}); prepare it again") from None
    if manifest.dtype not in DTYPES or set(manifest.splits) != set(SPLITS):
        raise TokenCorpusError(f"{where}: dtype {manifest.dtype!r} or splits {sorted(manifest.splits)} not understood")
    return manifest


def is_validation(split_seed: int, input_number: int, document_number: int, fraction: float) -> bool:
    """Whether a document is held out: a hash of its place in the inputs, under ``fraction``."""
    digest = hashlib.blake2b(f"{split_seed}:{input_number}:{document_number}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


# ----------------------------------------------------------------------------- windows
def window_count(tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens starting every ``seq_len`` tokens of a stream."""
    return max(0, (tokens - 1) // seq_len)


def window_tokens(window: int, seq_len: int) -> tuple[int, int]:
    """The token range [start, stop) of a window in its split's stream."""
    start = window * seq_len
    return start, start + seq_len + 1


class WindowOrder:
    """The seeded permutation of a split's windows, one per epoch, computed per index.

    A 4-round Feistel network over the smallest even number of bits that covers ``windows``,
    keyed by (seed, epoch); values outside ``[0, windows)`` are walked through the network again
    (fewer than 4 steps in expectation), so the map is a bijection of ``[0, windows)``.
    """

    ROUNDS = 4

    def __init__(self, windows: int, *, seed: int) -> None:
        if windows < 1:
            raise ValueError("a window order needs at least one window")
        self.windows = windows
        self.seed = seed
        self.half_bits = max(1, ((windows - 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half_bits) - 1

    def window(self, sample_index: int) -> int:
        """The window global sample ``sample_index`` reads."""
        epoch, position = divmod(sample_index, self.windows)
        value = position
        while True:
            value = self._permute(value, epoch)
            if value < self.windows:
                return value

    def _permute(self, value: int, epoch: int) -> int:
        left, right = value >> self.half_bits, value & self.mask
        for round_number in range(self.ROUNDS):
            key = f"{self.seed}:{epoch}:{round_number}:{right}".encode()
            mixed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & self.mask
            left, right = right, left ^ mixed
        return (left << self.half_bits) | right


@dataclass(frozen=True)
class PackingPlan:
    """A split's documents packed into samples of at most ``seq_len`` tokens (``Packing.DOCUMENTS``).

    Computed on every rank from the split's document lengths (``documents.bin``) by
    ``pack_documents``: a pure function of (lengths, seq_len). The pieces tile the stream in
    order; a sample is an ordered list of pieces, wherever they lie in the stream. Samples are
    numbered in the order of their first pieces.

    ``piece_starts`` [pieces + 1]: the stream offset of each piece (stream order), then the
    stream's end. ``sample_pieces`` [pieces]: piece numbers, sample by sample, each sample's in
    stream order. ``first_piece`` [samples + 1]: where each sample's pieces begin in
    ``sample_pieces``, then ``pieces``.
    """

    seq_len: int
    piece_starts: np.ndarray
    sample_pieces: np.ndarray
    first_piece: np.ndarray
    cut_documents: int  # documents longer than seq_len, cut into pieces

    @property
    def samples(self) -> int:
        return len(self.first_piece) - 1

    @property
    def pieces(self) -> int:
        return len(self.piece_starts) - 1

    @property
    def fill(self) -> float:
        """The share of the samples' ``samples x seq_len`` tokens that are documents, not padding."""
        return float(self.piece_starts[-1] - self.piece_starts[0]) / max(1, self.samples * self.seq_len)

    def pieces_of(self, sample: int) -> np.ndarray:
        """The piece numbers of sample ``sample``, in stream order."""
        return self.sample_pieces[self.first_piece[sample] : self.first_piece[sample + 1]]

    def piece_ranges(self, sample: int) -> list[tuple[int, int]]:
        """The token ranges [start, stop) of sample ``sample``'s pieces in its split's stream, in order."""
        pieces = self.pieces_of(sample)
        return list(zip(self.piece_starts[pieces].tolist(), self.piece_starts[pieces + 1].tolist()))

    def piece_lengths(self, sample: int) -> np.ndarray:
        """The lengths of sample ``sample``'s pieces, in order (they sum to its token count)."""
        pieces = self.pieces_of(sample)
        return self.piece_starts[pieces + 1] - self.piece_starts[pieces]


def pack_documents(lengths: np.ndarray, seq_len: int) -> PackingPlan:
    """Documents of ``lengths`` (stream order) packed into samples of <= ``seq_len`` tokens by best
    fit decreasing (``best_fit_decreasing``); a document longer than ``seq_len`` is first cut into
    ``seq_len`` pieces (the last one shorter). Pure arithmetic, on every rank."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    pieces_per_document = -(-lengths // seq_len)
    document_starts = np.cumsum(lengths) - lengths
    first_of_document = np.cumsum(pieces_per_document) - pieces_per_document
    pieces = int(pieces_per_document.sum())
    # Piece p of document d starts at its document's start + seq_len x (p's number within d).
    number_within = np.arange(pieces, dtype=np.int64) - np.repeat(first_of_document, pieces_per_document)
    piece_starts = np.append(
        np.repeat(document_starts, pieces_per_document) + seq_len * number_within, int(lengths.sum())
    )
    bins, samples = best_fit_decreasing(np.diff(piece_starts), seq_len)
    by_bin = stable_order(bins, samples)  # the pieces bin by bin, each bin's in stream order
    counts = np.bincount(bins, minlength=samples)
    bin_starts = np.cumsum(counts) - counts
    # Samples numbered by their first piece in the stream, not as their bins opened (the longest
    # pieces first): evaluation reads a split's first samples, which should look like its stream.
    bin_at_first_piece = np.full(pieces, -1, dtype=np.int64)
    bin_at_first_piece[by_bin[bin_starts]] = np.arange(samples)
    renumbered = bin_at_first_piece[bin_at_first_piece >= 0]  # the bins in the order of their first pieces
    counts = counts[renumbered]
    first_piece = np.zeros(samples + 1, dtype=np.int64)
    np.cumsum(counts, out=first_piece[1:])
    sample_pieces = by_bin[np.repeat(bin_starts[renumbered] - first_piece[:-1], counts) + np.arange(pieces)]
    return PackingPlan(
        seq_len=seq_len,
        piece_starts=piece_starts,
        sample_pieces=sample_pieces,
        first_piece=first_piece,
        cut_documents=int(np.count_nonzero(pieces_per_document > 1)),
    )


def best_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Items of ``sizes`` (each 1..capacity) put in bins of ``capacity``: (each item's bin, bins).

    Best fit decreasing: the items in order of size, largest first (ties: lower item number
    first), each into the open bin with the least room that still holds it (ties: the bin that
    came to that room first), else into a new bin. Bins are numbered as they open.

    Worked one size at a time, never one item at a time: a bin of room ``r`` that is the best
    fit for an item of size ``s`` stays the best fit (its room ``r - s`` is below every other
    room that holds ``s``) until it holds ``r // s`` of them, so the bins of each room, least
    room first, take ``r // s`` items each until the size's items run out, and new bins take
    ``capacity // s`` each. Bins of equal room queue in arrays, first come first served.
    """
    order = stable_order(capacity - sizes, capacity)  # largest first, ties by item number
    ordered = sizes[order]
    group_starts = np.flatnonzero(np.diff(ordered, prepend=-1))
    group_stops = np.append(group_starts[1:], len(ordered))
    rooms = _Rooms(capacity)
    assigned: list[np.ndarray] = []  # the bins of the items in ``order``, in runs
    for size, start, stop in zip(ordered[group_starts].tolist(), group_starts.tolist(), group_stops.tolist()):
        left = rooms.fill_open(size, stop - start, assigned)
        if left:
            rooms.open(size, left, assigned)
    bins = np.empty(len(sizes), dtype=np.int64)
    bins[order] = np.concatenate(assigned) if assigned else np.empty(0, dtype=np.int64)
    return bins, rooms.bins


def stable_order(keys: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for integer keys in [0, bound), by 16-bit radix passes:
    numpy sorts 16-bit keys by counting (a few times faster than its merge sort of wider ones)."""
    keys = np.asarray(keys, dtype=np.int64)
    order = np.arange(len(keys), dtype=np.int64)
    shift = 0
    while shift == 0 or bound > 1 << shift:  # least significant 16 bits first
        digits = ((keys[order] >> shift) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(digits, kind="stable")]
        shift += 16
    return order


class _Rooms:
    """The open bins of ``best_fit_decreasing`` by room left: a queue of bin-number arrays per room
    that some bin has, and those rooms in a sorted list (work per size grows with the rooms it
    touches, not with ``capacity``). Full bins are forgotten: nothing fits in them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rooms: list[int] = []  # the rooms some open bin has, ascending
        self.queues: dict[int, deque[np.ndarray]] = {}
        self.count: dict[int, int] = {}  # open bins per room
        self.bins = 0

    def fill_open(self, size: int, items: int, assigned: list[np.ndarray]) -> int:
        """Put up to ``items`` items of ``size`` in the open bins, best fit first; the items left."""
        moved: list[tuple[int, np.ndarray]] = []  # bins to requeue, all below ``size``: after the walk
        index = bisect.bisect_left(self.rooms, size)  # the least room that holds one
        while items and index < len(self.rooms):
            room = self.rooms[index]
            per_bin = room // size
            full_bins = min(self.count[room], items // per_bin)
            if full_bins:
                taken = self._take(room, full_bins)
                assigned.append(np.repeat(taken, per_bin))
                moved.append((room - per_bin * size, taken))
                items -= full_bins * per_bin
            if 0 < items < per_bin and self.count[room]:  # the last items, in one more bin
                taken = self._take(room, 1)
                assigned.append(np.repeat(taken, items))
                moved.append((room - items * size, taken))
                items = 0
            if self.count[room]:
                index += 1
            else:
                del self.rooms[index], self.queues[room], self.count[room]
        for room, bins in moved:
            self._put(room, bins)
        return items

    def open(self, size: int, items: int, assigned: list[np.ndarray]) -> None:
        """Put ``items`` items of ``size`` in new bins, ``capacity // size`` each (the last maybe fewer)."""
        per_bin = self.capacity // size
        full_bins, rest = divmod(items, per_bin)
        opened = np.arange(self.bins, self.bins + full_bins + (rest > 0), dtype=np.int64)
        self.bins += len(opened)
        assigned.append(np.repeat(opened, per_bin)[:items])
        if full_bins:
            self._put(self.capacity - per_bin * size, opened[:full_bins])
        if rest:
            self._put(self.capacity - rest * size, opened[full_bins:])

    def _take(self, room: int, bins: int) -> np.ndarray:
        """The first ``bins`` bins queued at ``room``."""
        queue, taken = self.queues[room], []
        self.count[room] -= bins
        while bins:
            head = queue[0]
            if len(head) <= bins:
                taken.append(queue.popleft())
                bins -= len(head)
            else:
                taken.append(head[:bins])
                queue[0] = head[bins:]
                bins = 0
        return taken[0] if len(taken) == 1 else np.concatenate(taken)

    def _put(self, room: int, bins: np.ndarray) -> None:
        if room == 0:
            return
        if room not in self.queues:
            bisect.insort(self.rooms, room)
            self.queues[room], self.count[room] = deque(), 0
        self.queues[room].append(bins)
        self.count[room] += len(bins)


def shard_ranges(
    shards: tuple[ShardEntry, ...], start: int, stop: int, itemsize: int, ends: np.ndarray | None = None
) -> list[tuple[str, int, int]]:
    """The byte ranges (key, begin, end) that hold tokens [start, stop) of a split's stream.

    ``ends``: the shards' ``shard_ends``, to find the first shard by bisection rather than by
    walking from the first one (a packed sample reads several ranges of a long stream)."""
    ranges = []
    skipped = 0 if ends is None else int(np.searchsorted(ends, start, side="right"))
    offset = 0 if skipped == 0 or ends is None else int(ends[skipped - 1])
    for shard in shards[skipped:]:
        first, last = max(start, offset), min(stop, offset + shard.tokens)
        if first < last:
            ranges.append((shard.key, (first - offset) * itemsize, (last - offset) * itemsize))
        offset += shard.tokens
        if offset >= stop:
            break
    return ranges


def shard_ends(shards: tuple[ShardEntry, ...]) -> np.ndarray:
    """Where each shard ends in its split's stream: the running sum of their token counts."""
    return np.cumsum([shard.tokens for shard in shards], dtype=np.int64)


def describe(manifest: TokenManifest) -> dict[str, Any]:
    """A short summary for logs and events."""
    return {
        "dtype": manifest.dtype,
        "vocab_size": manifest.tokenizer.vocab_size,
        "train_tokens": manifest.splits["train"].tokens,
        "validation_tokens": manifest.splits["validation"].tokens,
        "trained_tokens": manifest.splits["train"].trained,
        "documents": sum(split.documents for split in manifest.splits.values()),
        "format": str(manifest.corpus_format),
        "loss_mask": manifest.loss_mask,
    }
