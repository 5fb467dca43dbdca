"""Two chat tokenizers built with ``tokenizers`` for the data-prepare tests, saved as a model ships them.

A Llama-3-style one (``<|begin_of_text|>``, ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>``;
its template in ``tokenizer_config.json``) and a ChatML one (``<|im_start|>``, ``<|im_end|>``; its template
in ``chat_template.jinja``, where ``transformers`` now saves it). Small byte-level BPE models, trained in
well under a second; ``transformers.AutoTokenizer.from_pretrained(directory)`` loads both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LLAMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role ' + message['role'] + ': use system, user or assistant') }}{% endif %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = [
    "You are a helpful assistant. Answer briefly.",
    "What is the capital of France? Paris is the capital of France.",
    "Tokens, masks and templates: naïve café über 東京 🚀",
    "def add(a, b):\n    return a + b\n",
]


@dataclass(frozen=True)
class ChatTokenizer:
    directory: Path
    end_of_turn: str

    @property
    def tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.directory / "tokenizer.json"))

    def reference(self) -> Any:
        """The same files loaded by ``transformers``: the reference for tokens."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.directory))


def save_tokenizer(directory: Path, specials: list[str], config: dict[str, Any]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TEXTS * 20, trainer=trainer)
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config})
    )


def llama3_tokenizer(directory: Path) -> ChatTokenizer:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": LLAMA3_TEMPLATE}
    save_tokenizer(directory, specials, config)
    return ChatTokenizer(directory, "<|eot_id|>")


def chatml_tokenizer(directory: Path) -> ChatTokenizer:
    save_tokenizer(directory, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], {"eos_token": "<|endoftext|>"})
    (directory / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    return ChatTokenizer(directory, "<|im_end|>")
