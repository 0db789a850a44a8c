"""Fixtures of the recipe tests: a MariaDB database per session (next to the plugin's PostgreSQL and SQLite)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

#: Where scripts/start-mariadb.sh starts MariaDB (override with $KAFKA2PC_MARIADB_URL).
DEFAULT_MARIADB_URL = "mysql+pymysql://kafka2pc:kafka2pc@127.0.0.1:3306/kafka2pc"


@pytest.fixture(scope="session")
def mariadb_url() -> Iterator[str]:
    """URL of a fresh MariaDB database, dropped at the end of the session (``scripts/start-mariadb.sh``)."""
    base = sa.make_url(os.environ.get("KAFKA2PC_MARIADB_URL", DEFAULT_MARIADB_URL))
    name = f"k2pc_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base, poolclass=sa.pool.NullPool, connect_args={"connect_timeout": 5})
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
    except sa.exc.OperationalError as exc:
        pytest.fail(f"MariaDB is not reachable at {base.render_as_string(hide_password=True)} ({exc.orig}); "
                    "start it with scripts/start-mariadb.sh", pytrace=False)
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        admin.dispose()


@pytest.fixture(params=["postgresql", "sqlite", "mariadb"])
def any_db_url(request: pytest.FixtureRequest) -> str:
    """Each test using it runs on PostgreSQL, SQLite and MariaDB."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("pg_url"))
    if request.param == "mariadb":
        return str(request.getfixturevalue("mariadb_url"))
    return str(request.getfixturevalue("sqlite_url"))
