"""Fetch the wheels the GPU check carries to a lent machine that has no network and no pip index.

    python bench/support/gpu_wheels.py            # torchao + torchtitan (and what torchtitan imports)
    python bench/support/gpu_wheels.py --ray      # + Ray 2.60 (repacked) and its core dependencies
    python bench/support/gpu_wheels.py --ray --boto3 --out .gpu-wheels
    make gpu-wheels                               # the first line

Run here, with network, before the lease; then carry the folder (``.gpu-wheels/``, ignored by git)
with the tree: the ``run`` tool's ``carry`` list names it, and ``bench/gpu_check.py`` unpacks it
onto its parts' ``sys.path``. What travels must stay under 64 MiB. Ray's wheel alone is 75.6 MiB,
so it is repacked without what a headless job on one machine never loads (its Java jar, the
dashboard's browser build, RLlib, Serve, the LLM library and every ``tests`` folder): 39.6 MiB.
Its core dependencies the lent machine lacks come along (msgpack, jsonschema, requests, ...):
46.5 MiB in all. boto3 with botocore is another 17 MiB, fetched only with ``--boto3`` (62.8 MiB
with Ray: it fits, barely). The folder's size is printed; one over the limit is refused (exit 2).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
LIMIT_BYTES = 64 * 2**20
LENT_PYTHON = "3.11"
LENT_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
# torchao: float8 training; torchtitan: tried as the reference (0.3.0 needs what follows to import at all).
BASE = ["torchao==0.18.0", "torchtitan==0.3.0", "spmd_types==0.2.3", "tyro", "einops", "docstring-parser", "typeguard"]
# Ray's core requirements (its METADATA) that the lent machine's venv does not hold, with theirs.
RAY = [
    "ray==2.60.0",
    "msgpack",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
    "attrs",
    "requests",
    "certifi",
    "charset-normalizer",
    "idna",
    "urllib3",
    "protobuf",
]
BOTO3 = ["boto3", "botocore", "s3transfer", "jmespath"]
# Parts of Ray's wheel a one-machine, headless job never loads.
RAY_DROPPED = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/serve/", "ray/llm/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / ".gpu-wheels"))
    parser.add_argument("--ray", action="store_true", help="also Ray 2.60 (repacked) and its core dependencies")
    parser.add_argument("--boto3", action="store_true", help="also boto3 and botocore (17 MiB)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = BASE + (RAY if args.ray else []) + (BOTO3 if args.boto3 else [])
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(out)]
    # The lent machine's interpreter and platform, whatever runs this.
    command += ["--python-version", LENT_PYTHON, "--implementation", "cp", "--abi", f"cp{LENT_PYTHON.replace('.', '')}"]
    command += [arg for platform in LENT_PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([*command, *wanted], check=True)
    for wheel in out.glob("ray-*.whl"):
        repack(wheel, RAY_DROPPED)
    total = sum(wheel.stat().st_size for wheel in out.glob("*.whl"))
    for wheel in sorted(out.glob("*.whl"), key=lambda path: -path.stat().st_size):
        print(f"{wheel.stat().st_size / 2**20:7.1f} MiB  {wheel.name}")
    print(f"{total / 2**20:7.1f} MiB  in {out} (the limit on what travels: {LIMIT_BYTES / 2**20:.0f} MiB)")
    if total > LIMIT_BYTES:
        print(f"gpu_wheels: {out} holds {total / 2**20:.1f} MiB, over the 64 MiB that may travel; drop --boto3")
        raise SystemExit(2)


def repack(wheel: Path, dropped: tuple[str, ...]) -> None:
    """Rewrite ``wheel`` without the members under ``dropped`` (as a zip it is unpacked, not pip-installed)."""
    kept = wheel.with_suffix(".repacked")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(kept, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target:
        for info in source.infolist():
            if info.filename.startswith(dropped) or "/tests/" in info.filename:
                continue
            target.writestr(info, source.read(info), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    before = wheel.stat().st_size
    kept.replace(wheel)
    print(f"repacked {wheel.name}: {before / 2**20:.1f} -> {wheel.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
