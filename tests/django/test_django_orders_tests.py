"""``examples/django_orders``'s own ``TestCase`` tests pass with the shipped helper, on a real broker.

``python manage.py test orders`` runs as a user runs it, on PostgreSQL and on MariaDB: Django's test runner
creates the test database, each test runs in its transaction, and the view's ``dual_write()`` commits its
event in Kafka (``kafka2pc.recipes.django.testing.DualWriteTestMixin``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "django_orders"


def _orders_db(kind: str, request: pytest.FixtureRequest) -> str:
    url = sa.make_url(request.getfixturevalue("pg_url" if kind == "postgresql" else "mariadb_url"))
    scheme = "postgresql" if kind == "postgresql" else "mysql"
    return f"{scheme}://{url.username}:{url.password}@{url.host}:{url.port}/{url.database}"


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_the_examples_testcase_tests_pass(kind: str, request: pytest.FixtureRequest, kafka_bootstrap: str) -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "orders_project.settings",
        "ORDERS_DB": _orders_db(kind, request),
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "ORDERS_TRANSACTIONAL_ID_PREFIX": f"orders-tests-{uuid.uuid4().hex[:8]}",
        "ORDERS_POOL_SIZE": "4", "ORDERS_LEASE_S": "3",
    }
    done = subprocess.run([sys.executable, "manage.py", "test", "orders", "--noinput", "-v", "2"], cwd=EXAMPLE,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Ran 2 tests" in done.stderr and "OK" in done.stderr, done.stderr
