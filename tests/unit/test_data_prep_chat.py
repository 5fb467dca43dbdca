"""Chat and prompt-completion documents: the tokens ``transformers`` gives, and exactly what trains.

    python -m pytest tests/unit/test_data_prep_chat.py -q

No Ray: the functions the tokenize tasks run, against two tokenizers built here with ``tokenizers``
(a Llama-3-style one whose template lives in ``tokenizer_config.json``, a ChatML one whose template is
``chat_template.jinja``), each loaded back by ``transformers.AutoTokenizer`` as the reference.
"""

from __future__ import annotations

import json
from itertools import groupby
from typing import Any

import numpy as np
import pytest

from orchestrator.data_prep.chat import (
    ChatTemplate,
    ConversationError,
    DocumentRecipe,
    TrainOn,
    encode_conversation,
    encode_prompt_completion,
    render_conversation,
)
from orchestrator.data_prep.reading import RecordFields, json_document
from orchestrator.data_prep.tokenize import load_chat_template, tokenize_documents
from orchestrator.errors import UserError
from tests.chat_tokenizers import ChatTokenizer, chatml_tokenizer, llama3_tokenizer, save_tokenizer
from workers.spec.tokens import CorpusFormat

CONVERSATIONS = {
    "user and assistant": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    "system, multi-turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Write add(a, b) in Python."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    ],
    "unicode, no assistant": [{"role": "user", "content": "naïve café über 東京 🚀"}],
}


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> ChatTokenizer:
    return llama3_tokenizer(tmp_path_factory.mktemp("tokenizers") / "llama3")


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> ChatTokenizer:
    return chatml_tokenizer(tmp_path_factory.mktemp("tokenizers") / "chatml")


@pytest.fixture(params=["llama3", "chatml"])
def chat_tokenizer(request) -> ChatTokenizer:
    return request.getfixturevalue(request.param)


def _template(chat_tokenizer: ChatTokenizer) -> ChatTemplate:
    return load_chat_template(str(chat_tokenizer.directory), endpoint_url=None, region=None)


def _trained_runs(tokenizer: Any, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded text of each run of trained tokens, in order."""
    runs = []
    position = 0
    for trained, run in groupby(mask):
        length = len(list(run))
        if trained:
            runs.append(tokenizer.decode(ids[position : position + length], skip_special_tokens=False))
        position += length
    return runs


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_chat_tokens_equal_transformers_apply_chat_template(chat_tokenizer, conversation):
    messages = CONVERSATIONS[conversation]
    ids, mask = encode_conversation(chat_tokenizer.tokenizer, _template(chat_tokenizer), messages, masked=True)
    expected = chat_tokenizer.reference().apply_chat_template(messages, tokenize=True)["input_ids"]
    assert ids == expected
    assert mask is not None and len(mask) == len(ids)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_only_assistant_content_and_end_of_turn_train(chat_tokenizer, conversation):
    messages = CONVERSATIONS[conversation]
    tokenizer = chat_tokenizer.tokenizer
    ids, mask = encode_conversation(tokenizer, _template(chat_tokenizer), messages, masked=True)
    assert mask is not None
    expected = [m["content"] + chat_tokenizer.end_of_turn for m in messages if m["role"] == "assistant"]
    assert _trained_runs(tokenizer, ids, mask) == expected


def test_the_newline_after_chatml_end_of_turn_and_the_assistant_header_are_context(chatml):
    messages = CONVERSATIONS["user and assistant"]
    rendered = render_conversation(_template(chatml), messages)
    assert rendered.text.endswith("<|im_start|>assistant\nParis.<|im_end|>\n")
    ((start, end),) = rendered.spans
    assert rendered.text[start:end] == "Paris.<|im_end|>"


def test_train_on_all_computes_no_mask(llama3):
    ids, mask = encode_conversation(
        llama3.tokenizer, _template(llama3), CONVERSATIONS["user and assistant"], masked=False
    )
    assert (
        mask is None and ids == llama3.reference().apply_chat_template(CONVERSATIONS["user and assistant"])["input_ids"]
    )


def test_a_role_the_template_rejects_is_reported_in_its_words(llama3, chatml):
    messages = [{"role": "user", "content": "run it"}, {"role": "tool", "content": "42"}]
    with pytest.raises(ConversationError) as llama_error:
        encode_conversation(llama3.tokenizer, _template(llama3), messages, masked=True)
    assert str(llama_error.value) == (
        f"is rejected by the chat template of {llama3.directory}/tokenizer_config.json "
        "(Unknown role tool: use system, user or assistant)"
    )
    with pytest.raises(ConversationError, match=r"chat_template.jinja \(tool messages are not supported\)$"):
        encode_conversation(chatml.tokenizer, _template(chatml), messages, masked=False)


# Like Qwen3's: the assistant turns after the last user message open with an empty reasoning block,
# so the conversation through an earlier assistant turn renders that turn differently from the whole.
REASONING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_user %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_that_renders_the_last_assistant_turn_apart_is_followed_through_the_content(chatml):
    messages = CONVERSATIONS["system, multi-turn"]
    template = ChatTemplate("reasoning.jinja", REASONING_TEMPLATE)
    ids, mask = encode_conversation(chatml.tokenizer, template, messages, masked=True)
    reference = chatml.reference().apply_chat_template(messages, chat_template=REASONING_TEMPLATE)["input_ids"]
    assert ids == reference and mask is not None
    assert _trained_runs(chatml.tokenizer, ids, mask) == [
        "Hello, how can I help?<|im_end|>",
        "<think>\n\n</think>\n\ndef add(a, b):\n    return a + b<|im_end|>",
    ]


def test_a_template_that_rewrites_earlier_turns_cannot_be_masked(llama3):
    # Numbers each turn from the end: a prefix renders differently from the start of the whole conversation.
    template = ChatTemplate(
        "rewriting.jinja",
        "{% for m in messages %}{{ (messages|length - loop.index0)|string + m['content'] }}{% endfor %}",
    )
    with pytest.raises(ConversationError, match="renders the conversation up to message 2 differently"):
        render_conversation(template, CONVERSATIONS["user and assistant"])


def test_a_tokenizer_without_a_chat_template_is_named_with_the_files_looked_for(tmp_path):
    directory = tmp_path / "plain"
    save_tokenizer(directory, ["<|endoftext|>"], {"eos_token": "<|endoftext|>"})
    with pytest.raises(UserError) as error:
        load_chat_template(str(directory), endpoint_url=None, region=None)
    assert str(error.value) == (
        f"--format chat: the tokenizer at {directory} has no chat template (looked for "
        f"{directory}/chat_template.jinja and the chat_template of {directory}/tokenizer_config.json); use the "
        "tokenizer files of a chat model, add its template there, or prepare with --format text or prompt-completion"
    )


def test_a_template_that_does_not_compile_is_named(tmp_path, llama3):
    directory = tmp_path / "broken"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((llama3.directory / "tokenizer.json").read_bytes())
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(UserError, match=r"chat_template.jinja does not compile \(.*for.*line 1\); fix the template"):
        load_chat_template(str(directory), endpoint_url=None, region=None)


def test_prompt_completion_tokens_and_mask(llama3):
    tokenizer = llama3.tokenizer
    eos = tokenizer.token_to_id("<|end_of_text|>")
    prompt, completion = "What is the capital of France?", " Paris is the capital of France."
    ids, mask = encode_prompt_completion(tokenizer, prompt, completion, eos, masked=True)
    prompt_ids = tokenizer.encode(prompt).ids
    assert ids == prompt_ids + tokenizer.encode(completion, add_special_tokens=False).ids + [eos]
    assert mask is not None and mask[: len(prompt_ids)] == [0] * len(prompt_ids)
    assert _trained_runs(tokenizer, ids, mask) == [completion + "<|end_of_text|>"]
    assert encode_prompt_completion(tokenizer, prompt, completion, eos, masked=False) == (ids, None)


# ----------------------------------------------------------------------------- records and the task stage
CHAT_FIELDS = RecordFields(CorpusFormat.CHAT, ("messages",))
PAIR_FIELDS = RecordFields(CorpusFormat.PROMPT_COMPLETION, ("prompt", "completion"))


def test_records_that_give_no_document_say_why():
    assert json_document(b'{"conversation": [], "id": 1}', CHAT_FIELDS)[1] == (
        "has no field 'messages' (its fields: 'conversation', 'id'); name the messages field with --messages-field"
    )
    assert json_document(b'{"messages": "hi"}', CHAT_FIELDS)[1].startswith("field 'messages' holds a string")
    assert json_document(b'{"messages": [{"content": "hi"}]}', CHAT_FIELDS)[1] == (
        "message 1 of field 'messages' has no 'role'; each message needs a role and a content"
    )
    assert json_document(b'{"prompt": "q"}', PAIR_FIELDS)[1] == (
        "has no field 'completion' (its fields: 'prompt'); name the completion field with --completion-field"
    )
    assert json_document(b'{"completion": "a"}', PAIR_FIELDS)[1].endswith("name the prompt field with --prompt-field")
    assert json_document(b'{"prompt": "q", "completion": 3}', PAIR_FIELDS)[1] == (
        "field 'completion' holds a number, not a string"
    )
    # A null key is dropped, as apply_chat_template drops it.
    document, error = json_document(b'{"messages": [{"role": "user", "content": "hi", "name": null}]}', CHAT_FIELDS)
    assert error == "" and json.loads(document) == [{"role": "user", "content": "hi"}]


def test_the_tokenize_stage_gives_token_and_mask_bytes_and_an_error_row(chatml):
    template = _template(chatml)
    conversations = [
        CONVERSATIONS["system, multi-turn"],
        [{"role": "tool", "content": "x"}],
        CONVERSATIONS["unicode, no assistant"],
    ]
    batch = {
        "input": np.zeros(3, dtype=np.int32),
        "offset": np.asarray([0, 100, 200]),
        "span": np.asarray([100, 100, 100]),
        "text": np.asarray([json.dumps(c) for c in conversations], dtype=object),
        "error": np.asarray(["", "", ""], dtype=object),
    }
    data = (chatml.directory / "tokenizer.json").read_bytes()
    out = tokenize_documents(
        batch,
        tokenizer_json=data,
        tokenizer_sha256="chatml",
        eos_id=0,
        dtype="uint16",
        recipe=DocumentRecipe(CorpusFormat.CHAT, TrainOn.ASSISTANT, template),
    )
    ids, mask = encode_conversation(chatml.tokenizer, template, conversations[0], masked=True)
    assert np.frombuffer(out["tokens"][0], dtype="<u2").tolist() == ids
    assert np.frombuffer(out["mask"][0], dtype=np.uint8).tolist() == mask
    assert out["error"][1].endswith("(tool messages are not supported)") and out["tokens"][1] == b""
