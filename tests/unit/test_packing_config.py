"""``data.packing`` on the driver: its default follows the corpus format (read from the manifest
only), and a layout or corpus it cannot serve is refused before any worker starts, in one
sentence naming the key and the fix, exit 2."""

from __future__ import annotations

import json

import pytest

from checkpointing.storage import open_storage
from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.driver.train_spec import train_spec
from tests.jobs import DEMO_CONFIG, REPO
from tests.token_corpus import masked_corpus, small_corpus
from workers.spec.tokens import Packing

NO_PIPELINE = ("parallelism.pp=1",)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def train_exit(capsys, *overrides: str) -> tuple[int, str]:
    code = main(["train", str(DEMO_CONFIG), *[f"--set={o}" for o in overrides]])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize(
    ("corpus", "expected"), [(small_corpus, Packing.WINDOWS), (masked_corpus, Packing.DOCUMENTS)], ids=["text", "sft"]
)
def test_the_default_follows_the_corpus_format(corpus, expected, tmp_path):
    corpus(open_storage(str(tmp_path)))
    config = load_config(DEMO_CONFIG, ["data.source=tokens", f"data.uri={tmp_path}", *NO_PIPELINE])
    spec = train_spec(config)
    assert spec.tokens is not None and spec.tokens.packing == expected
    # Set explicitly, it wins over the format's default.
    config = load_config(DEMO_CONFIG, ["data.source=tokens", f"data.uri={tmp_path}", "data.packing=windows"])
    assert train_spec(config).tokens.packing == Packing.WINDOWS


def test_documents_with_a_pipeline_is_refused(tmp_path, capsys):
    masked_corpus(open_storage(str(tmp_path)))
    code, err = train_exit(capsys, "data.source=tokens", f"data.uri={tmp_path}", "parallelism.pp=2")
    assert code == 2
    assert (
        "data.packing=documents cannot run with parallelism.pp=2: pipeline stages pass only hidden states, not the "
        "document boundaries attention needs; set parallelism.pp=1 or data.packing=windows"
    ) in err


@pytest.mark.parametrize("source", ["text", "synthetic"])
def test_documents_without_a_corpus_is_refused(source, capsys):
    code, err = train_exit(capsys, f"data.source={source}", "data.packing=documents", *NO_PIPELINE)
    assert code == 2
    assert (
        f"data.packing=documents needs data.source=tokens (a corpus from meshpilot data prepare, which keeps "
        f"document boundaries); data.source={source} has none: remove data.packing or prepare a corpus"
    ) in err


def test_documents_on_a_version_1_corpus_is_refused(tmp_path, capsys):
    small_corpus(open_storage(str(tmp_path)))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for split in manifest["splits"].values():
        split.pop("documents_sha256")
    manifest["version"] = 1
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    code, err = train_exit(capsys, "data.source=tokens", f"data.uri={tmp_path}", "data.packing=documents", *NO_PIPELINE)
    assert code == 2
    assert (
        f"data.packing=documents: the corpus at data.uri='{tmp_path}' stores no document lengths (a version-1 "
        "corpus); prepare it again with meshpilot data prepare, or set data.packing=windows"
    ) in err


def test_an_unknown_packing_is_refused(capsys):
    code, err = train_exit(capsys, "data.packing=sentences")
    assert code == 2
    assert "data.packing: 'sentences' is not one of windows, documents" in err


def test_packing_by_documents_is_another_job_for_resuming(tmp_path):
    """A checkpoint of a windows run does not resume as a documents run: other samples."""
    masked_corpus(open_storage(str(tmp_path)))
    base = ["data.source=tokens", f"data.uri={tmp_path}", *NO_PIPELINE]
    hashes = {
        packing: load_config(DEMO_CONFIG, [*base, f"data.packing={packing}"]).config_hash() for packing in Packing
    }
    assert hashes[Packing.WINDOWS] != hashes[Packing.DOCUMENTS]
    assert load_config(DEMO_CONFIG, base).config_hash() == hashes[Packing.DOCUMENTS]  # the corpus's default
