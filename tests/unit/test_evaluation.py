"""Which step boundaries evaluation runs at (``EvalSpec``).

The evaluation itself, on one rank and on eight: tests/ranks/test_evaluation_on_meshes.py.
"""

from __future__ import annotations

from workers.spec.train import EvalSpec


def test_which_boundaries_are_evaluated():
    every_5 = EvalSpec(interval_steps=5, at_start=True)
    assert [step for step in range(13) if every_5.due(step, last_step=12)] == [0, 5, 10, 12]
    assert not any(EvalSpec().due(step, last_step=12) for step in range(13))  # interval 0: off
