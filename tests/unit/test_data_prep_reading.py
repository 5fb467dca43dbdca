"""How ``meshpilot data prepare`` cuts ``.jsonl`` files into read chunks, and what it says about a bad line.

    python -m pytest tests/unit/test_data_prep_reading.py -q

No Ray: the functions the read tasks run, on bytes in memory.
"""

from __future__ import annotations

import random

import pytest

from orchestrator.data_prep.reading import json_text, owned_lines, spread


def _lines_of(data: bytes, chunk: int) -> list[tuple[int, bytes]]:
    """Every (offset, line) that the chunks of ``chunk`` bytes own, chunk after chunk."""
    found = []
    for start in range(0, len(data), chunk):
        end = min(len(data), start + chunk)
        # A probe of 16 bytes: lines longer than it are read past the chunk's end in several steps.
        first, body = owned_lines(lambda a, b: data[a:b], start, end, len(data), probe=16)
        offset = first
        for line in body.split(b"\n"):
            if line:
                found.append((offset, line))
            offset += len(line) + 1
    return found


@pytest.mark.parametrize("seed", range(6))
def test_chunks_cut_anywhere_own_every_line_exactly_once(seed):
    rng = random.Random(seed)
    lines = [bytes(rng.choice(b"abc \xc3\xa9") for _ in range(rng.choice([0, 1, 5, 40, 300]))) for _ in range(40)]
    data = b"\n".join(lines) + rng.choice([b"", b"\n"])  # with and without a final newline
    expected, offset = [], 0
    for line in lines:
        if line:
            expected.append((offset, line))
        offset += len(line) + 1
    for chunk in (1, 2, 7, 100, 1000, len(data) + 5):
        assert _lines_of(data, chunk) == expected, chunk


def test_a_bad_line_says_what_is_wrong_and_the_fix():
    assert json_text(b'{"text": "caf\xc3\xa9"}', "text") == ("café", "")
    assert json_text(b'{"text": "x', "text")[1].startswith("is not JSON (Unterminated string")
    assert json_text(b'{"body": "x", "id": 3}', "text")[1] == (
        "has no field 'text' (its fields: 'body', 'id'); name the text field with --text-field"
    )
    assert json_text(b'{"text": 7}', "text")[1] == "field 'text' holds a number, not a string"
    assert json_text(b'{"text": null}', "text")[1] == "field 'text' holds null, not a string"
    assert json_text(b'["text"]', "text")[1] == "is a list, not a JSON object with a 'text' field"
    assert json_text(b'{"text": "\xff"}', "text")[1] == (
        "is not valid UTF-8 (byte 0xff at column 11); re-encode the file as UTF-8"
    )


def test_progress_weight_is_spread_without_loss():
    assert spread(10, 3) == [3, 3, 4] and spread(5, 0) == [] and sum(spread(12_345, 7)) == 12_345
