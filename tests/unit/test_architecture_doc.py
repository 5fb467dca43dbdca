"""docs/architecture.md names only what exists: every `name` in backticks resolves in the code.

python -m pytest tests/unit/test_architecture_doc.py -q
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path
from typing import Any

import orchestrator.driver

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
# Besides the driver's modules, the doc names the policies, the typed boundary and the faults.
OTHER_MODULES = ("elastic.policy", "workers.spec.messages", "workers.faults")


def _namespace() -> dict[str, Any]:
    names: dict[str, Any] = {}
    driver = [f"orchestrator.driver.{info.name}" for info in pkgutil.iter_modules(orchestrator.driver.__path__)]
    for module in (*driver, *OTHER_MODULES):
        names.update(vars(importlib.import_module(module)))
    return names


def _resolves(dotted: str, names: dict[str, Any]) -> bool:
    head, *rest = dotted.split(".")
    if head not in names:
        return False
    value = names[head]
    for part in rest:
        if not hasattr(value, part):
            return False
        value = getattr(value, part)
    return True


def test_every_name_in_backticks_exists() -> None:
    names = _namespace()
    quoted = re.findall(r"`([^`]+)`", DOC.read_text(encoding="utf-8"))
    assert quoted, "the doc names nothing"
    missing = sorted({name for name in quoted if not _resolves(name, names)})
    assert missing == [], f"docs/architecture.md names what the code does not have: {missing}"
