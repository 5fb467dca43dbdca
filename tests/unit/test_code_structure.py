"""The layout rules a contributor relies on, checked on the source itself (no imports run).

    python -m pytest tests/unit/test_code_structure.py -q

Sizes (no module of the four packages over 500 lines, no function over 60), the one-way
imports (orchestrator -> elastic, orchestrator -> workers -> checkpointing; elastic pure), and
private torch / Ray internals only inside their one fenced module each.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "workers", "checkpointing", "elastic")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
TORCH_FENCE = "checkpointing/torch_compat.py"
RAY_FENCES = ("orchestrator/driver/ray_compat.py", "workers/ray_compat.py")


def _modules(*packages: str) -> list[Path]:
    return sorted(path for package in packages for path in (REPO / package).rglob("*.py"))


def _relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _imported_modules(tree: ast.AST) -> list[tuple[str, int]]:
    """Every module an import statement names (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _attribute_chains(tree: ast.AST) -> list[tuple[str, int]]:
    """Dotted attribute uses like ``torch._C._clear_cache`` or ``dist.distributed_c10d._world``."""
    chains = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                parts.append(value.id)
                chains.append((".".join(reversed(parts)), node.lineno))
    return chains


def _parse(path: Path) -> ast.AST:
    """Parse one module, retrying CPython 3.11's spurious ``SystemError`` from ``ast.parse``.

    CPython 3.11's AST converter keeps its recursion depth in interpreter-wide state, so a
    parse on another thread of this pytest process (a library's background thread left by an
    earlier test) can make this one fail with "AST constructor recursion depth mismatch"
    although the source is fine (seen once in CI). A fresh parse succeeds.
    """
    source = path.read_text(encoding="utf-8")
    for _ in range(4):
        try:
            return ast.parse(source, filename=str(path))
        except SystemError:
            time.sleep(0.05)
    return ast.parse(source, filename=str(path))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_500_lines(package: str) -> None:
    long = {_relative(p): n for p in _modules(package) if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: split them by responsibility"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_over_60_lines(package: str) -> None:
    long = {}
    for path in _modules(package):
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{_relative(path)}:{node.lineno} {node.name}"] = length
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines"


def _imports_from(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{_relative(path)}:{line} imports {name}"
        for path in paths
        for name, line in _imported_modules(_parse(path))
        if any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden)
    ]


def test_imports_go_one_way() -> None:
    assert _imports_from(_modules("elastic"), ("ray", "torch", "orchestrator", "checkpointing")) == []
    # elastic may read the model's shape from the plain-value spec package, nothing else of workers.
    elastic_to_workers = [hit for hit in _imports_from(_modules("elastic"), ("workers",)) if "workers.spec" not in hit]
    assert elastic_to_workers == []
    assert _imports_from(_modules("workers", "checkpointing"), ("orchestrator",)) == []
    assert _imports_from(_modules("checkpointing"), ("workers",)) == []


def test_driver_takes_only_the_actor_class_from_workers_actor() -> None:
    uses = [
        (_relative(path), name)
        for path in _modules("orchestrator")
        for name, _ in _imported_modules(_parse(path))
        if name.startswith("workers.actor")
    ]
    assert all(name in ("workers.actor", "workers.actor.RankActor") for _, name in uses), uses
    assert {where for where, _ in uses} <= {"orchestrator/driver/worker_group.py"}


def test_driver_never_imports_torch() -> None:
    assert _imports_from(_modules("orchestrator"), ("torch",)) == []


def _private_uses(paths: list[Path], roots: tuple[str, ...]) -> list[str]:
    hits = []
    for path in paths:
        tree = _parse(path)
        names = _imported_modules(tree) + _attribute_chains(tree)
        for name, line in names:
            parts = name.split(".")
            if parts[0] in roots and any(part.startswith("_") and not part.startswith("__") for part in parts[1:]):
                hits.append(f"{_relative(path)}:{line} {name}")
    return hits


def test_private_torch_only_in_its_fence() -> None:
    paths = [p for p in _modules(*PACKAGES) if _relative(p) != TORCH_FENCE]
    # ``torch._dynamo`` is imported (not used) at actor start-up to pay its import early.
    hits = [hit for hit in _private_uses(paths, ("torch", "dist")) if not hit.endswith(" torch._dynamo")]
    assert hits == [], f"private torch internals outside {TORCH_FENCE}"


def test_private_ray_only_in_its_fence() -> None:
    paths = [p for p in _modules(*PACKAGES) if _relative(p) not in RAY_FENCES]
    assert _private_uses(paths, ("ray",)) == [], f"private Ray internals outside {RAY_FENCES}"


def test_every_package_is_installed() -> None:
    """pyproject lists the packages (the ``meshpilot`` mapping needs a list): none may be missing."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        _relative(init.parent).replace("/", ".")
        for package in PACKAGES
        for init in (REPO / package).rglob("__init__.py")
    }
    assert on_disk - listed == set(), "add these packages to [tool.setuptools] packages in pyproject.toml"
    assert "meshpilot" in listed


def test_the_driver_starts_without_importing_torch():
    """`meshpilot train` and `import meshpilot` leave torch to the rank processes (~2 s of the
    driver's start-up here); the family names load it on first use."""
    import subprocess
    import sys

    code = (
        "import sys, meshpilot, orchestrator.cli, orchestrator.driver.controller, workers.actor; "
        "assert 'torch' not in sys.modules, 'torch was imported'; "
        "assert meshpilot.ModelFamily.__name__ == 'ModelFamily' and 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
