"""Helpers shared by the benchmarks: subprocess timing, spawned gloo ranks and the JSON result line.

Every benchmark prints human-readable lines, then, as its last stdout line, one JSON object
with our figure, the reference measured in the same run, and their ratio. Figures the goodput
simulator uses are also recorded with ``orchestrator.analysis.bench_figures.record_figure``.

The scripts, each with ``--quick`` for a short smoke run: overhead.py, checkpoint.py, hf_load.py,
data.py, recovery.py, compile.py, chaos.py, release.py, metrics_overhead.py, parallel.py, finetune.py, adoption.py and
torchrun_reference.py (under torchrun); gpu_check.py, whose ``--quick`` (``--smoke``) runs every part
on the CPU. Modules the scripts import, not run on their own: this one, ``goals.py`` (the goal of
each figure on the benchmarks page) and those in ``bench/support/`` (except ``gpu_check_run.py``,
one run of gpu_check's, and ``gpu_wheels.py``, which fetches its wheels). ``report.py`` renders
the benchmarks page from the recorded runs.

Recording: ``emit`` also appends the result, with the command, the date (UTC), the git commit and
the machine, as one line to ``bench/results/<script>.jsonl`` (``RUN_FORMAT``), never rewriting
earlier lines; ``python bench/report.py`` reads them. Only the script the user started records,
not the processes it starts (ranks, ``--case``/``--part`` runs of the same script). ``--no-record``
on any script's command line, or ``MESHPILOT_BENCH_RECORD=0`` (the test suite sets it), records
nothing, for smoke runs and experiments.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "bench"
RESULTS_DIR = BENCH_DIR / "results"
RUN_FORMAT = "meshpilot-bench-run/1"
NO_RECORD_FLAG = "--no-record"
RECORD_ENV = "MESHPILOT_BENCH_RECORD"  # "0": record nothing
RESULTS_ENV = "MESHPILOT_BENCH_RESULTS"  # another directory for the .jsonl files (tests)
# The pid of the process that records: the first one to import this module. Processes it starts
# inherit the variable and so do not record their own (partial) JSON lines.
RECORDER_ENV = "MESHPILOT_BENCH_RECORDER"


def take_no_record_flag(argv: list[str], environ: dict[str, str] | os._Environ[str]) -> None:
    """Remove ``--no-record`` from ``argv`` (before the script's own argparse sees it) and turn
    recording off in ``environ``, so that what the script starts inherits the choice."""
    if NO_RECORD_FLAG in argv:
        argv[:] = [argument for argument in argv if argument != NO_RECORD_FLAG]
        environ[RECORD_ENV] = "0"


# At import, so that every script gets the flag without its parser knowing it.
take_no_record_flag(sys.argv, os.environ)
os.environ.setdefault(RECORDER_ENV, str(os.getpid()))
# The running script, resolved now: a later working directory does not move it.
SCRIPT = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None


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
    """The benchmark's last stdout line; also recorded (``record_run``) unless recording is off."""
    result = {**result, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(result), flush=True)
    recording = os.environ.get(RECORD_ENV, "1") != "0" and os.environ.get(RECORDER_ENV) == str(os.getpid())
    if recording and SCRIPT is not None and SCRIPT.parent == BENCH_DIR:
        path = record_run(result, bench=SCRIPT.stem, argv=[str(SCRIPT), *sys.argv[1:]])
        print(f"recorded in {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", file=sys.stderr)


def record_run(result: dict[str, Any], *, bench: str, argv: list[str], results_dir: Path | None = None) -> Path:
    """Append one run of ``bench`` (``RUN_FORMAT``) to ``<results_dir>/<bench>.jsonl``; returns its path.

    A single ``write`` of one line in append mode: earlier lines are never read or rewritten."""
    results_dir = results_dir or Path(os.environ.get(RESULTS_ENV) or RESULTS_DIR)
    results_dir.mkdir(parents=True, exist_ok=True)
    line = {
        "format": RUN_FORMAT,
        "bench": bench,
        "command": command_line(argv),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git_commit(),
        "machine": machine(),
        "result": result,
    }
    path = results_dir / f"{bench}.jsonl"
    with path.open("a", encoding="utf-8") as stream:
        stream.write(json.dumps(line, sort_keys=True) + "\n")
    return path


def command_line(argv: list[str]) -> str:
    """``python bench/x.py ARGS``, the script relative to the repository where it is inside it."""
    script = Path(argv[0])
    if script.resolve().is_relative_to(REPO):
        script = script.resolve().relative_to(REPO)
    return shlex.join(["python", str(script), *argv[1:]])


def git_commit() -> str:
    """The short commit of the checkout, with ``+dirty`` when tracked files differ; ``unknown``
    outside git (a copied tree, a lent machine)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0 or not commit.stdout.strip():
            return "unknown"
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO, capture_output=True, timeout=10)
        return commit.stdout.strip() + ("+dirty" if dirty.returncode == 1 else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict[str, Any]:
    """What the figures were measured on, without the host's name: cores, memory, GPUs."""
    memory_gb = None
    try:
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError, AttributeError):
        pass  # not a POSIX system that says
    gpus = gpu_names()
    cores = os.cpu_count()
    parts = [f"{cores}-core {platform.machine() or 'CPU'}", f"{memory_gb:.0f} GB" if memory_gb else None]
    parts.append(f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU")
    return {
        "cores": cores,
        "memory_gb": memory_gb,
        "gpus": gpus,
        "system": platform.system(),
        "python": platform.python_version(),
        "description": ", ".join(part for part in parts if part),
    }


def gpu_names() -> list[str]:
    """The GPUs ``nvidia-smi`` lists ([] without one); asked of the driver so that torch, and a
    CUDA context, stay out of the recording process."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return []
    try:
        listing = subprocess.run(
            [executable, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [name.strip() for name in listing.stdout.splitlines() if name.strip()] if listing.returncode == 0 else []


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
