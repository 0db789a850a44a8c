"""Fixtures of the core crash tests: scenarios whose children run ``_child.py`` (``harness/scenario.py``)."""

from __future__ import annotations

from pathlib import Path

from harness.scenario import scenario_factory_fixture

scenario_factory = scenario_factory_fixture(Path(__file__).with_name("_child.py"), "k2pc-core")
