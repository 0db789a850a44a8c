"""Fixtures of the asyncio tests: scenarios whose children run ``_aio_child.py`` (``harness/scenario.py``)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from harness.scenario import scenario_factory_fixture

scenario_factory = scenario_factory_fixture(Path(__file__).with_name("_aio_child.py"), "k2pc-aio")


@pytest.fixture
def tid() -> str:
    """A fresh transactional id."""
    return f"k2pc-aio-{uuid.uuid4().hex[:10]}"
