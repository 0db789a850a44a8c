"""Does the installed kafka-python still have what the control plane uses?

The control plane reaches into kafka-python beyond its documented API (see
``kafka2pc/_control/_kafka_python.py``).  These tests fail, with a sentence
per broken assumption, when a kafka-python release changes any of it: that
is the signal to adapt the compat module before widening the dependency pin.
A broker is not needed; ``tests/control/test_kafka_python_compat_live.py``
checks the members that only exist on a connected client.
"""

from __future__ import annotations

import re
from pathlib import Path

import kafka.errors as kafka_errors

from kafka2pc._control import _kafka_python as compat
from kafka2pc._errors import WireError, error_name_for_code

_PACKAGE = Path(__file__).resolve().parents[2]
_SOURCES = [
    *sorted((_PACKAGE / "kafka2pc").rglob("*.py")),
    *sorted((_PACKAGE / "recipes").rglob("*.py")),
    *sorted((_PACKAGE / "cli").rglob("*.py")),
]
# kafka-python members whose names start with "_" and are used somewhere.
_PRIVATE_USE = re.compile(r"\._manager\b|\._net\b|_value2member_map_|\._conns\b|\._correlation_id\b")


def test_installed_kafka_python_meets_every_assumption() -> None:
    problems = compat.check_compatibility()
    assert not problems, (
        f"kafka-python {compat.KAFKA_PYTHON_VERSION} broke {len(problems)} assumption(s) of "
        "kafka2pc/_control/_kafka_python.py:\n  " + "\n  ".join(problems)
    )


def test_a_broken_assumption_is_reported_in_words(monkeypatch: object) -> None:
    import pytest

    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    from kafka.net.manager import KafkaConnectionManager

    monkeypatch.delattr(KafkaConnectionManager, "wait_for")
    problems = compat.check_compatibility()
    assert any("KafkaConnectionManager.wait_for is gone" in p and "bound the wait" in p for p in problems), problems


def test_named_wire_errors_match_kafka_pythons_table() -> None:
    # kafka-python still calls code 6 by its pre-2.7 name.
    aliases = {WireError.NOT_LEADER_OR_FOLLOWER: {"NOT_LEADER_FOR_PARTITION"}, WireError.NONE: {"NO_ERROR"}}
    for error in WireError:
        name = error_name_for_code(int(error))
        assert name == error.name or name in aliases.get(error, set()), (error, name)
        assert kafka_errors.for_code(int(error)).errno == int(error)


def test_kafka_python_internals_are_used_only_in_the_compat_module() -> None:
    compat_module = Path(compat.__file__).resolve()
    offenders = [
        f"{path.relative_to(_PACKAGE)}:{number}: {line.strip()}"
        for path in _SOURCES
        if path.resolve() != compat_module
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if _PRIVATE_USE.search(line)
    ]
    assert not offenders, "kafka-python internals outside kafka2pc/_control/_kafka_python.py:\n" + "\n".join(
        offenders
    )
