"""Errors raised on a rank reach the driver intact (Ray pickles them): type, message, fields."""

from __future__ import annotations

import inspect
import pickle

import checkpointing.errors as errors


def test_every_checkpoint_error_survives_pickling():
    for name, error_type in inspect.getmembers(errors, inspect.isclass):
        if not issubclass(error_type, errors.CheckpointError):
            continue
        if error_type is errors.CorruptCheckpointError:
            original = error_type("block 3 of rank-00001.safetensors has a bad checksum", key="step-4/rank-1")
        else:
            original = error_type(f"{name}: what went wrong and how to fix it")
        copy = pickle.loads(pickle.dumps(original))
        assert type(copy) is error_type and str(copy) == str(original)
        assert getattr(copy, "key", None) == getattr(original, "key", None)
