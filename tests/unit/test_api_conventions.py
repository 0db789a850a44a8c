"""The 1.0 argument conventions, checked on every public callable of the public modules.

* Every Python-level duration is in seconds: no argument is in milliseconds
  (no name ending in ``_ms``).
* One timeout naming rule: a per-call bound is named ``timeout``; any other
  duration argument (a number whose name has ``timeout``, ``interval``,
  ``wait``, ``lease``, ``delay``, ``duration``, ``every``, ``threshold`` or
  ``period`` as a word) ends in ``_s``.
* No ``*args`` / ``**kwargs`` pass-through: a variadic parameter has a
  concrete annotation (not ``Any``, not missing).

The fields of the result value types (``TransactionDescription.timeout_ms``,
``ProducerState.last_timestamp_ms``...) carry what the broker reports, in
Kafka's unit and under its wire name, as configuration keys do: their
generated constructors are checked for the timeout naming rule only.

The deprecated 0.1 names still in a signature (``kafka2pc._deprecation.RENAMED_ARGUMENTS``)
are the only exceptions; :mod:`tests.unit.test_deprecated_names` checks that each one warns.
librdkafka/Kafka configuration dict keys keep their Kafka names and are not
arguments.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kafka2pc._deprecation import RENAMED_ARGUMENTS

MODULES = [
    "kafka2pc",
    "kafka2pc.aio",
    "kafka2pc.otel",
    "kafka2pc.recipes.dual_write",
    "kafka2pc.recipes.dual_write.aio",
    "kafka2pc.recipes.spark",
    "kafka2pc.recipes.django",
]
DURATION_WORDS = {"timeout", "interval", "wait", "lease", "delay", "duration", "every", "threshold", "period"}
DEPRECATED = {(where, old) for where, old, _ in RENAMED_ARGUMENTS}


def public_callables() -> Iterator[tuple[str, Callable[..., Any]]]:
    """``(qualified name, callable)`` for every public function, class constructor and method."""
    seen: set[str] = set()
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                qualified = f"{module_name}.{name}"
                if qualified not in seen:
                    seen.add(qualified)
                    yield qualified, obj
            elif inspect.isclass(obj) and not issubclass(obj, BaseException):
                for member, value in [("__init__", obj.__init__), ("__call__", getattr(obj, "__call__", None))] + [
                    (m, v) for m, v in inspect.getmembers(obj) if not m.startswith("_")
                ]:
                    if isinstance(inspect.getattr_static(obj, member, None), property):
                        continue
                    if not (inspect.isfunction(value) or inspect.ismethod(value)):
                        continue
                    if not getattr(value, "__module__", "").startswith("kafka2pc"):
                        continue  # object.__init__ and the like
                    if member == "__init__" and dataclasses.is_dataclass(obj):
                        continue  # a result type: test_public_dataclass_fields_follow_the_conventions
                    qualified = f"{module_name}.{name}.{member}"
                    if qualified not in seen:
                        seen.add(qualified)
                        yield qualified, value


CALLABLES = sorted(public_callables())


def test_the_walk_finds_the_public_surface() -> None:
    names = {qualified for qualified, _ in CALLABLES}
    assert {
        "kafka2pc.TwoPhaseCommitProducer.produce",
        "kafka2pc.TransactionAdmin.__init__",
        "kafka2pc.TransactionAdmin.list_transactions",
        "kafka2pc.aio.AsyncTwoPhaseCommitProducer.produce_and_wait",
        "kafka2pc.aio.AsyncTransactionAdmin.__init__",
        "kafka2pc.recipes.dual_write.DualWriter.__init__",
        "kafka2pc.recipes.dual_write.DualWriter.recover",
        "kafka2pc.recipes.dual_write.WriterPool.__init__",
        "kafka2pc.recipes.dual_write.aio.AsyncDualWriter.recover",
        "kafka2pc.otel.instrument_producer",
    } <= names
    assert len(CALLABLES) > 150


def violations(qualified: str, fn: Callable[..., Any]) -> list[str]:
    found = []
    for param in inspect.signature(fn).parameters.values():
        name = param.name
        if (qualified, name) in DEPRECATED:
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            if param.annotation in (param.empty, Any, "Any"):
                found.append(f"{qualified}: untyped pass-through {'*' if param.kind is param.VAR_POSITIONAL else '**'}"
                             f"{name}")
            continue
        annotation = str(param.annotation)
        numeric = ("float" in annotation or "int" in annotation) and "bool" not in annotation
        if name.endswith("_ms") or "_ms_" in name:
            found.append(f"{qualified}({name}=): in milliseconds; durations are in seconds, named *_s")
        elif (name != "timeout" and numeric and DURATION_WORDS & set(name.split("_"))
              and not name.endswith("_s")):
            found.append(f"{qualified}({name}=): a duration other than the per-call `timeout` ends in _s")
    return found


@pytest.mark.parametrize(("qualified", "fn"), CALLABLES, ids=[q for q, _ in CALLABLES])
def test_arguments_follow_the_conventions(qualified: str, fn: Callable[..., Any]) -> None:
    assert violations(qualified, fn) == []


def test_public_dataclass_fields_follow_the_conventions() -> None:
    """Arguments of the generated constructors of public value types: the same rules, on the fields given in."""
    problems = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and not issubclass(obj, BaseException):
                problems += [p for p in violations(f"{module_name}.{name}", obj) if "milliseconds" not in p]
    assert problems == []


def test_the_checks_catch_each_kind_of_violation() -> None:
    def bad(topic: str, *args: Any, wait_ms: int = 0, poll_interval: float = 1.0, **kwargs: Any) -> None:
        """A signature that breaks every rule."""

    found = violations("example.bad", bad)
    assert len(found) == 4, found
    assert any("*args" in f for f in found) and any("**kwargs" in f for f in found)
    assert any("wait_ms" in f for f in found) and any("poll_interval" in f for f in found)

    def good(topic: str, *exc_info: object, timeout: float | None = None, lease_s: float = 1.0) -> None:
        """A signature that keeps them."""

    assert violations("example.good", good) == []


def test_every_deprecated_argument_is_still_in_its_signature() -> None:
    """The exemptions do not outlive the aliases: each names a real parameter of a public callable."""
    by_name = dict(CALLABLES)
    for where, old, new in RENAMED_ARGUMENTS:
        assert where in by_name, where
        parameters = inspect.signature(by_name[where]).parameters
        assert old in parameters and new in parameters, (where, old, new)
        assert parameters[old].default is None and parameters[old].kind is inspect.Parameter.KEYWORD_ONLY
