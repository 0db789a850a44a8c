"""Objects own their state: no inheritance towers in the core, and the asyncio twins keep to the public seam.

* A public class of the core (:mod:`kafka2pc`, :mod:`kafka2pc.aio`, and the
  :class:`~kafka2pc._control.ControlPlane` a producer or an admin hands out)
  has at most one kafka2pc class in its method resolution order, itself:
  its parts are collaborators it holds, not bases.  Exceptions, Protocols and
  ``Generic`` are not counted.
* The asyncio twins call their sync object only through names without a
  leading underscore (no ``self._sync._x``).
"""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

import kafka2pc
import kafka2pc.aio
from kafka2pc._control import ControlPlane

AIO_DIR = Path(kafka2pc.aio.__file__).parent


def public_classes() -> list[type]:
    found: list[type] = [ControlPlane]
    for module in (kafka2pc, kafka2pc.aio):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) and not issubclass(obj, BaseException):
                found.append(obj)
    return found


def project_bases(cls: type) -> list[str]:
    return [
        f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__
        if c.__module__.startswith("kafka2pc") and c is not typing.Generic and not getattr(c, "_is_protocol", False)
    ]


@pytest.mark.parametrize("cls", public_classes(), ids=lambda c: c.__qualname__)
def test_public_core_class_has_no_project_base(cls: type) -> None:
    assert len(project_bases(cls)) <= 1, project_bases(cls)


@pytest.mark.parametrize("path", sorted(AIO_DIR.glob("*.py")), ids=lambda p: p.name)
def test_asyncio_twins_use_no_private_member_of_their_sync_object(path: Path) -> None:
    reached = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and isinstance(node.value, ast.Attribute) and node.value.attr == "_sync"
        ):
            reached.append(f"{path.name}:{node.lineno}: ._sync.{node.attr}")
    assert reached == []
