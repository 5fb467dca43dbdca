"""The layout rules a contributor relies on, checked on the source itself (no imports run).

    python -m pytest tests/unit/test_code_structure.py -q

The one-way imports (orchestrator -> elastic, orchestrator -> workers -> checkpointing; elastic
pure), and private torch / Ray internals only inside their fenced modules: named through the
library (``torch._C._x``, ``from ray._private import state``) or reached through one of its
objects (``tensor._local_tensor``, ``mesh._flatten(...)``). Sizes are a review matter; ruff's
complexity rules (pyproject.toml) catch tangled functions.
"""

from __future__ import annotations

import ast
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "workers", "checkpointing", "elastic")
TORCH_FENCE = "checkpointing/torch_compat.py"
RAY_FENCES = ("orchestrator/driver/ray_compat.py", "workers/ray_compat.py")
FENCES = (TORCH_FENCE, *RAY_FENCES)
# Private names of the standard library used as its documentation shows: not torch / Ray internals.
STDLIB_PRIVATES = (
    "argparse._SubParsersAction",  # the type of add_subparsers()'s result; argparse names no public one
    "sys._current_frames",  # documented in the sys module: the stack dump of a stuck rank
    "os._exit",  # documented in the os module: a detached actor whose driver lease ran out ends at once
    "parser._actions",  # a parser's arguments: argparse names no public accessor (the CLI reference reads them)
    "subcommands._choices_actions",  # each sub-command's help line, the same (the CLI reference lists them)
)


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


@functools.cache  # each module is parsed once per test session, whichever tests read it
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


def _is_private(name: str) -> bool:
    """``_name`` or ``_name_`` (enum's sunder names too), not a dunder and not the bare ``_``."""
    return name.startswith("_") and not name.startswith("__") and name != "_"


@dataclass
class _PrivateNames:
    """The private attribute names one module defines on its own objects, and those it reaches."""

    defined: set[str] = field(default_factory=set)
    reached: list[tuple[str, str, int]] = field(default_factory=list)  # (name, expression, line)


def _scope_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a module or class body, into ``if`` / ``try`` / ``with`` but not into defs."""
    for statement in body:
        yield statement
        if not isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for inner in ("body", "orelse", "finalbody", "handlers"):
                yield from _scope_statements(getattr(statement, inner, []))


def _scope_definitions(tree: ast.AST) -> set[str]:
    """Private names assigned in a module or class body (module globals that another module reaches as
    ``module._name``, class attributes, dataclass fields) and the names a class lists in ``__slots__``."""
    scopes = [tree] + [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    defined = set()
    for scope in scopes:
        for statement in _scope_statements(getattr(scope, "body", [])):
            if isinstance(statement, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                names = {node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name)}
                defined |= {name for name in names if _is_private(name)}
                if "__slots__" in names and statement.value is not None:
                    defined |= {
                        node.value
                        for node in ast.walk(statement.value)
                        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_private(node.value)
                    }
    return defined


def _named_attribute(node: ast.Call) -> tuple[str, bool] | None:
    """(``_name``, set on ``self``) for ``getattr(x, "_name")`` and its kin, else None."""
    function = ast.unparse(node.func)
    if function not in ("getattr", "hasattr", "setattr", "delattr", "object.__setattr__") or len(node.args) < 2:
        return None
    name = node.args[1]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str) and _is_private(name.value)):
        return None
    on_self = function in ("setattr", "object.__setattr__") and ast.unparse(node.args[0]) in ("self", "cls")
    return name.value, on_self


def _private_names(tree: ast.AST) -> _PrivateNames:
    """Every private attribute a module defines (``self._x = ...``, ``def _x``, ``class _X``, a module or
    class level ``_x``, ``__slots__``) and every one it reaches on any object (``x._y``, ``getattr(x, "_y")``).
    """
    found = _PrivateNames(defined=_scope_definitions(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and _is_private(node.name):
            found.defined.add(node.name)
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if on_self and isinstance(node.ctx, ast.Store):
                found.defined.add(node.attr)
            else:
                found.reached.append((node.attr, ast.unparse(node), node.lineno))
        elif isinstance(node, ast.Call) and (named := _named_attribute(node)) is not None:
            name, on_self = named
            if on_self:
                found.defined.add(name)
            else:
                found.reached.append((name, ast.unparse(node), node.lineno))
    return found


def _foreign_private_attributes(paths: list[Path]) -> list[str]:
    """``where:line expression`` for each private attribute reached that no module of ours defines."""
    per_module = {_relative(path): _private_names(_parse(path)) for path in paths}
    ours = set().union(*(names.defined for names in per_module.values()))
    return [
        f"{where}:{line} {expression}"
        for where, names in per_module.items()
        for name, expression, line in names.reached
        if name not in ours and expression not in STDLIB_PRIVATES
    ]


def test_private_attributes_of_library_objects_only_in_the_fences() -> None:
    """``tensor._local_tensor`` or ``mesh._flatten(...)`` names no module, so the checks above miss it:
    a private attribute that our own code does not define belongs to torch, Ray or another library."""
    leaks = [hit for hit in _foreign_private_attributes(_modules(*PACKAGES)) if hit.split(":")[0] not in FENCES]
    assert leaks == [], f"private attributes of library objects outside {FENCES}: wrap them in a fence function"


def test_the_object_fence_tells_our_privates_from_a_library_s() -> None:
    source = """
class Cache:
    __slots__ = ("_slot",)
    _shared = 0

    def __init__(self, mesh):
        self._key = None
        object.__setattr__(self, "_frozen", True)
        self._mesh = mesh._flatten("dp")

    def _helper(self, tensor, group):
        other = Cache(None)
        return other._key, other._slot, other._frozen, Cache._shared, tensor._local_tensor, getattr(group, "_pg")
"""
    names = _private_names(ast.parse(source))
    foreign = [expression for name, expression, _ in names.reached if name not in names.defined]
    assert foreign == ["mesh._flatten", "tensor._local_tensor", "getattr(group, '_pg')"]


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
