"""One command for a lent GPU machine as it is: its own python3, nothing installed, no network.

    PYTHONPATH=$PWD python3 bench/gpu_check.py --out $OUT                  # at most 540 s of wall time
    PYTHONPATH=$PWD python3 bench/gpu_check.py --out /tmp/gc --smoke       # every part on CPU, tiny sizes

Parts, most valuable first, each in a subprocess of its own (``--part NAME``) with its own
deadline (what is left of ``--budget-s``, capped per part):

    environment  versions, device, memory; measured bf16 matmul TFLOP/s and device-to-host GB/s
                 into pinned and pageable memory
    throughput   one-GPU tokens/s and MFU of llama3-1b and llama3-8b shapes, bf16 eager, compiled,
                 compiled + float8: meshpilot's Trainer (no Ray) against a reference on the same
                 shapes, tokens, dtype and optimizer (bench/support/gpu_check_run.py)
    memory       peak device memory against the planner's estimate for the same layout
    checkpoint   stall and snapshot cost of chunked pinned staging at 1.5B and 8B state sizes, and the
                 snapshot interval the adaptive cadence picks from them
    ray          with Ray importable (or its wheels in --wheels): one rank killed and restored on the
                 same GPU (tests/gpu/test_recovery.py) and bench/gpu.py --quick

After every part ``DIR/gpu_check.json`` is rewritten (a temporary file, then a rename), so a kill
at any moment leaves the figures so far. A part that no longer fits in the budget, or needs what
this machine lacks (CUDA, torchao, Ray), is recorded as skipped, with why; one that runs past
its deadline is killed and recorded as timed out with what it had written so far. ``--wheels``
(default ``.gpu-wheels/`` when it exists; fetched beforehand by ``bench/support/gpu_wheels.py``)
is unpacked into a temporary directory put first on the parts' ``sys.path``. The last stdout line
is the whole JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A part's deadline counts from here, before it imports torch (seconds on a cold machine).
STARTED = time.monotonic()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, emit, run_process_group  # noqa: E402

RESULT_FILE = "gpu_check.json"
DEFAULT_WHEELS = REPO / ".gpu-wheels"
# The parent kills a part this long after the deadline it gave it (the part plans within it).
KILL_GRACE_S = 5.0
# Kept back from the budget for the parent's own start, unpacking and last write.
PARENT_RESERVE_S = 5.0


@dataclass(frozen=True)
class PartPlan:
    """How long a part may take at most (``cap_s``) and at least needs to be worth starting."""

    name: str
    cap_s: float
    min_s: float
    smoke_cap_s: float = 25.0
    smoke_min_s: float = 3.0


# Most valuable first: a budget that runs out drops the last ones.
PARTS: tuple[PartPlan, ...] = (
    PartPlan("environment", cap_s=60, min_s=15),
    # Its smoke takes 5-10 s alone here; the cap is for a machine that others load too.
    PartPlan("throughput", cap_s=360, min_s=60, smoke_cap_s=90),
    PartPlan("memory", cap_s=60, min_s=30),
    PartPlan("checkpoint", cap_s=90, min_s=30),
    PartPlan("ray", cap_s=240, min_s=90),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for gpu_check.json and each part's figures")
    parser.add_argument(
        "--smoke", "--quick", action="store_true", help="every part on CPU with tiny sizes (under a minute)"
    )
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall time of the whole check (default 540)")
    parser.add_argument("--wheels", default=None, help="folder of wheels to put on the parts' sys.path")
    parser.add_argument("--no-wheels", action="store_true", help="ignore .gpu-wheels/ (the parts see python3's own)")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # internal: run one part
    parser.add_argument("--deadline-s", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part is not None:
        from bench.support.gpu_check_parts import run_part

        run_part(args.part, out=Path(args.out), smoke=args.smoke, deadline_s=args.deadline_s or 60.0, started=STARTED)
        return
    try:
        wheels = None if args.no_wheels else wheels_folder(args.wheels)
        if args.budget_s <= PARENT_RESERVE_S:
            raise ValueError(f"--budget-s={args.budget_s:g} must be more than {PARENT_RESERVE_S:g} s")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as error:
        print(f"bench/gpu_check.py: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    emit(run_check(out, smoke=args.smoke, budget_s=args.budget_s, wheels=wheels))


def wheels_folder(given: str | None) -> Path | None:
    """The wheels to unpack: ``--wheels`` (which must exist), else ``.gpu-wheels/`` if present."""
    if given is None:
        return DEFAULT_WHEELS if DEFAULT_WHEELS.is_dir() else None
    folder = Path(given)
    if not folder.is_dir() or not any(folder.glob("*.whl")):
        raise ValueError(f"--wheels {given}: no .whl files there; fetch them with python bench/support/gpu_wheels.py")
    return folder


def run_check(out: Path, *, smoke: bool, budget_s: float, wheels: Path | None) -> dict[str, Any]:
    """Driver of the check (this process): every part in order, each a subprocess; returns the
    whole result, which is also on disk after every part."""
    started = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "gpu_check",
        "smoke": smoke,
        "budget_s": budget_s,
        "python": sys.executable,
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wheels": None,
        "parts": {},
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        env = dict(os.environ)
        if smoke:  # on the CPU even where there is a GPU
            env["CUDA_VISIBLE_DEVICES"] = ""
        paths = [str(REPO)]
        if wheels is not None:
            site = Path(scratch) / "site"
            result["wheels"] = unpack_wheels(wheels, site)
            paths.insert(0, str(site))
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
        for plan in PARTS:
            left = budget_s - (time.monotonic() - started) - PARENT_RESERVE_S - KILL_GRACE_S
            cap, least = (plan.smoke_cap_s, plan.smoke_min_s) if smoke else (plan.cap_s, plan.min_s)
            if left < least:
                record: dict[str, Any] = {
                    "status": "skipped",
                    "reason": f"{left:.0f} s of the {budget_s:g} s budget left; this part needs at least {least:g} s",
                }
            else:
                record = run_part_process(plan.name, out, smoke=smoke, deadline_s=min(cap, left), env=env)
            result["parts"][plan.name] = record
            result["elapsed_s"] = round(time.monotonic() - started, 1)
            write_atomically(out / RESULT_FILE, result)
            print(f"{plan.name}: {record['status']} {record.get('reason', '')}".rstrip(), flush=True)
    return result


def run_part_process(name: str, out: Path, *, smoke: bool, deadline_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Run one part as ``bench/gpu_check.py --part NAME``; its record (its last stdout line), or
    what it wrote before it was killed or failed."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--out", str(out)]
    argv += ["--deadline-s", f"{deadline_s:.1f}"] + (["--smoke"] if smoke else [])
    partial_file = out / "parts" / f"{name}.json"
    partial_file.unlink(missing_ok=True)
    began = time.monotonic()
    returncode, stdout, stderr = run_process_group(argv, timeout=deadline_s + KILL_GRACE_S, env=env)
    printed = last_json_line(stdout)
    if returncode == 0 and printed is not None:
        record = printed
    elif returncode is None:
        record = read_partial(partial_file)
        record.update(status="timed_out", reason=f"killed after its {deadline_s:.0f} s deadline")
        record["log_tail"] = tail_of(stdout, stderr)
    else:
        record = read_partial(partial_file)
        record.update(status="failed", reason=f"exit code {returncode}")
        record["log_tail"] = tail_of(stdout, stderr)
    record["seconds"] = round(time.monotonic() - began, 1)
    record["deadline_s"] = round(deadline_s, 1)
    return record


def read_partial(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def last_json_line(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
    return None


def tail_of(stdout: str, stderr: str, limit: int = 2000) -> str:
    return (stdout + stderr)[-limit:]


def write_atomically(path: Path, value: dict[str, Any]) -> None:
    """A reader (or a kill) never sees a half-written file: write beside it, then rename."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(value, indent=1))
    os.replace(temporary, path)


def unpack_wheels(folder: Path, site: Path) -> dict[str, Any]:
    """Unpack every wheel in ``folder`` into ``site`` (a plain directory on ``sys.path`` is all a
    wheel needs); file modes come from the archive, so Ray's binaries stay executable."""
    site.mkdir(parents=True, exist_ok=True)
    names = []
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                target = archive.extract(info, site)
                mode = info.external_attr >> 16
                if mode & stat.S_IXUSR:
                    os.chmod(target, os.stat(target).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        names.append(wheel.name)
    size = sum(wheel.stat().st_size for wheel in folder.glob("*.whl"))
    return {"folder": str(folder), "files": names, "mib": round(size / 2**20, 1)}


if __name__ == "__main__":
    main()
