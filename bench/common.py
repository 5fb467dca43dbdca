"""Helpers shared by the benchmarks: subprocess timing, spawned gloo ranks and the JSON result line.

Every benchmark prints human-readable lines, then, as its last stdout line, one JSON object
with our figure, the reference measured in the same run, and their ratio. Figures the goodput
simulator uses are also recorded with ``orchestrator.analysis.bench_figures.record_figure``.

The scripts, each with ``--quick`` for a short smoke run: overhead.py, checkpoint.py, hf_load.py,
data.py, recovery.py, compile.py, chaos.py, release.py, metrics_overhead.py, parallel.py, finetune.py, adoption.py and
torchrun_reference.py (under torchrun); gpu_check.py, whose ``--quick`` (``--smoke``) runs every part
on the CPU. Modules the scripts import, not run on their own: this one, and those in ``bench/support/``
(except ``gpu_check_run.py``, one run of gpu_check's, and ``gpu_wheels.py``, which fetches its wheels).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def run_command(argv: list[str], *, timeout: float, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Run to completion; returns (launch wall-clock time, combined output). Raises on failure."""
    launched = time.time()
    process = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if process.returncode != 0:
        sys.stderr.write(process.stdout[-4000:] + process.stderr[-4000:])
        raise SystemExit(f"{argv[0]} failed with exit code {process.returncode}")
    return launched, process.stdout + process.stderr


def run_process_group(
    argv: list[str], *, timeout: float, env: dict[str, str] | None = None
) -> tuple[int | None, str, str]:
    """Run ``argv`` in a process group of its own: (exit code, stdout, stderr), the exit code None
    when it ran past ``timeout``; then the whole group is killed, so what it started (a training
    run, inductor's compile workers) does not outlive it and hold the GPU."""
    process = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        return process.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        return None, stdout, stderr


def steady_step_time(completions: list[float], warmup: int) -> float:
    """Median wall-clock gap between consecutive step completions after ``warmup`` steps."""
    gaps = [b - a for a, b in zip(completions[warmup:], completions[warmup + 1 :])]
    return statistics.median(gaps)


def emit(result: dict[str, Any]) -> None:
    """The benchmark's last stdout line."""
    result = {**result, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(result), flush=True)


def spawn_ranks(target: Any, case: dict[str, Any], ranks: int, *, timeout_s: float = 600) -> dict[int, Any]:
    """Run ``target(case, rank, store_path, results)`` in ``ranks`` spawned processes (they join one
    process group through a FileStore at ``store_path``); return what each put on ``results`` as
    ``(rank, value)``, by rank."""
    import tempfile

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as workdir:
        store = str(Path(workdir) / "store")
        processes = [
            context.Process(target=target, args=(case, rank, store, results), daemon=True) for rank in range(ranks)
        ]
        for process in processes:
            process.start()
        outcomes = dict(results.get(timeout=timeout_s) for _ in processes)
        for process in processes:
            process.join(timeout=60)
    return outcomes
