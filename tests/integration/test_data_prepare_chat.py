"""``meshpilot data prepare --format chat|prompt-completion`` as a user runs it: real Ray Data, real files.

    python -m pytest tests/integration/test_data_prepare_chat.py -q

One run per format on the session cluster: every chat document must equal ``transformers``'
``apply_chat_template(messages, tokenize=True)``, every mask the assistant turns, in input order per
split; the mask shards, document lengths and trained-token counts must agree with the manifest. The
mistakes found before any work need no cluster; the two found while tokenizing run on it.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from checkpointing.storage import open_storage
from orchestrator.cli import main
from orchestrator.data_prep import pipeline
from orchestrator.data_prep.chat import encode_conversation, encode_prompt_completion
from orchestrator.data_prep.tokenize import load_chat_template
from tests.chat_tokenizers import TEXTS, ChatTokenizer, llama3_tokenizer
from tests.integration.test_data_prepare import cli_error, files_under, with_flag
from workers.spec.tokens import (
    DOCUMENT_LENGTH_DTYPE,
    MANIFEST_KEY,
    SPLITS,
    CorpusFormat,
    TokenManifest,
    documents_key,
    is_validation,
    mask_key,
    parse_token_manifest,
)

FRACTION = 0.2
DOCUMENTS = 400
SHARD_MB = 0.004  # ~2,000 uint16 tokens: several shards, cut inside documents


def _conversation(rng: random.Random) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": rng.choice(TEXTS)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": rng.choice(TEXTS)})
        messages.append({"role": "assistant", "content": rng.choice(TEXTS).strip() + f" #{rng.randint(0, 999)}"})
    return messages


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> tuple[ChatTokenizer, Path, list[list[dict[str, str]]]]:
    root = tmp_path_factory.mktemp("chat")
    rng = random.Random(3)
    conversations = [_conversation(rng) for _ in range(DOCUMENTS)]
    with open(root / "chats.jsonl", "w", encoding="utf-8") as handle:
        for number, messages in enumerate(conversations):
            handle.write(json.dumps({"id": number, "messages": messages}) + "\n")
    return llama3_tokenizer(root / "llama3"), root / "chats.jsonl", conversations


def _args(tokenizer: ChatTokenizer, inputs: list[Path], out: Path, *extra: str) -> list[str]:
    return [
        "data",
        "prepare",
        "--input",
        *map(str, inputs),
        "--tokenizer",
        str(tokenizer.directory),
        "--out",
        str(out),
        "--validation-fraction",
        str(FRACTION),
        "--shard-mb",
        str(SHARD_MB),
        "--chunk-mb",
        "0.02",
        "--plain",
        *extra,
    ]


def read_masked_corpus(out: Path) -> tuple[TokenManifest, dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Each split's (tokens, mask, document lengths), every object checked against its manifest entry."""
    storage = open_storage(str(out))
    manifest = parse_token_manifest(storage.get(MANIFEST_KEY), str(out))
    streams = {}
    for split in SPLITS:
        index = manifest.splits[split]
        tokens, masks = [], []
        for shard in index.shards:
            data, mask = storage.get(shard.key), storage.get(mask_key(shard.key))
            assert hashlib.sha256(data).hexdigest() == shard.sha256
            assert hashlib.sha256(mask).hexdigest() == shard.mask_sha256 and len(mask) == shard.tokens
            tokens.append(np.frombuffer(data, dtype="<u2"))
            masks.append(np.frombuffer(mask, dtype=np.uint8))
        lengths = storage.get(documents_key(split))
        assert hashlib.sha256(lengths).hexdigest() == index.documents_sha256
        streams[split] = (np.concatenate(tokens), np.concatenate(masks), np.frombuffer(lengths, DOCUMENT_LENGTH_DTYPE))
    return manifest, streams


def test_a_chat_corpus_holds_transformers_tokens_and_the_assistant_masks(ray_cluster, chat_data, tmp_path, capsys):
    tokenizer, path, conversations = chat_data
    out = tmp_path / "chat-tokens"
    assert main(_args(tokenizer, [path], out, "--format", "chat")) == 0
    printed = capsys.readouterr().out
    assert f"prepared: {out}  {DOCUMENTS} documents" in printed and "format chat, loss mask stored" in printed

    reference = tokenizer.reference()
    template = load_chat_template(str(tokenizer.directory), endpoint_url=None, region=None)
    expected: dict[str, tuple[list[int], list[int], list[int]]] = {split: ([], [], []) for split in SPLITS}
    for number, messages in enumerate(conversations):
        ids = reference.apply_chat_template(messages, tokenize=True)["input_ids"]
        _, mask = encode_conversation(tokenizer.tokenizer, template, messages, masked=True)
        assert mask is not None
        tokens, masks, lengths = expected["validation" if is_validation(0, 0, number, FRACTION) else "train"]
        tokens += ids
        masks += mask
        lengths.append(len(ids))
    manifest, streams = read_masked_corpus(out)
    for split in SPLITS:
        for got, want in zip(streams[split], expected[split]):
            np.testing.assert_array_equal(got, np.asarray(want))
        assert manifest.splits[split].trained_tokens == sum(expected[split][1]) > 0
    assert manifest.corpus_format == CorpusFormat.CHAT and manifest.loss_mask and manifest.fields == ("messages",)
    assert manifest.chat_template_sha256 == hashlib.sha256(template.text.encode()).hexdigest()
    assert len(manifest.splits["train"].shards) >= 3

    # The same command again checks every object, rewrites none; other settings are refused before any work.
    before = files_under(out)
    assert main(_args(tokenizer, [path], out, "--format", "chat")) == 0
    assert "already prepared (identical, nothing rewritten)" in capsys.readouterr().out
    (out / mask_key(manifest.splits["train"].shards[2].key)).unlink()  # a lost mask shard: written again, same bytes
    assert main(_args(tokenizer, [path], out, "--format", "chat")) == 0
    assert "1 missing shard(s) written again" in capsys.readouterr().out
    message = cli_error(capsys, _args(tokenizer, [path], out, "--format", "chat", "--train-on", "all"))
    assert "already holds a token corpus prepared with other settings (loss mask differ)" in message
    assert files_under(out) == before


def test_a_prompt_completion_corpus_trains_the_completion_and_its_eos(ray_cluster, chat_data, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer, _, conversations = chat_data
    pairs = [(messages[-2]["content"], " " + messages[-1]["content"]) for messages in conversations]
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"q": [p for p, _ in pairs], "a": [c for _, c in pairs]}), path, row_group_size=50)
    out = tmp_path / "pair-tokens"
    args = ["--format", "prompt-completion", "--prompt-field", "q", "--completion-field", "a"]
    seen_by_the_driver: set[str] = set()
    route = pipeline._route_documents

    def recording(batches, *rest):
        def columns():
            for batch in batches:
                seen_by_the_driver.update(batch)
                yield batch

        return route(columns(), *rest)

    monkeypatch.setattr(pipeline, "_route_documents", recording)
    assert main(_args(tokenizer, [path], out, *args)) == 0
    # The driver sees where each document is, never its tokens; the tasks' pieces are gone.
    assert seen_by_the_driver == {"input", "offset", "span", "error", "piece", "position", "length", "trained"}
    assert not [name for name in files_under(out) if name.startswith(".pieces/")]

    eos = tokenizer.tokenizer.token_to_id("<|end_of_text|>")
    expected: dict[str, tuple[list[int], list[int]]] = {split: ([], []) for split in SPLITS}
    for number, (prompt, completion) in enumerate(pairs):
        ids, mask = encode_prompt_completion(tokenizer.tokenizer, prompt, completion, eos, masked=True)
        assert mask is not None
        split = "validation" if is_validation(0, 0, number, FRACTION) else "train"
        expected[split][0].extend(ids)
        expected[split][1].extend(mask)
    manifest, streams = read_masked_corpus(out)
    for split in SPLITS:
        np.testing.assert_array_equal(streams[split][0], np.asarray(expected[split][0]))
        np.testing.assert_array_equal(streams[split][1], np.asarray(expected[split][1]))
    assert manifest.corpus_format == CorpusFormat.PROMPT_COMPLETION and manifest.fields == ("q", "a")


# ----------------------------------------------------------------------------- mistakes
def _no_template(root: Path, tokenizer: ChatTokenizer) -> list[str]:
    plain = root / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((tokenizer.directory / "tokenizer.json").read_bytes())
    (plain / "tokenizer_config.json").write_text('{"eos_token": "<|end_of_text|>"}')
    return ["--tokenizer", str(plain)]


def _missing_prompt_column(root: Path, tokenizer: ChatTokenizer) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["q"], "completion": ["a"]}), root / "pairs.parquet")
    return ["--input", str(root / "pairs.parquet"), "--format", "prompt-completion"]


BEFORE_ANY_WORK = {
    "tokenizer without a chat template": (_no_template, "--format chat: the tokenizer at "),
    "parquet without the prompt column": (_missing_prompt_column, "has no column 'prompt' (its columns: 'question', "),
    "train-on of another format": (lambda root, tokenizer: ["--train-on", "completion"], "--train-on completion does"),
}


@pytest.mark.parametrize("case", sorted(BEFORE_ANY_WORK))
def test_chat_mistakes_found_before_any_work(case, chat_data, tmp_path, capsys):
    tokenizer, path, _ = chat_data
    make, expected = BEFORE_ANY_WORK[case]
    args = _args(tokenizer, [path], tmp_path / "tokens", "--format", "chat")
    for flag, value in zip(*[iter(make(tmp_path, tokenizer))] * 2):
        args = with_flag(args, flag, value)
    assert expected in cli_error(capsys, args)
    assert not (tmp_path / "tokens").exists()


def test_a_chat_tokenizer_without_template_names_the_files_looked_for(chat_data, tmp_path, capsys):
    tokenizer, path, _ = chat_data
    args = _args(tokenizer, [path], tmp_path / "tokens", "--format", "chat", *_no_template(tmp_path, tokenizer))
    plain = tmp_path / "plain"
    assert cli_error(capsys, args) == (
        f"meshpilot: --format chat: the tokenizer at {plain} has no chat template (looked for "
        f"{plain}/chat_template.jinja and the chat_template of {plain}/tokenizer_config.json); use the tokenizer "
        "files of a chat model, add its template there, or prepare with --format text or prompt-completion"
    )


WHILE_READING = {  # the bad record sits after several chunks of good ones: named by file and line
    "record without the messages field": (
        {"conversation": [{"role": "user", "content": "hi"}]},
        "line 301 has no field 'messages' (its fields: 'conversation'); name the messages field with --messages-field",
    ),
    "role the template rejects": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]},
        "line 301 is rejected by the chat template of {tokenizer}/tokenizer_config.json "
        "(Unknown role tool: use system, user or assistant)",
    ),
}


@pytest.mark.parametrize("case", sorted(WHILE_READING))
def test_chat_mistakes_found_while_tokenizing_leave_nothing(case, ray_cluster, chat_data, tmp_path, capsys):
    tokenizer, path, _ = chat_data
    record, expected = WHILE_READING[case]
    lines = path.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*lines[:300], json.dumps(record), *lines[300:]]) + "\n")
    out = tmp_path / "tokens"
    message = cli_error(capsys, _args(tokenizer, [bad], out, "--format", "chat"))
    assert message == f"meshpilot: input {bad} " + expected.format(tokenizer=tokenizer.directory)
    assert files_under(out) == {}


def test_the_chat_template_is_read_beside_a_tokenizer_on_s3(s3_bucket, chat_data):
    tokenizer, _, conversations = chat_data
    storage = open_storage(f"s3://{s3_bucket.name}", endpoint_url=s3_bucket.endpoint_url)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        storage.put_bytes(f"models/llama3/{name}", (tokenizer.directory / name).read_bytes())
    template = load_chat_template(
        f"s3://{s3_bucket.name}/models/llama3", endpoint_url=s3_bucket.endpoint_url, region=None
    )
    local = load_chat_template(str(tokenizer.directory), endpoint_url=None, region=None)
    assert template.source == f"s3://{s3_bucket.name}/models/llama3/tokenizer_config.json"
    assert (template.text, template.special_tokens) == (local.text, local.special_tokens)
    assert template.special_tokens == (("bos_token", "<|begin_of_text|>"), ("eos_token", "<|end_of_text|>"))
    ids, _ = encode_conversation(tokenizer.tokenizer, template, conversations[0], masked=False)
    assert ids == tokenizer.reference().apply_chat_template(conversations[0])["input_ids"]
