"""Fixtures of the core crash tests (helpers live in ``_crash.py``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _crash import Scenario

from kafka2pc.testing import create_topic


@pytest.fixture
def scenario_factory(tmp_path: Path) -> Iterator[Callable[..., Scenario]]:
    """``scenario_factory(bootstrap, partitions=1)`` -> a fresh :class:`Scenario`; children are killed afterwards."""
    made: list[Scenario] = []

    def make(bootstrap: str, partitions: int = 1) -> Scenario:
        topic = create_topic(bootstrap, partitions=partitions)
        tid = f"k2pc-core-{uuid.uuid4().hex[:10]}"
        scenario = Scenario(bootstrap, topic, tid, tmp_path / f"app-{len(made)}.db")
        made.append(scenario)
        return scenario

    yield make
    for scenario in made:
        scenario.close()

