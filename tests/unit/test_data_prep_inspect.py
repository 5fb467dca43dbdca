"""Masked corpora on disk and ``meshpilot data inspect``: mask shards cut like token shards, one document read back.

    python -m pytest tests/unit/test_data_prep_inspect.py -q

No Ray: a chat corpus is written by the stages the prepare pipeline runs in its tasks (pieces, then
shards of a few tokens assembled from them, so documents straddle shards), then read back one
document at a time by byte ranges.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from checkpointing.storage import open_storage
from orchestrator.cli import main
from orchestrator.data_prep.chat import encode_conversation
from orchestrator.data_prep.inspect_corpus import open_corpus, read_document
from orchestrator.data_prep.pieces import Stored, assemble_shards, write_pieces
from orchestrator.data_prep.tokenize import load_chat_template
from orchestrator.data_prep.writing import ShardOutcome, SplitPlan, commit_manifest, split_index, store_document_lengths
from tests.chat_tokenizers import TEXTS, ChatTokenizer, llama3_tokenizer
from workers.spec.tokens import (
    DOCUMENT_LENGTH_DTYPE,
    SPLITS,
    CorpusFormat,
    TokenizerInfo,
    TokenManifest,
    documents_key,
    mask_key,
)

SHARD_TOKENS = 7
CONVERSATIONS = [
    [{"role": "user", "content": TEXTS[1]}, {"role": "assistant", "content": "Paris."}],
    [
        {"role": "system", "content": TEXTS[0]},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Add two numbers."},
        {"role": "assistant", "content": TEXTS[3].strip()},
    ],
    [{"role": "user", "content": TEXTS[2]}],
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[ChatTokenizer, Path, list[tuple[list[int], list[int]]]]:
    root = tmp_path_factory.mktemp("inspect")
    tokenizer = llama3_tokenizer(root / "llama3")
    template = load_chat_template(str(tokenizer.directory), endpoint_url=None, region=None)
    documents = []
    for messages in CONVERSATIONS:
        ids, mask = encode_conversation(tokenizer.tokenizer, template, messages, masked=True)
        assert mask is not None
        documents.append((ids, mask))
    out = str(root / "corpus")
    batch: dict[str, np.ndarray] = {
        "input": np.zeros(len(documents), np.int32),
        "offset": np.arange(len(documents)),
        "span": np.ones(len(documents), np.int64),
        "error": _objects([""] * len(documents)),
        "tokens": _objects([np.asarray(ids, "<u2").tobytes() for ids, _ in documents]),
        "mask": _objects([np.asarray(mask, np.uint8).tobytes() for _, mask in documents]),
    }
    where: dict[str, Any] = {"out_root": out, "itemsize": 2, "masked": True, "endpoint_url": None, "region": None}
    placed = write_pieces(batch, run="test", **where)
    plans = {split: SplitPlan(split, SHARD_TOKENS) for split in SPLITS}
    for row in range(len(documents)):
        piece, position, length, trained = (placed[name][row] for name in ("piece", "position", "length", "trained"))
        plans["train"].append(str(piece), int(position), int(length), int(trained))
    rows = [shard.to_row(None, {}) for shard in plans["train"].finish()]
    stored = assemble_shards({name: _objects([row[name] for row in rows]) for name in rows[0]}, **where)
    outcomes = {
        key: ShardOutcome(sha256, mask_sha256, Stored(outcome))
        for key, sha256, mask_sha256, outcome in zip(
            *(stored[name] for name in ("key", "sha256", "mask_sha256", "stored"))
        )
    }
    storage = open_storage(out)
    splits = {
        split: split_index(plan, outcomes, store_document_lengths(storage, plan, None, {})[0], masked=True)
        for split, plan in plans.items()
    }
    storage.delete([info.key for info in storage.list(".pieces/")])
    data = (tokenizer.directory / "tokenizer.json").read_bytes()
    info = TokenizerInfo(hashlib.sha256(data).hexdigest(), tokenizer.tokenizer.get_vocab_size(), "<|end_of_text|>", 1)
    draft = TokenManifest(
        dtype="uint16",
        tokenizer=info,
        validation_fraction=0.0,
        split_seed=0,
        splits=splits,
        corpus_format=CorpusFormat.CHAT,
        loss_mask=True,
        fields=("messages",),
        chat_template_sha256=template.sha256,
    )
    assert commit_manifest(storage, draft)
    return tokenizer, root / "corpus", documents


def test_mask_shards_are_cut_like_token_shards_with_lengths_and_trained_counts(corpus):
    _, out, documents = corpus
    _, manifest = open_corpus(str(out), endpoint_url=None, region=None)
    train = manifest.splits["train"]
    all_ids = [token for ids, _ in documents for token in ids]
    all_mask = [bit for _, mask in documents for bit in mask]
    assert train.tokens == len(all_ids) and train.trained_tokens == sum(all_mask) and train.documents == 3
    assert [shard.tokens for shard in train.shards[:-1]] == [SHARD_TOKENS] * (len(train.shards) - 1)
    tokens = b"".join((out / shard.key).read_bytes() for shard in train.shards)
    masks = b"".join((out / mask_key(shard.key)).read_bytes() for shard in train.shards)
    assert np.frombuffer(tokens, "<u2").tolist() == all_ids and list(masks) == all_mask
    lengths = np.frombuffer((out / documents_key("train")).read_bytes(), DOCUMENT_LENGTH_DTYPE).tolist()
    assert lengths == [len(ids) for ids, _ in documents]
    assert (out / documents_key("validation")).read_bytes() == b"" and manifest.splits["validation"].documents == 0


def _objects(values: list) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


class RecordingStorage:
    """A storage that records what is read, to show a document costs only its byte ranges."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.whole: list[str] = []
        self.ranged = 0

    def get(self, key: str) -> bytes:
        self.whole.append(key)
        return self.inner.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        self.ranged += end - start
        return self.inner.get_range(key, start, end)


def test_a_document_is_read_back_by_byte_ranges_only(corpus):
    _, out, documents = corpus
    storage, manifest = open_corpus(str(out), endpoint_url=None, region=None)
    for number, (ids, mask) in enumerate(documents):
        recording = RecordingStorage(storage)
        document = read_document(recording, manifest, "train", number)
        assert (list(document.tokens), list(document.loss_mask)) == (ids, mask)
        assert recording.whole == [] and recording.ranged == 4 * (number + 1) + 3 * len(ids)


def test_inspect_marks_the_untrained_spans(corpus, capsys):
    tokenizer, out, documents = corpus
    assert main(["data", "inspect", str(out), "--document", "1", "--tokenizer", str(tokenizer.directory)]) == 0
    printed = capsys.readouterr().out
    assert "format chat, loss mask stored, version 2" in printed
    ids, mask = documents[1]
    assert f"train document 1: {len(ids)} tokens from token {len(documents[0][0])}, {sum(mask)} trained" in printed
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    expected = (
        "[[<|begin_of_text|>" + header.format("system") + TEXTS[0] + "<|eot_id|>" + header.format("user") + "Hi!"
        "<|eot_id|>" + header.format("assistant") + "]]Hello.<|eot_id|>[[" + header.format("user") + "Add two numbers."
        "<|eot_id|>" + header.format("assistant") + "]]" + TEXTS[3].strip() + "<|eot_id|>"
    )
    assert printed.endswith(expected + "\n")


def test_inspect_without_a_tokenizer_shows_marked_ids_and_json_gives_the_arrays(corpus, capsys):
    _, out, documents = corpus
    ids, mask = documents[0]
    assert main(["data", "inspect", str(out)]) == 0
    untrained = " ".join(map(str, ids[: mask.index(1)]))
    assert capsys.readouterr().out.rstrip().endswith(f"[[{untrained}]] " + " ".join(map(str, ids[mask.index(1) :])))
    assert main(["data", "inspect", str(out), "--json", "--document", "0"]) == 0
    assert json.loads(capsys.readouterr().out) == {"tokens": ids, "loss_mask": mask}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--document", "3"], "meshpilot: --document 3: the train split holds 3 documents (0 to 2)"),
        (["--split", "validation"], "meshpilot: --document 0: the validation split holds 0 documents (none)"),
        (["--tokenizer", "OTHER"], "is not the tokenizer this corpus was prepared with (sha256 "),
    ],
)
def test_inspect_mistakes(corpus, tmp_path, capsys, args, expected):
    _, out, _ = corpus
    if "OTHER" in args:
        other = llama3_tokenizer(tmp_path / "other")
        (other.directory / "tokenizer.json").write_text(
            (other.directory / "tokenizer.json").read_text().replace('"<|eot_id|>"', '"<|eot|>"')
        )
        args = ["--tokenizer", str(other.directory)]
    assert main(["data", "inspect", str(out), *args]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(expected) if "sha256" not in expected else expected in last


def test_inspect_of_a_place_without_a_corpus(tmp_path, capsys):
    assert main(["data", "inspect", str(tmp_path)]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"{tmp_path} holds no token corpus (no manifest.json); give an --out of meshpilot data prepare")
    )
