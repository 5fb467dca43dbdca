"""The tokenizer of a corpus: its file, its end-of-text token, and documents -> tokens.

``load_tokenizer`` runs on the driver: it reads the ``tokenizer.json`` (a file, or the one in a
model directory; on disk or ``s3://``), checks that the Hugging Face ``tokenizers`` library loads it,
and finds the EOS token. Its bytes are hashed for the manifest and shipped to the tasks as they are:
every node tokenizes with exactly the file that was hashed, and none needs the path.

``tokenize_documents`` runs in Ray Data tasks (``map_batches``, after ``reading.read_documents``):
``encode_batch`` with the tokenizer's own settings (its post-processor may add a BOS), then the EOS id
after each document, as little-endian ``uint16``/``uint32`` bytes ready for a shard.

The EOS token, in order: ``--eos-token``; the ``eos_token`` of ``tokenizer_config.json`` or
``special_tokens_map.json`` beside the tokenizer file; the one special token among the usual names
(``KNOWN_EOS_TOKENS``). Otherwise the user is asked for ``--eos-token``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from checkpointing.errors import CheckpointError
from orchestrator.data_prep.chat import ChatTemplate, ConversationError, DocumentRecipe, encode_record, render
from orchestrator.data_prep.reading import open_input_storage
from orchestrator.errors import UserError
from workers.spec.tokens import CorpusFormat, TokenizerInfo, token_dtype

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
TEMPLATE_FILE = "chat_template.jinja"
# The named special tokens apply_chat_template hands a template (transformers' SPECIAL_TOKENS_ATTRIBUTES).
TEMPLATE_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
KNOWN_EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
_NUMPY_DTYPES = {"uint16": "<u2", "uint32": "<u4"}  # shards are little-endian whatever the machine


@dataclass(frozen=True)
class TokenizerFile:
    """A loaded tokenizer: where it came from, its exact bytes, and what the manifest records of it."""

    uri: str
    data: bytes
    info: TokenizerInfo

    @property
    def dtype(self) -> str:
        return token_dtype(self.info.vocab_size)


def load_tokenizer(
    location: str, *, eos_token: str | None, endpoint_url: str | None, region: str | None
) -> TokenizerFile:
    """Read and check ``--tokenizer``; ``UserError`` naming the file when it does not load or has no EOS."""
    root, name = split_location(location)
    storage = open_input_storage(root, endpoint_url, region)
    uri = f"{root.rstrip('/')}/{name}"
    try:
        data = storage.get(name)
    except CheckpointError as error:
        raise UserError(
            f"--tokenizer {location}: cannot read {uri} ({error}); "
            "give a tokenizer.json or a model directory holding one"
        ) from None
    tokenizer = _parse(data, uri)
    eos = _choose_eos(tokenizer, eos_token, _named_eos(storage), uri)
    info = TokenizerInfo(
        sha256=hashlib.sha256(data).hexdigest(),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        eos_token=eos,
        eos_id=tokenizer.token_to_id(eos),
    )
    return TokenizerFile(uri=uri, data=data, info=info)


def split_location(location: str) -> tuple[str, str]:
    """(directory or s3 prefix, file name) of the tokenizer file ``location`` names."""
    if location.startswith("s3://"):
        stripped = location.rstrip("/")
        if stripped.endswith(".json"):
            return stripped.rsplit("/", 1)[0], stripped.rsplit("/", 1)[1]
        return stripped, TOKENIZER_FILE
    path = os.path.abspath(os.path.expanduser(location))
    if os.path.isdir(path):
        return path, TOKENIZER_FILE
    if os.path.isfile(path):
        return os.path.dirname(path), os.path.basename(path)
    raise UserError(
        f"--tokenizer {location}: no such file or directory; give a tokenizer.json or a model directory holding one"
    )


def _parse(data: bytes, uri: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception for a file it cannot read
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(
            f"--tokenizer {uri} does not load as a Hugging Face tokenizers file ({reason}); "
            "give the tokenizer.json saved by tokenizers or transformers"
        ) from None


def _named_eos(storage: Any) -> tuple[str, str] | None:
    """(file, token) when a config file beside the tokenizer names its ``eos_token``."""
    for name in CONFIG_FILES:
        try:
            if not storage.exists(name):
                continue
            value = json.loads(storage.get(name)).get("eos_token")
        except (CheckpointError, ValueError, AttributeError):  # optional files: an unreadable one names nothing
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return name, value
    return None


def _choose_eos(tokenizer: Any, given: str | None, named: tuple[str, str] | None, uri: str) -> str:
    specials = [token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special]
    listed = ", ".join(repr(token) for token in specials[:12]) or "none"
    if given is not None:
        if tokenizer.token_to_id(given) is None:
            raise UserError(f"--eos-token {given!r} is not a token of {uri}; its special tokens: {listed}")
        return given
    if named is not None:
        config_file, token = named
        if tokenizer.token_to_id(token) is None:
            raise UserError(f"{config_file} names eos_token {token!r}, which {uri} does not hold; pass --eos-token")
        return token
    known = [token for token in KNOWN_EOS_TOKENS if token in specials]
    if len(known) == 1:
        return known[0]
    raise UserError(
        f"--tokenizer {uri} names no single end-of-text token (no eos_token in {' or '.join(CONFIG_FILES)}, "
        f"and {len(known)} of its special tokens are usual EOS names); pass --eos-token TEXT "
        f"(its special tokens: {listed})"
    )


def load_chat_template(location: str, *, endpoint_url: str | None, region: str | None) -> ChatTemplate:
    """The chat template beside ``--tokenizer`` (driver), found where ``transformers`` looks for it.

    ``chat_template.jinja`` first (it wins over the config, as in ``AutoTokenizer.from_pretrained``), then
    the ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates: the one
    named ``default``). The named special tokens (``bos_token`` ...) come from ``tokenizer_config.json``,
    else ``special_tokens_map.json``. ``UserError`` naming the files looked for when there is none.
    """
    root, _ = split_location(location)
    storage = open_input_storage(root, endpoint_url, region)
    configs = {name: _json_object(storage, name) for name in CONFIG_FILES}
    special_tokens = _special_tokens(configs)
    where = root.rstrip("/")
    if storage.exists(TEMPLATE_FILE):
        template = ChatTemplate(f"{where}/{TEMPLATE_FILE}", storage.get(TEMPLATE_FILE).decode("utf-8"), special_tokens)
    else:
        text = _config_template(configs[CONFIG_FILES[0]])
        if text is None:
            raise UserError(
                f"--format chat: the tokenizer at {location} has no chat template (looked for {where}/{TEMPLATE_FILE} "
                f"and the chat_template of {where}/{CONFIG_FILES[0]}); use the tokenizer files of a chat model, "
                "add its template there, or prepare with --format text or prompt-completion"
            )
        template = ChatTemplate(f"{where}/{CONFIG_FILES[0]}", text, special_tokens)
    _check_template_syntax(template)
    return template


def _json_object(storage: Any, name: str) -> dict[str, Any]:
    try:
        if not storage.exists(name):
            return {}
        value = json.loads(storage.get(name))
    except (CheckpointError, ValueError):  # optional files: an unreadable one names nothing
        return {}
    return value if isinstance(value, dict) else {}


def _special_tokens(configs: dict[str, dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    found = []
    for name in TEMPLATE_SPECIAL_TOKENS:
        for config in configs.values():
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                found.append((name, value))
                break
    return tuple(found)


def _config_template(config: dict[str, Any]) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, list):  # named templates: transformers applies the one named "default"
        value = next(
            (item.get("template") for item in value if isinstance(item, dict) and item.get("name") == "default"), None
        )
    return value if isinstance(value, str) and value else None


def _check_template_syntax(template: ChatTemplate) -> None:
    """A template that does not compile is named now, before any task renders with it."""
    from jinja2 import TemplateSyntaxError

    try:
        render(template, [{"role": "user", "content": "-"}], add_generation_prompt=False)
    except ConversationError as error:
        # Other refusals are about this probe conversation; only a compile error is the template's own.
        if isinstance(error.__context__, TemplateSyntaxError):
            reason = str(error.__context__).splitlines()[0]
            raise UserError(
                f"chat template {template.source} does not compile ({reason}, line {error.__context__.lineno}); "
                "fix the template"
            ) from None


TEXT_RECIPE = DocumentRecipe()
# Parsed tokenizers by sha256: Ray reuses a worker process for many tasks, and parsing a large
# tokenizer.json takes up to a second, so each process parses it once.
_PARSED: dict[str, Any] = {}


def tokenize_documents(
    batch: dict[str, np.ndarray],
    *,
    tokenizer_json: bytes,
    tokenizer_sha256: str,
    eos_id: int,
    dtype: str,
    recipe: DocumentRecipe = TEXT_RECIPE,
) -> dict[str, np.ndarray]:
    """Ray Data stage: documents -> ``tokens`` (bytes of the ids) and ``mask`` (a byte per token, or empty).

    Error rows pass through; a conversation the template refuses becomes one (its ``offset`` names the line).
    """
    tokenizer = _PARSED.get(tokenizer_sha256)
    if tokenizer is None:
        from tokenizers import Tokenizer

        tokenizer = _PARSED[tokenizer_sha256] = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    errors = batch["error"].copy()
    tokens = _objects(len(errors), b"")
    masks = _objects(len(errors), b"")
    numpy_dtype = _NUMPY_DTYPES[dtype]
    good = np.flatnonzero(errors == "")
    if recipe.corpus_format == CorpusFormat.TEXT:
        encodings = tokenizer.encode_batch([batch["text"][index] for index in good]) if len(good) else []
        for index, encoding in zip(good, encodings):
            ids = encoding.ids
            ids.append(eos_id)
            tokens[index] = np.asarray(ids, dtype=numpy_dtype).tobytes()
    else:
        for index in good:
            try:
                ids, mask = encode_record(tokenizer, recipe, batch["text"][index], eos_id)
            except ConversationError as error:
                errors[index] = str(error)
                break  # the driver reports the first error in input order: nothing after it is needed
            tokens[index] = np.asarray(ids, dtype=numpy_dtype).tobytes()
            if mask is not None:
                masks[index] = np.asarray(mask, dtype=np.uint8).tobytes()
    return {
        "input": batch["input"],
        "offset": batch["offset"],
        "span": batch["span"],
        "error": errors,
        "tokens": tokens,
        "mask": masks,
    }


def _objects(count: int, value: bytes) -> np.ndarray:
    array = np.empty(count, dtype=object)
    array[:] = value
    return array
