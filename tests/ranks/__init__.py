"""Tests that run rank code in spawned gloo processes, no Ray.

A test spawns its ranks (``spawned_ranks.spawn_ranks``: a fork server that has imported torch
and the trainer once, so each rank starts in milliseconds), each rank runs a function of a
``*_ranks.py`` module here and sends back plain values, and the test compares them in its own
process: with one rank, with ``transformers``, or between the ranks. Each test takes seconds.

    .venv/bin/python -m pytest tests/ranks -q -m "not slow"
"""
