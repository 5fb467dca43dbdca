"""``meshpilot data prepare`` as a user runs it: real Ray Data on the session cluster, real S3 (auth on).

    python -m pytest tests/integration/test_data_prepare.py -q

A ~3 MB ``.jsonl`` and a ``.parquet`` file (unicode text) are tokenized with a BPE tokenizer
trained here; every shard read back must equal ``tokenizer.encode(doc).ids + [eos]`` of each
document, in input order, per split. Mistakes in the input exit 2 with one line and leave nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from checkpointing.storage import open_storage
from orchestrator.cli import main
from orchestrator.data_prep import pipeline
from orchestrator.data_prep.pipeline import PrepareRequest, prepare_corpus
from tests.jobs import losses, single_rank, train
from workers.spec.tokens import (
    DOCUMENT_LENGTH_DTYPE,
    MANIFEST_KEY,
    SPLITS,
    CorpusFormat,
    SplitIndex,
    TokenizerInfo,
    TokenManifest,
    documents_key,
    is_validation,
    parse_token_manifest,
)

WORDS = (
    "the of and a to in is was for on data shard token mesh ray train naïve café résumé über straße "
    "東京 大阪 データ 🚀 🧪 Ωmega λ-calculus Zürich Ærø ñandú год мир"
).split()
FRACTION = 0.1
SHARD_MB = 0.25  # ~130k uint16 tokens: several shards per run
JSONL_DOCUMENTS = 6000
PARQUET_DOCUMENTS = 2000


@dataclass(frozen=True)
class Corpus:
    jsonl: Path
    parquet: Path
    tokenizer_dir: Path
    documents: tuple[list[str], list[str]]  # per input, in order

    def args(self, out: str, *extra: str) -> list[str]:
        return [
            "data",
            "prepare",
            "--input",
            str(self.jsonl),
            str(self.parquet),
            "--tokenizer",
            str(self.tokenizer_dir),
            "--out",
            out,
            "--validation-fraction",
            str(FRACTION),
            "--shard-mb",
            str(SHARD_MB),
            "--chunk-mb",
            "1",
            "--plain",
            *extra,
        ]


def _document(rng: random.Random) -> str:
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(rng.randint(1, 8))]
    return "\n".join(lines) + rng.choice(["", ".", "!\n", f" #{rng.randint(0, 10**6)}"])


def train_tokenizer(texts: list[str], special_tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(7)
    first = [_document(rng) for _ in range(JSONL_DOCUMENTS)]
    first[10] = ""  # an empty document is still a document: its EOS alone
    second = [_document(rng) for _ in range(PARQUET_DOCUMENTS)]
    with open(root / "web.jsonl", "w", encoding="utf-8") as handle:
        for number, text in enumerate(first):
            handle.write(json.dumps({"id": number, "text": text}, ensure_ascii=number % 2 == 0) + "\n")
            if number == 100:
                handle.write("\n")  # a blank line is no document
    pq.write_table(pa.table({"id": range(len(second)), "text": second}), root / "books.parquet", row_group_size=250)
    tokenizer_dir = root / "tokenizer"
    tokenizer_dir.mkdir()
    train_tokenizer(first[:3000], ["<eos>", "<pad>"]).save(str(tokenizer_dir / "tokenizer.json"))
    return Corpus(root / "web.jsonl", root / "books.parquet", tokenizer_dir, (first, second))


def expected_streams(corpus: Corpus, *, fraction: float = FRACTION, seed: int = 0) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(corpus.tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("<eos>")
    assert eos is not None
    streams: dict[str, list[int]] = {split: [] for split in SPLITS}
    for number, documents in enumerate(corpus.documents):
        for document, text in enumerate(documents):
            split = "validation" if is_validation(seed, number, document, fraction) else "train"
            streams[split] += tokenizer.encode(text).ids + [eos]
    return {split: np.asarray(tokens, dtype=np.uint16) for split, tokens in streams.items()}


def read_corpus(uri: str, endpoint_url: str | None = None) -> tuple[TokenManifest, dict[str, np.ndarray]]:
    """The manifest and each split's token stream, every shard checked against its manifest entry."""
    storage = open_storage(uri, endpoint_url=endpoint_url)
    manifest = parse_token_manifest(storage.get(MANIFEST_KEY), uri)
    streams = {}
    for split in SPLITS:
        pieces = []
        for shard in manifest.splits[split].shards:
            data = storage.get(shard.key)
            assert hashlib.sha256(data).hexdigest() == shard.sha256 and len(data) == shard.tokens * manifest.itemsize
            pieces.append(np.frombuffer(data, dtype="<u2"))
        streams[split] = np.concatenate(pieces) if pieces else np.zeros(0, dtype="<u2")
        assert len(streams[split]) == manifest.splits[split].tokens
    return manifest, streams


def files_under(directory: Path) -> dict[str, bytes]:
    return {
        path.relative_to(directory).as_posix(): path.read_bytes() for path in directory.rglob("*") if path.is_file()
    }


def test_local_corpus_holds_every_document_in_order_and_reruns_identically(ray_cluster, corpus, tmp_path, capsys):
    out = tmp_path / "tokens"
    assert main(corpus.args(str(out))) == 0
    printed = capsys.readouterr().out
    assert f"prepared: {out}  8,000 documents" in printed and "documents/s" in printed and "tokens/s" in printed

    manifest, streams = read_corpus(str(out))
    expected = expected_streams(corpus)
    for split in SPLITS:
        np.testing.assert_array_equal(streams[split], expected[split])
    assert manifest.splits["train"].documents + manifest.splits["validation"].documents == 8000
    # Version 2 for text too: no masks, every token trained, each document's length (EOS included) stored.
    assert manifest.corpus_format == CorpusFormat.TEXT and not manifest.loss_mask and manifest.fields == ("text",)
    for split in SPLITS:
        index = manifest.splits[split]
        assert index.trained_tokens == index.tokens and all(shard.mask_sha256 is None for shard in index.shards)
        lengths = np.frombuffer((out / documents_key(split)).read_bytes(), dtype=DOCUMENT_LENGTH_DTYPE)
        assert len(lengths) == index.documents and int(lengths.sum()) == index.tokens
    assert not list(out.rglob("*.mask"))
    assert 0.05 < manifest.splits["validation"].documents / 8000 < 0.15  # held out by document, ~10%
    tokenizer_bytes = (corpus.tokenizer_dir / "tokenizer.json").read_bytes()
    assert manifest.tokenizer == TokenizerInfo(
        sha256=hashlib.sha256(tokenizer_bytes).hexdigest(),
        vocab_size=manifest.tokenizer.vocab_size,
        eos_token="<eos>",
        eos_id=0,
    )
    assert manifest.dtype == "uint16" and manifest.inputs == (str(corpus.jsonl), str(corpus.parquet))
    shard_tokens = int(SHARD_MB * 2**20) // 2
    train_shards = manifest.splits["train"].shards
    assert len(train_shards) >= 3 and all(shard.tokens == shard_tokens for shard in train_shards[:-1])

    # The same command again: the same bytes, nothing rewritten.
    before = files_under(out)
    stamps = {path: path.stat().st_mtime_ns for path in out.rglob("*.bin")}
    assert main(corpus.args(str(out))) == 0
    assert "already prepared (identical, nothing rewritten)" in capsys.readouterr().out
    assert files_under(out) == before
    assert {path: path.stat().st_mtime_ns for path in out.rglob("*.bin")} == stamps

    # A committed shard lost: the next run writes it again, the same bytes, and keeps the manifest.
    (out / train_shards[1].key).unlink()
    assert main(corpus.args(str(out))) == 0
    assert "1 missing shard(s) written again" in capsys.readouterr().out
    assert files_under(out) == before

    # Other chunking and parallelism: byte for byte the same corpus.
    other = tmp_path / "tokens-small-chunks"
    request = PrepareRequest(
        inputs=(str(corpus.jsonl), str(corpus.parquet)),
        tokenizer=str(corpus.tokenizer_dir),
        out=str(other),
        validation_fraction=FRACTION,
        shard_mb=SHARD_MB,
        workers=2,
        chunk_bytes=96 << 10,
    )
    assert prepare_corpus(request).committed
    assert files_under(other) == before


def test_s3_inputs_and_corpus(ray_cluster, s3_bucket, corpus):
    storage = open_storage(f"s3://{s3_bucket.name}", endpoint_url=s3_bucket.endpoint_url)
    storage.put_bytes("raw/web.jsonl", corpus.jsonl.read_bytes())
    storage.put_bytes("raw/books.parquet", corpus.parquet.read_bytes())
    storage.put_bytes("raw/skip/other.jsonl", b'{"text": "one level down: not matched by raw/*.jsonl"}\n')
    storage.put_bytes("tok/tokenizer.json", (corpus.tokenizer_dir / "tokenizer.json").read_bytes())
    out = f"s3://{s3_bucket.name}/tokens"
    args = with_flag(
        corpus.args(out, "--endpoint-url", s3_bucket.endpoint_url), "--tokenizer", f"s3://{s3_bucket.name}/tok"
    )
    args = with_flag(args, "--input", f"s3://{s3_bucket.name}/raw/*.jsonl", f"s3://{s3_bucket.name}/raw/*.parquet")
    assert main(args) == 0

    manifest, streams = read_corpus(out, s3_bucket.endpoint_url)
    expected = expected_streams(corpus)
    for split in SPLITS:
        np.testing.assert_array_equal(streams[split], expected[split])
    assert manifest.inputs == (f"s3://{s3_bucket.name}/raw/web.jsonl", f"s3://{s3_bucket.name}/raw/books.parquet")

    # ... and a job trains on it, from S3, evaluating on the held-out documents as it goes.
    result, events = train(
        corpus.tokenizer_dir.parent / "run",
        "data.source=tokens",
        f"data.uri={out}",
        f"data.tokenizer={corpus.tokenizer_dir / 'tokenizer.json'}",
        f"checkpoint.endpoint_url={s3_bucket.endpoint_url}",
        "model.vocab_size=1024",
        "training.steps=12",
        "eval.interval_steps=6",
        "eval.batches=1",
        *single_rank("parallelism.dp_shard=2", "parallelism.microbatches=2"),
    )
    assert result.exit_code == 0, result.reason
    step_losses = losses(events)
    evals = {e["step"]: e["loss"] for e in events if e["event"] == "eval"}
    assert sorted(step_losses) == list(range(1, 13)) and sorted(evals) == [6, 12]
    assert step_losses[12] < step_losses[1] - 0.5 and evals[12] < evals[6]


def test_a_run_interrupted_before_its_manifest_leaves_no_corpus(ray_cluster, corpus, tmp_path, monkeypatch):
    out = tmp_path / "tokens"
    request = PrepareRequest(
        inputs=(str(corpus.jsonl),), tokenizer=str(corpus.tokenizer_dir), out=str(out), shard_mb=SHARD_MB
    )

    def fail_after_the_shards(storage, manifest):
        assert all(storage.exists(shard.key) for split in manifest.splits.values() for shard in split.shards)
        raise RuntimeError("injected: the driver died before the commit")

    monkeypatch.setattr(pipeline, "commit_manifest", fail_after_the_shards)
    with pytest.raises(RuntimeError, match="injected"):
        prepare_corpus(request)
    assert files_under(out) == {}

    # What a killed run leaves (a shard too many) is overwritten or removed by the next complete run.
    monkeypatch.undo()
    (out / "train").mkdir(parents=True)
    (out / "train" / "00000.bin").write_bytes(b"left by a killed run")
    (out / "train" / "00099.bin").write_bytes(b"left by a killed run")
    assert prepare_corpus(request).committed
    manifest, _ = read_corpus(str(out))
    listed = {shard.key for split in manifest.splits.values() for shard in split.shards}
    assert set(files_under(out)) == listed | {MANIFEST_KEY, *map(documents_key, SPLITS)}


# ----------------------------------------------------------------------------- mistakes
def cli_error(capsys, args: list[str]) -> str:
    """The one error line of a run that must exit 2 without a traceback."""
    code = main(args)
    captured = capsys.readouterr()
    assert code == 2, captured
    assert "Traceback" not in captured.out + captured.err
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("meshpilot: ")
    return last


def with_flag(args: list[str], flag: str, *values: str) -> list[str]:
    """``args`` with ``flag``'s values replaced (the flag added when absent)."""
    if flag not in args:
        return [*args, flag, *values]
    start = end = args.index(flag)
    while end + 1 < len(args) and not args[end + 1].startswith("--"):
        end += 1
    return [*args[:start], flag, *values, *args[end + 1 :]]


def _bad_tokenizer(root: Path, corpus: Corpus) -> tuple[str, str]:
    (root / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')
    return "--tokenizer", str(root / "tokenizer.json")


def _tokenizer_without_eos(root: Path, corpus: Corpus) -> tuple[str, str]:
    train_tokenizer(corpus.documents[0][:200], ["<pad>"]).save(str(root / "tokenizer.json"))
    return "--tokenizer", str(root / "tokenizer.json")


def _empty_input(root: Path, corpus: Corpus) -> tuple[str, str]:
    (root / "empty.jsonl").write_bytes(b"")
    return "--input", str(root / "empty.jsonl")


BEFORE_ANY_WORK = {  # case: (flag and value to use, what the error says)
    "missing input": (lambda root, corpus: ("--input", str(root / "nowhere.jsonl")), "nowhere.jsonl: no such file"),
    "empty glob": (lambda root, corpus: ("--input", str(root / "*.txt")), "matches no file"),
    "empty input": (_empty_input, "empty.jsonl is empty (0 bytes); remove it from --input"),
    "missing parquet column": (lambda root, corpus: ("--text-field", "body"), "has no column 'body'"),
    "tokenizer that does not load": (_bad_tokenizer, "does not load as a Hugging Face tokenizers file"),
    "no eos token": (_tokenizer_without_eos, "names no single end-of-text token"),
    "eos token not in the vocabulary": (lambda root, corpus: ("--eos-token", "<end>"), "'<end>' is not a token"),
}


@pytest.mark.parametrize("case", sorted(BEFORE_ANY_WORK))
def test_mistakes_found_before_any_work(case, corpus, tmp_path, capsys):
    make, expected = BEFORE_ANY_WORK[case]
    message = cli_error(capsys, with_flag(corpus.args(str(tmp_path / "tokens")), *make(tmp_path, corpus)))
    assert expected in message
    assert not (tmp_path / "tokens").exists()


def test_an_out_bucket_that_does_not_exist_is_named(s3_bucket, corpus, capsys):
    args = corpus.args("s3://no-such-bucket-here/tokens", "--endpoint-url", s3_bucket.endpoint_url)
    message = cli_error(capsys, args)
    assert message.startswith("meshpilot: --out: bucket 'no-such-bucket-here' does not exist")
    assert s3_bucket.server.secret_key not in message


def test_a_committed_corpus_of_other_inputs_is_refused(corpus, tmp_path, capsys):
    out = tmp_path / "tokens"
    out.mkdir()
    other = TokenManifest(
        dtype="uint16",
        tokenizer=TokenizerInfo(sha256="0" * 64, vocab_size=1000, eos_token="<eos>", eos_id=0),
        validation_fraction=FRACTION,
        split_seed=0,
        splits={split: SplitIndex(documents=0, tokens=0, shards=()) for split in SPLITS},
        inputs=("/elsewhere/old.jsonl",),
        fields=("text",),
    )
    (out / MANIFEST_KEY).write_bytes(other.to_json())
    message = cli_error(capsys, corpus.args(str(out)))
    assert "already holds a token corpus prepared with other settings (tokenizer, inputs differ)" in message
    assert "give another --out" in message
    assert files_under(out) == {MANIFEST_KEY: other.to_json()}


def _bad_json_late(root: Path) -> tuple[str, str]:
    lines = [json.dumps({"text": f"good document {n} " * 20}) for n in range(3000)]
    lines[2502] = '{"text": "an unfinished line'
    (root / "late.jsonl").write_text("\n".join(lines) + "\n")
    return str(root / "late.jsonl"), "late.jsonl line 2503 is not JSON"


def _missing_field(root: Path) -> tuple[str, str]:
    (root / "fields.jsonl").write_text('{"text": "one"}\n\n{"body": "three"}\n')
    return str(root / "fields.jsonl"), "fields.jsonl line 3 has no field 'text' (its fields: 'body')"


def _not_utf8(root: Path) -> tuple[str, str]:
    (root / "notes.txt").write_bytes("caf\u00e9 ".encode() * 50 + b"\xff\xfe latin-1 bytes")
    return str(root / "notes.txt"), "notes.txt is not valid UTF-8 (byte 0xff at byte 300); re-encode the file as UTF-8"


def _blank_lines_only(root: Path) -> tuple[str, str]:
    (root / "blank.jsonl").write_text("\n  \n\n")
    return str(root / "blank.jsonl"), "blank.jsonl holds no documents"


WHILE_READING = {
    "bad json after shards were written": _bad_json_late,
    "jsonl line without the field": _missing_field,
    "non-utf-8 text file": _not_utf8,
    "only blank lines": _blank_lines_only,
}


@pytest.mark.parametrize("case", sorted(WHILE_READING))
def test_mistakes_found_while_reading_leave_nothing(case, ray_cluster, corpus, tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="meshpilot")
    path, expected = WHILE_READING[case](tmp_path)
    out = tmp_path / "tokens"
    args = with_flag(corpus.args(str(out)), "--input", str(corpus.parquet), path)
    args = with_flag(with_flag(args, "--shard-mb", "0.02"), "--chunk-mb", "0.05")
    message = cli_error(capsys, args)
    assert expected in message
    assert files_under(out) == {}
    if case == "bad json after shards were written":
        assert "piece(s) of the failed run" in caplog.text  # written, then taken back
