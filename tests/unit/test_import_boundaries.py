"""The recipes and the CLI are clients of the public core: they import only what ``kafka2pc`` exports.

Every module under ``recipes/`` (installed as ``kafka2pc.recipes``) and
``cli/`` (``kafka2pc.cli``) is parsed with :mod:`ast`, type-checking-only
imports included.  An import is allowed when it is

* relative, or of the importer's own package (``kafka2pc.recipes.*`` from a
  recipe, ``kafka2pc.cli.*`` from the CLI), private modules included;
* ``from kafka2pc import name`` with ``name`` in ``kafka2pc.__all__``;
* of a public module (no path component starting with ``_``), and every name
  taken from it is in that module's ``__all__`` or is a public submodule.

Anything else (``kafka2pc._recovery``, ``kafka2pc._control``, a name the core
does not export) means the core must grow a public entry point instead.  The
one exception is the distribution's own plumbing, :data:`PLUMBING`: the error
naming a missing extra and the deprecation warnings of renamed 0.1 names,
which every subpackage raises the same way; no user calls them.  (The TCP
pre-flight of the bootstrap addresses is public: ``kafka2pc.unreachable_reason``.)
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

import kafka2pc

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {
    "kafka2pc": ROOT / "kafka2pc",
    "kafka2pc.recipes": ROOT / "recipes",
    "kafka2pc.cli": ROOT / "cli",
}
CLIENTS = {"kafka2pc.recipes": ROOT / "recipes", "kafka2pc.cli": ROOT / "cli"}
PLUMBING = {"kafka2pc._extras", "kafka2pc._deprecation"}


def module_file(module: str) -> Path | None:
    """The source file of a ``kafka2pc...`` module (a package's ``__init__.py``), ``None`` if there is none."""
    for prefix in sorted(PACKAGE_DIRS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            base = PACKAGE_DIRS[prefix].joinpath(*module[len(prefix):].lstrip(".").split(".")) if module != prefix \
                else PACKAGE_DIRS[prefix]
            if base.is_dir() and (base / "__init__.py").is_file():
                return base / "__init__.py"
            if base.with_suffix(".py").is_file():
                return base.with_suffix(".py")
            return None
    return None


def declared_all(path: Path) -> set[str] | None:
    """The names in the module's literal ``__all__`` (``None`` if it declares none)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            value = ast.literal_eval(node.value)
            return {str(name) for name in value}
    return None


def violations(source: str, filename: str, own_package: str) -> list[str]:
    """What is wrong with the kafka2pc imports of one client module (empty: nothing)."""
    found: list[str] = []
    tree = ast.parse(source, filename=filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                problem = check_module(alias.name, own_package)
                if problem:
                    found.append(f"{filename}:{node.lineno}: import {alias.name}: {problem}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            module = node.module
            problem = check_module(module, own_package)
            if problem:
                found.append(f"{filename}:{node.lineno}: from {module} import ...: {problem}")
                continue
            if not module.startswith("kafka2pc") or is_own(module, own_package):
                continue
            for alias in node.names:
                problem = check_name(module, alias.name)
                if problem:
                    found.append(f"{filename}:{node.lineno}: from {module} import {alias.name}: {problem}")
    return found


def is_own(module: str, own_package: str) -> bool:
    return module == own_package or module.startswith(own_package + ".")


def check_module(module: str, own_package: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "kafka2pc" or is_own(module, own_package) or module in PLUMBING:
        return None
    private = [p for p in parts[1:] if p.startswith("_")]
    if private:
        return f"private module {'.'.join(parts[:parts.index(private[0]) + 1])}"
    if module_file(module) is None:
        return "no such kafka2pc module"
    return None


def check_name(module: str, name: str) -> str | None:
    if module == "kafka2pc":
        return None if name in kafka2pc.__all__ else "not in kafka2pc.__all__"
    path = module_file(module)
    assert path is not None
    exported = declared_all(path)
    if exported is not None and name in exported:
        return None
    if not name.startswith("_") and module_file(f"{module}.{name}") is not None:
        return None  # a public submodule
    return f"not in {module}.__all__" if exported is not None else f"{module} declares no __all__"


def client_modules() -> list[tuple[Path, str]]:
    return [
        (path, package)
        for package, directory in CLIENTS.items()
        for path in sorted(directory.rglob("*.py"))
    ]


def test_there_are_client_modules_to_check() -> None:
    names = {p.relative_to(ROOT).as_posix() for p, _ in client_modules()}
    assert {"cli/__init__.py", "recipes/spark/_completion.py", "recipes/dual_write/_recovery.py"} <= names


@pytest.mark.parametrize(("path", "package"), client_modules(), ids=lambda v: str(v.relative_to(ROOT))
                         if isinstance(v, Path) else "")
def test_client_module_imports_only_the_public_core(path: Path, package: str) -> None:
    problems = violations(path.read_text(), str(path.relative_to(ROOT)), package)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from kafka2pc._recovery import plan", "private module kafka2pc._recovery"),
        ("import kafka2pc._control", "private module kafka2pc._control"),
        ("from kafka2pc._control._retry import Deadline", "private module kafka2pc._control"),
        ("from kafka2pc import LIBRDKAFKA_MAX_TRANSACTION_TIMEOUT_MS", "not in kafka2pc.__all__"),
        ("from kafka2pc.aio import SerialWorker", "not in kafka2pc.aio.__all__"),
        ("from kafka2pc.recipes.spark._completion import complete", "private module kafka2pc.recipes.spark"),
        ("from kafka2pc.nonexistent import x", "no such kafka2pc module"),
    ],
)
def test_the_check_catches_private_imports(source: str, expected: str) -> None:
    found = violations(source, "cli/example.py", "kafka2pc.cli")
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(
    "source",
    [
        "from kafka2pc import TransactionAdmin, PreparedTxnState",
        "from kafka2pc.aio import AsyncTransactionAdmin",
        "from kafka2pc.recipes.dual_write import define_state_table, store_for",
        "from kafka2pc.cli._errors import ExitCode",
        "from kafka2pc._extras import missing_extra",
        "from kafka2pc._deprecation import seconds_from_ms",
        "from ._statedb import RowLocks",
        "import sqlalchemy",
    ],
)
def test_the_check_allows_public_and_own_imports(source: str) -> None:
    assert violations(source, "cli/example.py", "kafka2pc.cli") == []


# -- no import cycle ------------------------------------------------------------------
# Every module of ``kafka2pc`` (the core, its subpackages, ``kafka2pc.recipes``
# and ``kafka2pc.cli``) is a node; an edge is an import written in the module,
# resolved to the kafka2pc module it names (``from pkg import mod`` names the
# submodule when there is one).  Two graphs are checked:
#
# * runtime: imports that run, at module level or inside a function, except
#   those under ``if TYPE_CHECKING:``;
# * typing: the same plus the ``TYPE_CHECKING`` imports, so that annotations do
#   not hide two modules that need each other.
#
# The package a module sits in is not an edge of its own (importing
# ``kafka2pc._x`` runs ``kafka2pc/__init__.py`` first, which Python handles).


def all_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, directory in PACKAGE_DIRS.items():
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _under_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path, modules: dict[str, Path], *, typing: bool) -> set[str]:
    """The kafka2pc modules ``module`` imports (``typing``: ``TYPE_CHECKING`` imports included)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(name: str) -> None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _under_type_checking(node):
            if typing:
                for child in node.body:
                    visit(child)
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    resolve(f"{target}.{alias.name}")
                else:
                    resolve(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(_parsed(path))
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or ``None`` when there is none."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = []
        on_path: set[str] = set()
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return [*path[path.index(child):], child]
            elif child not in done:
                stack.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
                on_path.add(child)
    return None


@pytest.mark.parametrize("typing", [False, True], ids=["runtime", "with-type-checking"])
def test_no_import_cycle(typing: bool) -> None:
    modules = all_modules()
    graph = {name: imports_of(name, path, modules, typing=typing) for name, path in modules.items()}
    assert graph["kafka2pc.recipes.dual_write._writer"], "the graph has the recipes' relative imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
