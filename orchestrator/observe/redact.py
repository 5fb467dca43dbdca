"""Keep credentials out of everything the driver writes or prints (invariant 4).

Two nets: values under keys that name a secret are replaced whole, and strings are scrubbed of
anything that looks like a credential (AWS key ids, ``secret=...`` pairs, URL passwords,
bearer tokens) and of every secret value registered at start-up (e.g. the S3 secret key the
process holds), wherever it appears.
"""

from __future__ import annotations

import re
import threading
from typing import Any

MASK = "***"

# Whole name parts only: "tokens" (a count) is not "token" (a credential).
_SECRET_KEY_NAME = re.compile(
    r"(^|_)(secret|secrets|password|passwd|token|credential|credentials|access_key|secret_key|session_key|api_key)($|_)",
    re.I,
)
_PATTERNS = (
    re.compile(r"\b(AKIA|ASIA)[A-Z0-9]{12,}\b"),  # AWS access key ids
    re.compile(
        r"(?i)(\b(?:\w+_)?(?:secret|password|passwd|token|access_key|secret_key|api_key)\s*[=:]\s*)([^\s,;'\"&]+)"
    ),
    re.compile(r"(?i)(bearer\s+)([A-Za-z0-9._~+/=-]+)"),
    re.compile(r"(://[^/\s:@]+:)([^@\s/]+)(@)"),  # user:password@host
)

_registered: set[str] = set()
_lock = threading.Lock()


def register_secret(value: str | None) -> None:
    """Remember a secret value so that it is masked wherever it shows up later."""
    if value and len(value) >= 4:
        with _lock:
            _registered.add(value)


def redact_text(text: str) -> str:
    for secret in sorted(_registered, key=len, reverse=True):
        text = text.replace(secret, MASK)
    text = _PATTERNS[0].sub(MASK, text)
    text = _PATTERNS[1].sub(lambda m: m.group(1) + MASK, text)
    text = _PATTERNS[2].sub(lambda m: m.group(1) + MASK, text)
    text = _PATTERNS[3].sub(lambda m: m.group(1) + MASK + m.group(3), text)
    return text


def redact(value: Any) -> Any:
    """A copy of ``value`` (dicts, lists, strings) with credentials masked."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {
            key: (
                MASK if isinstance(key, str) and _SECRET_KEY_NAME.search(key) and value_is_set(item) else redact(item)
            )
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(redact(item) for item in value)
    return value


def value_is_set(item: Any) -> bool:
    return item not in (None, "", False)
