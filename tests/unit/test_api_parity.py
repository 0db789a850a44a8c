"""Every variant of the API behaves as one: derived by introspection of the public modules, not from a list.

* **Twins.** Each public ``AsyncX`` of an asyncio module (``kafka2pc.aio``,
  ``kafka2pc.recipes.dual_write.aio``) has its sync ``X`` in the sync module,
  and a public function of an asyncio module has its namesake there; every
  public sync class that holds a resource (it has ``close``) has an ``AsyncX``
  twin.  Twins have the same public members, each of the same kind (property
  or method), and their methods take the same parameters (names, kinds,
  defaults).  ``__enter__``/``__exit__`` pair with ``__aenter__``/``__aexit__``.
  What cannot have a twin is named, with the reason, in
  :data:`kafka2pc.aio.UNPAIRED` (the one documented list; ``docs/asyncio.md``
  shows it).
* **One produce, one close.** Every public ``produce`` takes one parameter
  list; every public ``close`` takes ``timeout`` (seconds; ``None``: its
  documented default) and nothing else.
* **Units in values.** A public dataclass field, property or method result
  that is a duration is a ``float`` in seconds named ``*_s``: no public value
  named ``*_ms``, no ``float`` value without the ``_s`` suffix unless it has
  no unit (:data:`DIMENSIONLESS`).  The broker's own reports
  (:data:`WIRE_VALUE_TYPES`) keep Kafka's wire names and units, as
  configuration keys do.  Deprecated aliases (marked ``__deprecated__`` by
  :mod:`kafka2pc._deprecation`) are exempt: they warn.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kafka2pc._deprecation import RENAMED_ARGUMENTS

MODULES = [
    "kafka2pc",
    "kafka2pc.aio",
    "kafka2pc.recipes.dual_write",
    "kafka2pc.recipes.dual_write.aio",
    "kafka2pc.recipes.spark",
    "kafka2pc.otel",
]
ASYNC_MODULES = {"kafka2pc.aio": "kafka2pc", "kafka2pc.recipes.dual_write.aio": "kafka2pc.recipes.dual_write"}
DUNDER_TWINS = {"__enter__": "__aenter__", "__exit__": "__aexit__"}
WIRE_VALUE_TYPES = {"TransactionDescription", "ProducerState"}
"""What the broker reports (DescribeTransactions, DescribeProducers), under Kafka's names and in Kafka's units."""
DURATION_WORDS = {"timeout", "interval", "wait", "lease", "delay", "duration", "period"}
"""Words that make a value's name a duration (``*_ms`` with one of them is a duration, else a timestamp)."""
DIMENSIONLESS = {"stalled_fraction"}
"""``float`` values that have no unit."""
UNIT_SUFFIXES = ("_s", "_per_second")
"""How a ``float`` value's name says its unit."""
DEPRECATED_ARGUMENTS = {(where, old) for where, old, _ in RENAMED_ARGUMENTS}


def _unpaired() -> dict[str, str]:
    from kafka2pc.aio import UNPAIRED

    return dict(UNPAIRED)


def _module(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # an optional extra that is missing fails loudly, not silently
        pytest.fail(f"{name} does not import: {exc}")
    return None


def _public(module_name: str) -> dict[str, Any]:
    module = _module(module_name)
    assert module is not None
    return {name: getattr(module, name) for name in module.__all__ if not name.startswith("_")}


def _classes(module_name: str) -> dict[str, type]:
    return {n: o for n, o in _public(module_name).items() if inspect.isclass(o) and not issubclass(o, BaseException)}


def _is_deprecated(obj: Any) -> bool:
    target = obj.fget if isinstance(obj, property) else obj
    return getattr(target, "__deprecated__", None) is not None


def _members(cls: type) -> dict[str, Any]:
    """The public members a user calls (static lookup: properties stay properties), dunders renamed as twins."""
    found: dict[str, Any] = {}
    for name in dir(cls):
        if name.startswith("_") and name not in DUNDER_TWINS and name not in DUNDER_TWINS.values():
            continue
        static = inspect.getattr_static(cls, name)
        if isinstance(static, (staticmethod, classmethod)):
            static = static.__func__
        if not (isinstance(static, property) or inspect.isfunction(static)):
            continue
        if _is_deprecated(static):
            continue
        found[DUNDER_TWINS.get(name, name)] = static
    return found


def _parameters(fn: Callable[..., Any], where: str) -> list[tuple[str, str, Any]]:
    params = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self" or (where, p.name) in DEPRECATED_ARGUMENTS:
            continue
        params.append((p.name, p.kind.name, p.default))
    return params


def twins() -> Iterator[tuple[str, Any, str, Any]]:
    """``(sync qualified name, sync object, async qualified name, async object)`` for every twin pair found."""
    for async_module, sync_module in ASYNC_MODULES.items():
        sync_public = _public(sync_module)
        for name, obj in _public(async_module).items():
            sync_name = name[len("Async"):] if name.startswith("Async") else name
            if sync_name in sync_public:
                yield f"{sync_module}.{sync_name}", sync_public[sync_name], f"{async_module}.{name}", obj


def test_every_async_name_has_its_sync_twin() -> None:
    unpaired = _unpaired()
    missing = []
    for async_module, sync_module in ASYNC_MODULES.items():
        sync_public = _public(sync_module)
        for name, obj in _public(async_module).items():
            if name.isupper() or (inspect.isclass(obj) and issubclass(obj, BaseException)):
                continue  # constants (UNPAIRED itself); errors are shared, never twinned
            sync_name = name[len("Async"):] if name.startswith("Async") else name
            if sync_name not in sync_public and f"{async_module}.{name}" not in unpaired:
                missing.append(f"{async_module}.{name}: no {sync_module}.{sync_name}")
    assert missing == []


def test_every_resource_class_has_an_async_twin() -> None:
    """A public class with ``close`` talks to Kafka or a database: asyncio code needs it too."""
    unpaired = _unpaired()
    async_of = {sync: asyncio for asyncio, sync in ASYNC_MODULES.items()}
    missing = []
    for module_name in MODULES:
        if module_name in ASYNC_MODULES:
            continue
        for name, cls in _classes(module_name).items():
            if "close" not in _members(cls) or f"{module_name}.{name}" in unpaired:
                continue
            async_module = async_of.get(module_name)
            if async_module is None or f"Async{name}" not in _public(async_module):
                missing.append(f"{module_name}.{name}")
    assert missing == []


def _twin_differences(sync_name: str, sync_obj: Any, async_name: str, async_obj: Any) -> list[str]:
    unpaired = _unpaired()
    found: list[str] = []
    if inspect.isfunction(sync_obj):
        pairs = [("", sync_obj, async_obj)]
    else:
        sync_members, async_members = _members(sync_obj), _members(async_obj)
        for name in sorted(set(sync_members) - set(async_members)):
            if f"{sync_name}.{name}" not in unpaired:
                found.append(f"{async_name} lacks {name}")
        for name in sorted(set(async_members) - set(sync_members)):
            if f"{async_name}.{name}" not in unpaired:
                found.append(f"{sync_name} lacks {name} (which {async_name} has)")
        pairs = []
        for name in sorted(set(sync_members) & set(async_members)):
            s, a = sync_members[name], async_members[name]
            if isinstance(s, property) != isinstance(a, property):
                found.append(f"{sync_name}.{name} and {async_name}.{name}: a property in one, a method in the other")
            elif not isinstance(s, property) and name not in DUNDER_TWINS.values():
                pairs.append((f".{name}", s, a))
        if not inspect.isfunction(sync_obj):
            pairs.append((".__init__", sync_obj.__init__, async_obj.__init__))
    for suffix, s, a in pairs:
        s_params = _parameters(s, f"{sync_name}{suffix}")
        a_params = _parameters(a, f"{async_name}{suffix}")
        s_params = [p for p in s_params if f"{sync_name}{suffix}({p[0]})" not in unpaired]
        a_params = [p for p in a_params if f"{async_name}{suffix}({p[0]})" not in unpaired]
        if s_params != a_params:
            found.append(f"{sync_name}{suffix}{s_params} != {async_name}{suffix}{a_params}")
    return found


TWINS = sorted(twins(), key=lambda t: t[0])


def test_the_twins_are_found() -> None:
    names = {(s, a) for s, _, a, _ in TWINS}
    assert {
        ("kafka2pc.TwoPhaseCommitProducer", "kafka2pc.aio.AsyncTwoPhaseCommitProducer"),
        ("kafka2pc.TransactionAdmin", "kafka2pc.aio.AsyncTransactionAdmin"),
        ("kafka2pc.recipes.dual_write.DualWriter", "kafka2pc.recipes.dual_write.aio.AsyncDualWriter"),
        ("kafka2pc.recipes.dual_write.WriterPool", "kafka2pc.recipes.dual_write.aio.AsyncWriterPool"),
        ("kafka2pc.recipes.dual_write.DualWriteTransaction",
         "kafka2pc.recipes.dual_write.aio.AsyncDualWriteTransaction"),
        ("kafka2pc.recipes.dual_write.recover_all", "kafka2pc.recipes.dual_write.aio.recover_all"),
    } <= names


@pytest.mark.parametrize(("sync_name", "sync_obj", "async_name", "async_obj"), TWINS, ids=[t[2] for t in TWINS])
def test_twins_have_the_same_members_and_arguments(sync_name: str, sync_obj: Any, async_name: str,
                                                   async_obj: Any) -> None:
    assert _twin_differences(sync_name, sync_obj, async_name, async_obj) == []


def test_every_unpaired_entry_names_something_real_and_says_why() -> None:
    """The list does not outlive what it excuses."""
    for qualified, reason in _unpaired().items():
        assert len(reason) > 20, qualified
        path, _, param = qualified.partition("(")
        module_name = next(m for m in sorted(MODULES, key=len, reverse=True) if path.startswith(m + "."))
        obj: Any = importlib.import_module(module_name)
        for part in path[len(module_name) + 1:].split("."):
            obj = getattr(obj, part)
        if param:
            assert param.rstrip(")") in inspect.signature(obj).parameters, qualified


def _all_classes() -> Iterator[tuple[str, type]]:
    seen: set[type] = set()
    for module_name in MODULES:
        for name, cls in _classes(module_name).items():
            if cls not in seen:
                seen.add(cls)
                yield f"{module_name}.{name}", cls


def _methods_named(member: str) -> list[tuple[str, Callable[..., Any]]]:
    return [(f"{q}.{member}", getattr(cls, member)) for q, cls in _all_classes()
            if inspect.isfunction(inspect.getattr_static(cls, member, None))]


def test_one_produce() -> None:
    produces = _methods_named("produce")
    assert len(produces) >= 4, produces
    signatures = {q: _parameters(fn, q) for q, fn in produces}
    first = next(iter(signatures.values()))
    assert {q: s for q, s in signatures.items() if s != first} == {}, first


def test_one_close() -> None:
    closes = _methods_named("close")
    assert len(closes) >= 8, closes
    expected = [("timeout", "POSITIONAL_OR_KEYWORD", None)]
    assert {q: _parameters(fn, q) for q, fn in closes if _parameters(fn, q) != expected} == {}


def _is_float(annotation: Any) -> bool:
    if annotation is float:
        return True
    if isinstance(annotation, str):
        return annotation.replace(" ", "") in ("float", "float|None", "Optional[float]")
    args = typing.get_args(annotation)
    return bool(args) and float in args and all(a in (float, type(None)) for a in args)


def _values(qualified: str, cls: type) -> Iterator[tuple[str, Any]]:
    """``(name, annotation)`` of each public value a user reads: fields, properties, method results."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - annotations of TYPE_CHECKING-only names: read them as strings
        hints = dict(getattr(cls, "__annotations__", {}))
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if not f.name.startswith("_"):
                yield f.name, hints.get(f.name, f.type)
    for name in dir(cls):
        if name.startswith("_"):
            continue
        static = inspect.getattr_static(cls, name)
        if _is_deprecated(static):
            continue
        fn = static.fget if isinstance(static, property) else static
        if inspect.isfunction(fn):
            try:
                returns = typing.get_type_hints(fn).get("return")
            except Exception:  # noqa: BLE001
                returns = fn.__annotations__.get("return")
            yield name, returns


def test_durations_in_values_are_seconds() -> None:
    problems = []
    for qualified, cls in _all_classes():
        if cls.__name__ in WIRE_VALUE_TYPES:
            continue
        for name, annotation in _values(qualified, cls):
            if name.endswith("_ms") or "_ms_" in name:
                problems.append(f"{qualified}.{name}: in milliseconds")
            elif _is_float(annotation) and not name.endswith(UNIT_SUFFIXES) and name not in DIMENSIONLESS:
                problems.append(f"{qualified}.{name}: a float without a unit in its name")
    assert problems == []


def test_broker_reported_durations_are_also_in_seconds() -> None:
    """A duration the broker reports in milliseconds (``timeout_ms``) has its ``*_s`` twin, a float in seconds.

    Timestamps (``start_time_ms``, ``last_timestamp_ms``) are points in time, not durations: they keep Kafka's unit.
    """
    from kafka2pc import TransactionDescription

    missing = []
    for qualified, cls in _all_classes():
        if cls.__name__ not in WIRE_VALUE_TYPES:
            continue
        values = dict(_values(qualified, cls))
        for name in values:
            words = set(name.removesuffix("_ms").split("_"))
            if name.endswith("_ms") and words & DURATION_WORDS:
                twin = name.removesuffix("_ms") + "_s"
                if twin not in values or not _is_float(values[twin]):
                    missing.append(f"{qualified}.{name}: no float {twin}")
    assert missing == []
    described = TransactionDescription("t", "Ongoing", 1, 0, 60_000, 1, (), 0)
    assert described.timeout_s == 60.0 and described.timeout_ms == 60_000


def test_the_checks_catch_each_kind_of_problem() -> None:
    @dataclasses.dataclass
    class Bad:
        elapsed: float
        open_for_ms: int

        @property
        def noise(self) -> float | None:
            return None

        def limit_ms(self) -> int:
            return 0

    found = [n for n, a in _values("Bad", Bad) if n.endswith("_ms") or (_is_float(a) and not n.endswith("_s"))]
    assert sorted(found) == ["elapsed", "limit_ms", "noise", "open_for_ms"]

    class Sync:
        def close(self, timeout: float | None = None) -> None: ...
        def produce(self, topic: str, value: bytes | None = None) -> None: ...

    class AsyncSync:
        async def close(self) -> None: ...

    found = _twin_differences("m.Sync", Sync, "m.AsyncSync", AsyncSync)
    assert any("lacks produce" in f for f in found) and any(".close" in f for f in found), found


def test_the_asyncio_page_lists_every_unpaired_name() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "asyncio.md").read_text()
    section = page.split("## One API", 1)[1].split("\n## ", 1)[0]
    assert {k for k in _unpaired() if f"`{k}`" not in section} == set()
