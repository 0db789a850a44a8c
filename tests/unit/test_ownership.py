"""Objects own their state: no inheritance towers, the asyncio twins keep to the public seam, fields stay home.

* A public class (of every public module: the core, the recipes and the CLI,
  and the :class:`~kafka2pc._control.ControlPlane` a producer or an admin
  hands out) has at most one kafka2pc class in its method resolution order,
  itself: its parts are collaborators it holds, not bases.  Exceptions,
  Protocols and ``Generic`` are not counted.
* The asyncio twins (``kafka2pc/aio``, ``recipes/dual_write/aio``) reach no
  private member of another object: no ``self._sync._x``, no ``other._x``.
* A class's fields (``self.x = ...``) are set only in the file that declares
  the class: no base class in another file whose fields a subclass sets, and
  no ``other._x = ...`` outside the file of the class that declares ``_x``.
* The pool and the writer call each other by public names only.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import subprocess
import sys
import typing
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

import kafka2pc
from kafka2pc._control import ControlPlane

ROOT = Path(kafka2pc.__file__).resolve().parents[1]
PACKAGES = [ROOT / "kafka2pc", ROOT / "recipes", ROOT / "cli"]
"""The source trees (``recipes`` and ``cli`` are installed as ``kafka2pc.recipes`` and ``kafka2pc.cli``)."""
TWIN_DIRS = [ROOT / "kafka2pc" / "aio", ROOT / "recipes" / "dual_write" / "aio"]
POOL_AND_WRITER = ["_pool.py", "_slots.py", "_orphans.py", "_pipeline.py", "_writer.py", "_runner.py"]
"""The pool's files and the writer's (``recipes/dual_write``)."""

PUBLIC_MODULES = [
    "kafka2pc",
    "kafka2pc.aio",
    "kafka2pc.otel",
    "kafka2pc.testing",
    "kafka2pc.recipes.dual_write",
    "kafka2pc.recipes.dual_write.aio",
    "kafka2pc.recipes.spark",
    "kafka2pc.recipes.django",
    "kafka2pc.recipes.django.testing",
    "kafka2pc.recipes.django.health",
    "kafka2pc.cli",
]
DJANGO_CONFIGURED_MODULES = [
    "kafka2pc.recipes.django.models",
    "kafka2pc.recipes.django.admin",
    "kafka2pc.recipes.django.apps",
]
"""Public modules that import only under configured Django settings: checked in a child process."""
THIRD_PARTY_PRIVATE = {"_retrieve_proxy_for_target"}
"""Private API of a library underneath (SQLAlchemy's proxy of a sync connection), not of a kafka2pc object."""
LIBRARY_SHIMS = {"kafka2pc/_control/_kafka_python.py"}
"""The one module that reaches into kafka-python's client (its ``_closed``, ``_manager``): not kafka2pc objects."""


def project_bases(cls: type) -> list[str]:
    return [
        f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__
        if c.__module__.split(".")[0] == "kafka2pc" and c is not typing.Generic
        and not getattr(c, "_is_protocol", False)
    ]


def public_classes() -> list[type]:
    found: list[type] = [ControlPlane]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for module_name in PUBLIC_MODULES:
            module = importlib.import_module(module_name)
            for name in module.__all__:
                obj = getattr(module, name)
                if inspect.isclass(obj) and not issubclass(obj, BaseException) and obj not in found:
                    found.append(obj)
    return found


@pytest.mark.parametrize("cls", public_classes(), ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_public_class_has_no_project_base(cls: type) -> None:
    assert len(project_bases(cls)) <= 1, project_bases(cls)


_CHILD = """
import importlib, inspect, json, sys, typing
import django
django.setup()
out = {}
for module_name in sys.argv[1:]:
    module = importlib.import_module(module_name)
    for name, obj in vars(module).items():
        if inspect.isclass(obj) and obj.__module__ == module_name and not name.startswith("_"):
            out[f"{module_name}.{name}"] = [
                f"{c.__module__}.{c.__qualname__}" for c in obj.__mro__
                if c.__module__.split(".")[0] == "kafka2pc" and c is not typing.Generic
                and not getattr(c, "_is_protocol", False)
            ]
print(json.dumps(out))
"""


def test_public_classes_of_the_django_app_modules_have_no_project_base() -> None:
    import django  # noqa: F401 - a dev dependency: its absence fails this test instead of skipping it

    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "djtest.settings",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "django"), str(ROOT / "tests")])}
    child = subprocess.run([sys.executable, "-c", _CHILD, *DJANGO_CONFIGURED_MODULES], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    classes = json.loads(child.stdout)
    assert any(name.endswith(".TransactionStateAdmin") for name in classes)  # the child saw the admin
    assert {name: bases for name, bases in classes.items() if len(bases) > 1} == {}


# -- the source, by AST --------------------------------------------------------------------------------
def sources() -> list[Path]:
    return sorted(p for tree in PACKAGES for p in tree.rglob("*.py") if "migrations" not in p.parts)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def private_reaches(path: Path) -> Iterator[tuple[int, str]]:
    """``other._x`` (read, written or called) where ``other`` is not ``self``/``cls`` or a module."""
    tree = ast.parse(path.read_text())
    modules = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and not _is_self(node.value)
                and node.attr not in THIRD_PARTY_PRIVATE
                and not (isinstance(node.value, ast.Name) and node.value.id in modules)
                and not (isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super")):
            yield node.lineno, ast.unparse(node)


@pytest.mark.parametrize("path", [p for d in TWIN_DIRS for p in sorted(d.glob("*.py"))], ids=_rel)
def test_asyncio_twins_reach_no_private_member_of_another_object(path: Path) -> None:
    assert [f"{_rel(path)}:{line}: {text}" for line, text in private_reaches(path)] == []


@pytest.mark.parametrize("name", POOL_AND_WRITER)
def test_the_pool_and_the_writer_use_no_private_member_of_each_other(name: str) -> None:
    path = ROOT / "recipes" / "dual_write" / name
    declared = _fields_and_methods(path)
    foreign = [f"{_rel(path)}:{line}: {text}" for line, text in private_reaches(path)
               if text.rsplit(".", 1)[1] not in declared]
    assert foreign == []


def _fields_and_methods(path: Path) -> set[str]:
    """The private names the classes of ``path`` declare (methods, and fields set on ``self``)."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
        names.update(f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
        names.update(f.target.id for f in cls.body if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name))
        names.update(field for _, field in _self_fields(cls))
    return names


def _self_fields(cls: ast.ClassDef) -> Iterator[tuple[int, str]]:
    """``(line, name)`` of every ``self.name = ...`` (plain, annotated or augmented) in ``cls``'s own methods."""
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple)
                                                                 else [target])]
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and _is_self(target.value):
                    yield node.lineno, target.attr


def _declarations() -> tuple[dict[str, list[tuple[Path, ast.ClassDef]]], dict[str, set[Path]]]:
    """Classes by name, and for each private field name the files whose classes set it on ``self``."""
    classes: dict[str, list[tuple[Path, ast.ClassDef]]] = defaultdict(list)
    field_homes: dict[str, set[Path]] = defaultdict(set)
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name].append((path, node))
                for _, name in _self_fields(node):
                    field_homes[name].add(path)
    return classes, field_homes


def _project_bases(cls: ast.ClassDef, classes: dict[str, list[tuple[Path, ast.ClassDef]]],
                   seen: set[int] | None = None) -> Iterator[tuple[Path, ast.ClassDef]]:
    seen = set() if seen is None else seen
    for base in cls.bases:
        name = ast.unparse(base).split("[")[0].rsplit(".", 1)[-1]
        for path, base_cls in classes.get(name, []):
            if id(base_cls) not in seen:
                seen.add(id(base_cls))
                yield path, base_cls
                yield from _project_bases(base_cls, classes, seen)


def fields_set_away_from_home() -> list[str]:
    classes, field_homes = _declarations()
    found = []
    for entries in classes.values():
        for path, cls in entries:
            # A field a class sets on self that a base class declared in another file also sets.
            mine = {name for _, name in _self_fields(cls)}
            for base_path, base in _project_bases(cls, classes):
                shared = mine & {name for _, name in _self_fields(base)}
                if base_path != path and shared:
                    found.append(f"{_rel(path)}: {cls.name} sets {sorted(shared)} of {base.name} "
                                 f"({_rel(base_path)})")
    for path in (p for p in sources() if _rel(p) not in LIBRARY_SHIMS):
        # other._x = ... where no class of this file declares _x.
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                if (isinstance(target, ast.Attribute) and _private(target.attr) and not _is_self(target.value)
                        and target.attr in field_homes and path not in field_homes[target.attr]):
                    found.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(target)} = ... (declared in "
                                 f"{sorted(_rel(p) for p in field_homes[target.attr])})")
    return found


def test_each_class_sets_its_fields_in_the_file_that_declares_it() -> None:
    assert fields_set_away_from_home() == []
