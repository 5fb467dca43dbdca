"""Conversations and prompt/completion pairs -> tokens and a loss mask: what trains in a fine-tuning corpus.

Pure functions of (record, tokenizer, template), run in Ray Data tasks by ``tokenize.tokenize_documents``
(and by tests directly). The driver only loads the template (``tokenize.load_chat_template``).

**Chat.** A conversation is rendered with the tokenizer's own chat template by ``transformers``' own
renderer (``render_jinja_template``, with the special tokens ``apply_chat_template`` passes), then
tokenized with ``add_special_tokens=False``: the tokens equal
``AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tokenize=True)``. Nothing is appended:
the template ends each turn itself.

Which tokens train (``--train-on assistant``, the default for chat): each assistant turn's content and
its end-of-turn token(s), nothing else (system, user and tool turns, the template's headers). An
assistant turn ``i`` is found by rendering the conversation incrementally: its text starts where
``messages[:i]`` rendered *with the generation prompt* ends (so the header the template opens an
assistant turn with, e.g. ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``, is context), and
ends where ``messages[:i + 1]`` ends, less trailing whitespace: ChatML's ``<|im_end|>`` trains, the
``\\n`` the template writes after it (before the next turn) does not; Llama 3's ``<|eot_id|>`` trains.
A token trains when its characters overlap an assistant span: the rule ``transformers`` uses for
``{% generation %}`` blocks. A template that renders the last assistant turn apart (Qwen3's adds an
empty reasoning block that earlier turns lose) is followed through the turn's content: the span runs
from the generation prompt's end over the content to the end-of-turn text that follows it. A template
that rewrites what comes *before* an assistant turn as later turns arrive cannot be masked this way,
and the conversation is refused with that reason.

**Prompt-completion.** The prompt is encoded like a text document (the tokenizer's own special tokens,
e.g. a BOS), the completion on its own without special tokens, then the EOS: ``ids(prompt) +
ids(completion) + [eos]``. Encoding the two apart keeps the boundary exact (no token straddles it), and
joins them exactly as written (put any space or newline between them in the data). The completion and
the EOS train (``--train-on completion``, the default).

``--train-on all`` trains on every token: no mask is computed or stored.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

from workers.spec.tokens import CorpusFormat


class TrainOn(StrEnum):
    """``--train-on``: which tokens of a document are trained targets."""

    ALL = "all"  # every token (text corpora always; no mask stored)
    ASSISTANT = "assistant"  # chat: the assistant turns' content and end-of-turn tokens
    COMPLETION = "completion"  # prompt-completion: the completion and its EOS


DEFAULT_TRAIN_ON = {
    CorpusFormat.TEXT: TrainOn.ALL,
    CorpusFormat.CHAT: TrainOn.ASSISTANT,
    CorpusFormat.PROMPT_COMPLETION: TrainOn.COMPLETION,
}


class ConversationError(ValueError):
    """A conversation that cannot become tokens; the message says why (the template's own words when it refused)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat template and the named special tokens ``apply_chat_template`` hands it."""

    source: str  # the file it was read from, for messages
    text: str
    special_tokens: tuple[tuple[str, str], ...] = ()  # (bos_token, "<s>"), ...

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


@dataclass(frozen=True)
class DocumentRecipe:
    """How a record's document becomes tokens and a mask: handed from the driver to the tokenize tasks."""

    corpus_format: CorpusFormat = CorpusFormat.TEXT
    train_on: TrainOn = TrainOn.ALL
    template: ChatTemplate | None = None  # chat only

    @property
    def masked(self) -> bool:
        """Whether a mask is computed and stored (not for text, nor for ``--train-on all``)."""
        return self.train_on != TrainOn.ALL


@dataclass(frozen=True)
class RenderedConversation:
    text: str
    spans: tuple[tuple[int, int], ...]  # [start, end) character ranges of the trained assistant turns


def render(template: ChatTemplate, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool) -> str:
    """The conversation as ``apply_chat_template(..., tokenize=False)`` renders it; ``ConversationError`` if refused."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        special_tokens: dict[str, Any] = dict(template.special_tokens)  # as apply_chat_template passes them
        # Annotated as returning a str, it returns (rendered conversations, generation spans).
        rendered, _ = cast(
            tuple[list[str], list[Any]],
            render_jinja_template(
                conversations=[list(messages)],
                chat_template=template.text,
                add_generation_prompt=add_generation_prompt,
                **special_tokens,
            ),
        )
    except Exception as error:  # noqa: BLE001 - the template is the user's code: any failure is this conversation's
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConversationError(f"is rejected by the chat template of {template.source} ({reason})") from None
    return str(rendered[0])


def render_conversation(
    template: ChatTemplate, messages: Sequence[dict[str, Any]], *, find_spans: bool = True
) -> RenderedConversation:
    """The rendered conversation and, with ``find_spans``, the character spans of its assistant turns."""
    text = render(template, messages, add_generation_prompt=False)
    if not find_spans:
        return RenderedConversation(text, ())
    spans = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        span = _assistant_span(template, messages, index, text)
        if span is None:
            raise ConversationError(
                f"cannot be masked: the chat template of {template.source} renders the conversation up to message "
                f"{index + 1} differently from the start of the whole one, so the assistant turn has no fixed place; "
                "use --train-on all, or a template that renders earlier turns the same whatever follows"
            )
        spans.append(span)
    return RenderedConversation(text, tuple(spans))


def _assistant_span(
    template: ChatTemplate, messages: Sequence[dict[str, Any]], index: int, text: str
) -> tuple[int, int] | None:
    """Where assistant turn ``index`` lies in ``text``, the whole conversation rendered; None if it cannot be told.

    It starts where the conversation before it, rendered with the generation prompt, ends. It ends where
    the conversation through it ends (less trailing whitespace) when that is a prefix of ``text``; when
    it is not (templates that render the last assistant turn apart, e.g. with an empty reasoning block
    that earlier turns lose), it ends after the turn's content and the end-of-turn text that follows the
    content in that rendering, both found in ``text`` right after the start.
    """
    opened = render(template, messages[:index], add_generation_prompt=True)
    closed = render(template, messages[: index + 1], add_generation_prompt=False)
    if not (closed.startswith(opened) and text.startswith(opened)):
        return None
    if text.startswith(closed):
        return len(opened), len(closed.rstrip())
    content = messages[index].get("content")
    if not isinstance(content, str) or not content.strip():
        return None
    content = content.strip()
    end_of_turn = closed[closed.rfind(content) + len(content) :].rstrip()
    found = text.find(content, len(opened))
    if closed.rfind(content) < len(opened) or found < 0 or not text.startswith(end_of_turn, found + len(content)):
        return None
    return len(opened), found + len(content) + len(end_of_turn)


def trained_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span (spans and offsets in order), else 0."""
    mask = [0] * len(offsets)
    span = 0
    for token, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[token] = 1
    return mask


def encode_conversation(
    tokenizer: Any, template: ChatTemplate, messages: Sequence[dict[str, Any]], *, masked: bool
) -> tuple[list[int], list[int] | None]:
    """A chat document: its token ids, and (``masked``) 1 on the assistant turns' tokens. ``tokenizer``: tokenizers'."""
    rendered = render_conversation(template, messages, find_spans=masked)
    encoding = tokenizer.encode(rendered.text, add_special_tokens=False)
    return list(encoding.ids), trained_mask(encoding.offsets, rendered.spans) if masked else None


def encode_prompt_completion(
    tokenizer: Any, prompt: str, completion: str, eos_id: int, *, masked: bool
) -> tuple[list[int], list[int] | None]:
    """A prompt-completion document: ``ids(prompt) + ids(completion) + [eos]``; (``masked``) 1 on the last two."""
    prompt_ids = tokenizer.encode(prompt).ids
    completion_ids = [*tokenizer.encode(completion, add_special_tokens=False).ids, eos_id]
    mask = [0] * len(prompt_ids) + [1] * len(completion_ids) if masked else None
    return [*prompt_ids, *completion_ids], mask


def encode_record(
    tokenizer: Any, recipe: DocumentRecipe, document: str, eos_id: int
) -> tuple[list[int], list[int] | None]:
    """A chat or prompt-completion document (the JSON ``reading.RecordFields.document`` made) -> ids and mask."""
    values = json.loads(document)
    if recipe.corpus_format == CorpusFormat.CHAT:
        assert recipe.template is not None  # the driver loads it for every chat corpus
        return encode_conversation(tokenizer, recipe.template, values, masked=recipe.masked)
    prompt, completion = values
    return encode_prompt_completion(tokenizer, prompt, completion, eos_id, masked=recipe.masked)
