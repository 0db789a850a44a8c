"""Fixtures of the asyncio tests (helpers live in ``_aio_helpers.py``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _aio_helpers import Scenario

from kafka2pc.testing import create_topic


@pytest.fixture
def scenario_factory(tmp_path: Path) -> Iterator[Callable[..., Scenario]]:
    """``scenario_factory(bootstrap, partitions=1)`` -> a fresh :class:`Scenario`; children are killed afterwards."""
    made: list[Scenario] = []

    def make(bootstrap: str, partitions: int = 1) -> Scenario:
        topic = create_topic(bootstrap, partitions=partitions)
        scenario = Scenario(bootstrap, topic, f"k2pc-aio-{uuid.uuid4().hex[:10]}", tmp_path / f"app-{len(made)}.db")
        made.append(scenario)
        return scenario

    yield make
    for scenario in made:
        scenario.close()


@pytest.fixture
def tid() -> str:
    """A fresh transactional id."""
    return f"k2pc-aio-{uuid.uuid4().hex[:10]}"
