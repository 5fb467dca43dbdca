"""Parametrize values, the long ones marked slow: ``make test`` leaves them out, CI runs them."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def slow_when_named(names: Iterable[str], slow: set[str]) -> list:
    """``names`` as parametrize values, those in ``slow`` marked slow (their ids unchanged)."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in names]
