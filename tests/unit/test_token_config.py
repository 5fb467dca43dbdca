"""``data.source: tokens`` checked on the driver before any worker starts: one sentence per problem
naming the key and the fix, exit 2; the driver reads the manifest, never the corpus."""

from __future__ import annotations

import numpy as np
import pytest

from checkpointing.storage import open_storage
from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.driver.train_spec import data_bytes, train_spec
from tests.jobs import DEMO_CONFIG, REPO
from tests.token_corpus import TOKENIZER_JSON, documents, small_corpus, write_corpus


@pytest.fixture
def corpus_dir(tmp_path):
    directory = tmp_path / "corpus"
    small_corpus(open_storage(str(directory)))
    return directory


def train_exit(capsys, *overrides: str) -> tuple[int, str]:
    code = main(["train", str(DEMO_CONFIG), "--set", "data.source=tokens", *[f"--set={o}" for o in overrides]])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_tokens_without_a_uri(capsys):
    code, err = train_exit(capsys)
    assert code == 2
    assert "data.source=tokens needs data.uri: the directory or s3:// prefix of a corpus written by meshpilot " in err


def test_a_directory_without_a_manifest(tmp_path, capsys):
    code, err = train_exit(capsys, f"data.uri={tmp_path}")
    assert code == 2
    assert (
        f"data.uri='{tmp_path}': no token corpus there (manifest.json is missing); prepare it with "
        f"meshpilot data prepare --input FILES --tokenizer tokenizer.json --out {tmp_path}"
    ) in err


def test_an_s3_prefix_without_a_manifest(s3_bucket, capsys):
    code, err = train_exit(capsys, f"data.uri={s3_bucket.uri}", f"checkpoint.endpoint_url={s3_bucket.endpoint_url}")
    assert code == 2
    assert f"data.uri='{s3_bucket.uri}': no token corpus there (manifest.json is missing)" in err


def test_an_unsupported_scheme(capsys):
    code, err = train_exit(capsys, "data.uri=gs://bucket/corpus")
    assert code == 2
    assert "data.uri='gs://bucket/corpus': scheme 'gs' is not supported; use s3://, file:// or a directory" in err


def test_a_tokenizer_vocabulary_larger_than_the_model(tmp_path, capsys):
    write_corpus(
        open_storage(str(tmp_path)),
        train=documents(20, vocab_size=300, seed=0),
        validation=documents(2, vocab_size=300, seed=1),
        vocab_size=300,
    )
    code, err = train_exit(capsys, f"data.uri={tmp_path}")
    assert code == 2
    assert (
        f"model.vocab_size=256 is smaller than the vocabulary of the tokenizer the corpus at data.uri='{tmp_path}' "
        "was prepared with (300 tokens); set model.vocab_size to at least 300"
    ) in err


def test_a_sequence_longer_than_the_corpus(tmp_path, capsys):
    write_corpus(open_storage(str(tmp_path)), train=np.arange(1, 101), validation=np.arange(1, 11))
    code, err = train_exit(capsys, f"data.uri={tmp_path}", "training.seq_len=128")
    assert code == 2
    assert (
        f"training.seq_len=128 is longer than the corpus at data.uri='{tmp_path}': its train split holds 100 tokens, "
        "and one sample takes seq_len + 1 = 129; lower training.seq_len or prepare more documents"
    ) in err


def test_a_corpus_from_another_tokenizer(corpus_dir, tmp_path, capsys):
    other = tmp_path / "other-tokenizer.json"
    other.write_bytes(b'{"model": {"type": "BPE"}}')
    code, err = train_exit(capsys, f"data.uri={corpus_dir}", f"data.tokenizer={other}")
    assert code == 2
    assert f"data.uri='{corpus_dir}' is a corpus from another tokenizer than the configured one" in err
    assert f"data.tokenizer='{other}' has sha256" in err and "prepare the corpus again with" in err


def test_a_missing_tokenizer_file(corpus_dir, capsys):
    code, err = train_exit(capsys, f"data.uri={corpus_dir}", "data.tokenizer=no/such/tokenizer.json")
    assert code == 2
    assert "data.tokenizer='no/such/tokenizer.json': no such file; give the tokenizer.json the corpus was" in err


def test_a_good_corpus_is_sent_to_the_ranks_by_location_only(corpus_dir, tmp_path, monkeypatch):
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes(TOKENIZER_JSON)
    monkeypatch.chdir(corpus_dir.parent)  # a relative data.uri is made absolute for the ranks
    overrides = ["data.source=tokens", "data.uri=corpus", f"data.tokenizer={tokenizer}", "data.record_samples=true"]
    config = load_config(DEMO_CONFIG, overrides)
    spec = train_spec(config)
    assert spec.data_source == "tokens" and spec.record_samples
    assert spec.tokens is not None and spec.tokens.uri == str(corpus_dir)
    assert data_bytes(config) is None  # the driver ships no data


def test_the_config_hash_names_the_corpus_not_the_ledger(corpus_dir, tmp_path):
    other = tmp_path / "other"
    small_corpus(open_storage(str(other)), seed=7)
    runs = ((corpus_dir, "false"), (corpus_dir, "true"), (other, "false"))
    hashes = {
        load_config(DEMO_CONFIG, ["data.source=tokens", f"data.uri={uri}", f"data.record_samples={r}"]).config_hash()
        for uri, r in runs
    }
    assert len(hashes) == 2  # another corpus resumes nobody's checkpoint; recording samples changes nothing
