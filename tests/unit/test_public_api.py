"""The public surface is exactly ``kafka2pc.__all__``: sorted, documented, presented as ``kafka2pc.X``."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import kafka2pc
from kafka2pc import Kafka2pcError

PUBLIC = [name for name in kafka2pc.__all__ if name != "__version__"]
EXPECTED = [
    "AbortableError",
    "AuthorizationError",
    "BrokerUnavailableError",
    "DEFAULT_CLOSE_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "Decision",
    "FatalError",
    "ForkedProcessError",
    "HeuristicOutcomeError",
    "IllegalStateError",
    "IndefiniteOutcomeError",
    "InvalidPreparedStateError",
    "Kafka2pcError",
    "KafkaTransactionError",
    "OnHeuristic",
    "OpenTransaction",
    "PartitionLag",
    "PreparedTxnState",
    "ProducerFencedError",
    "ProducerState",
    "QueueFullError",
    "RecoveryPlan",
    "RetriableError",
    "Settlement",
    "TIMEOUT_SLACK_S",
    "TopicAndPartition",
    "TransactionAdmin",
    "TransactionDescription",
    "TransactionInfo",
    "TransactionOutcome",
    "TransactionalIdMismatchError",
    "TwoPhaseCommitProducer",
    "TxnState",
    "UnknownTopicError",
    "UnsupportedBrokerError",
    "UsageError",
    "__version__",
    "unreachable_reason",
]


def test_export_list_is_pinned_and_sorted() -> None:
    assert kafka2pc.__all__ == EXPECTED
    assert kafka2pc.__all__ == sorted(kafka2pc.__all__)
    assert len(set(kafka2pc.__all__)) == len(kafka2pc.__all__)
    assert isinstance(kafka2pc.__version__, str) and kafka2pc.__version__.count(".") == 2


def test_version_is_the_distribution_version() -> None:
    """``kafka2pc.__version__`` and pyproject.toml's version agree (the wheel's metadata comes from the latter)."""
    import re

    pyproject = (Path(kafka2pc.__file__).resolve().parent.parent / "pyproject.toml").read_text()
    found = re.search(r'^version = "([^"]+)"$', pyproject, re.MULTILINE)
    assert found is not None and kafka2pc.__version__ == found.group(1) == "1.0.0"


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from kafka2pc import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(kafka2pc.__all__)


CONSTANTS = [name for name in PUBLIC if name.isupper()]


@pytest.mark.parametrize("name", CONSTANTS)
def test_exported_constant_is_a_documented_bound(name: str) -> None:
    """The module constants are the default bounds, in seconds, and docs/configuration.md names each."""
    assert name.endswith("_S") and isinstance(getattr(kafka2pc, name), float) and getattr(kafka2pc, name) > 0
    page = (Path(kafka2pc.__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    assert f"kafka2pc.{name}" in page


@pytest.mark.parametrize("name", [n for n in PUBLIC if n not in CONSTANTS])
def test_exported_name_is_public_and_documented(name: str) -> None:
    obj = getattr(kafka2pc, name)
    assert obj.__module__ == "kafka2pc", f"{name} shows up as {obj.__module__}.{name}"
    doc = obj.__doc__
    assert doc and doc.strip(), f"{name} has no docstring"
    assert not doc.startswith(f"{name}("), f"{name} only has the dataclass-generated docstring"


@pytest.mark.parametrize("name", [n for n in PUBLIC if inspect.isclass(getattr(kafka2pc, n))])
def test_public_members_are_documented(name: str) -> None:
    cls = getattr(kafka2pc, name)
    if issubclass(cls, BaseException):
        return  # exceptions document the class; their methods are Exception's
    undocumented = []
    for member, value in vars(cls).items():
        if member.startswith("_") or not (callable(value) or isinstance(value, (property, classmethod, staticmethod))):
            continue
        if not inspect.getdoc(getattr(cls, member)):
            undocumented.append(member)
    assert undocumented == [], f"{name}: undocumented public members {undocumented}"


def test_every_error_is_in_the_one_tree() -> None:
    errors = [getattr(kafka2pc, n) for n in PUBLIC if n.endswith("Error")]
    assert len(errors) >= 15
    for error in errors:
        assert issubclass(error, Kafka2pcError), error
    assert issubclass(kafka2pc.InvalidPreparedStateError, ValueError)
    assert issubclass(kafka2pc.QueueFullError, BufferError)
    assert issubclass(kafka2pc.QueueFullError, kafka2pc.RetriableError)
    assert not issubclass(kafka2pc.UsageError, kafka2pc.KafkaTransactionError)


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        kafka2pc.NoSuchThing  # noqa: B018


def test_import_is_cheap() -> None:
    """``import kafka2pc`` must not load the Kafka client libraries (CLI start-up time)."""
    code = "import sys, kafka2pc; print(sorted(m for m in ('confluent_kafka', 'kafka') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, check=True,
        cwd=Path(kafka2pc.__file__).resolve().parent.parent,
    )
    assert out.stdout.strip() == "[]"
