"""Fixtures of the Django app's tests: pytest-django on SQLite, PostgreSQL and MariaDB, and the real broker.

Every test gets a fresh pool prefix (fresh transactional ids) and closes this process's pools before
pytest-django flushes the tables.  Tests run with ``django_db(transaction=True)``: a dual write is the
outermost ``transaction.atomic`` of its alias, which Django's ``TestCase`` wrapping would forbid.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
# djtest (this directory) is importable through pytest's `pythonpath` setting (pyproject.toml).
_OWN_SETTINGS = "DJANGO_SETTINGS_MODULE" not in os.environ
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djtest.settings")

import django  # noqa: E402

django.setup()
if _OWN_SETTINGS:
    # pytest-xdist's workers inherit this environment and start with the sys.path the controller had before
    # this file ran, and pytest-django imports DJANGO_SETTINGS_MODULE before any conftest: left set, a worker
    # dies on "No module named 'djtest'". Each process that imports this file configures Django itself.
    del os.environ["DJANGO_SETTINGS_MODULE"]

from djtest.params import on  # noqa: E402 - after django.setup()
from kafka2pc.recipes.django.testing import kafka2pc_pools  # noqa: E402, F401 - the shipped fixture, as users load it


@pytest.fixture
def k2pc_settings(settings: Any, kafka_bootstrap: str, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """``settings.KAFKA2PC`` for this test: the session's broker, a fresh prefix, short leases and bounds."""
    from kafka2pc.recipes.django._runtime import close_all

    close_all()
    settings.KAFKA2PC = {
        "PRODUCER": {"bootstrap.servers": kafka_bootstrap},
        "TRANSACTIONAL_ID_PREFIX": f"dj-{uuid.uuid4().hex[:10]}",
        "POOL_SIZE": 4,
        "POOL_OPTIONS": {"lease_s": 3.0, "acquire_timeout_s": 30.0, "kafka_timeout_s": 20.0},
    }
    yield settings.KAFKA2PC
    close_all(timeout=10)


@pytest.fixture(params=[False, True], ids=["serial", "pipelined"])
def pipelined(request: pytest.FixtureRequest, k2pc_settings: dict[str, Any]) -> bool:
    """The test runs with ``POOL_OPTIONS["pipelined"]`` off, then on (before its first ``dual_write()``)."""
    k2pc_settings["POOL_OPTIONS"]["pipelined"] = bool(request.param)
    return bool(request.param)


@pytest.fixture(params=on())
def alias(request: pytest.FixtureRequest, k2pc_settings: dict[str, Any], transactional_db: None) -> str:
    """Each test using it runs on SQLite, PostgreSQL and MariaDB, with the app's pools closed before the flush."""
    return str(request.param)


def _recipes_fixtures() -> Any:
    """The recipe tests' conftest (its MariaDB database fixture), loaded under its own name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("k2pc_recipes_conftest", HERE.parent / "recipes" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mariadb_url = _recipes_fixtures().mariadb_url


@pytest.fixture(params=[pytest.param(a, id=k, marks=pytest.mark.django_db(transaction=True, databases=["default", a]))
                        for a, k in (("pg", "postgresql"), ("maria", "mariadb"))])
def alias_pg_maria(request: pytest.FixtureRequest, k2pc_settings: dict[str, Any], transactional_db: None) -> str:
    """``alias`` on PostgreSQL and MariaDB only (the servers whose connections a test can kill)."""
    return str(request.param)
