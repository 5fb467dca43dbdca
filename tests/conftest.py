"""Session-wide fixtures live in tests/fixtures/*; each module is one shared resource.

The tiers, one directory each, from the quickest:

- tests/unit: tests that run in the pytest process (a fake worker group where a test steps the
  controller, a fake process group where it needs one; a few start the CLI or a bare interpreter,
  never a rank); milliseconds to a few seconds each.
- tests/ranks: tests that run rank code in spawned gloo processes, no Ray
  (tests/ranks/spawned_ranks.py); seconds each.
- tests/integration: real jobs on the embedded Ray cluster (tests/fixtures/ray_cluster.py).
- tests/faults: real jobs on the same cluster with faults keyed by (rank, step) (tests/faults/harness.py).
- tests/gpu: what only CUDA GPUs show (bfloat16 parity, checkpoint stalls, NCCL generations).

tests/gpu needs a machine with a CUDA GPU (its replica-group tests need two, and say so when
they are skipped on a one-GPU machine). Elsewhere it is not collected at all,
rather than collected and skipped, so that a CPU run reports only what it ran; on a machine
that has the GPUs a plain ``pytest`` runs it with everything else. ``make test-gpu`` names the
directory and, without the GPUs, stops with one line saying so (tests/gpu/conftest.py).
"""

import os
import tempfile

import torch

# Compiled graphs (training.compile) go to one cache for the whole session, which every spawned
# rank and Ray actor inherits: a graph is compiled once per run of the suite, not once per test,
# and nothing is left in the machine's shared default cache.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="meshpilot-tests-inductor-"))
# Benchmarks the tests start (bench/gpu_check.py --smoke, ...) record nothing in bench/results.
os.environ["MESHPILOT_BENCH_RECORD"] = "0"

pytest_plugins = ["tests.fixtures.ray_cluster", "tests.fixtures.s3"]

GPUS_NEEDED = 1

# device_count asks the driver without creating a CUDA context, so Ray's actors still own
# the GPUs; on the CPU build of torch it is 0.
collect_ignore_glob = [] if torch.cuda.device_count() >= GPUS_NEEDED else ["gpu"]
