"""Loaded only when tests/gpu is collected: named on the command line (``make test-gpu``), or
by a plain run on a machine with the GPUs (tests/conftest.py). Without the GPUs the session
stops before collecting: one line, exit code 4 (pytest's usage error), never an empty pass."""

import pytest
import torch

from tests.conftest import GPUS_NEEDED


def pytest_sessionstart(session: pytest.Session) -> None:
    found = torch.cuda.device_count()
    if found < GPUS_NEEDED:
        raise pytest.UsageError(
            f"tests/gpu needs >= {GPUS_NEEDED} CUDA GPUs; this machine has {found} "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'none: a CPU build'})"
        )
