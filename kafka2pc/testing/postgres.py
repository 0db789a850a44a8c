"""PostgreSQL for tests: a fresh database per test session on an existing server.

The server is found through ``$KAFKA2PC_PG_ADMIN_URL`` (a SQLAlchemy URL of a
role that may create databases; default
``postgresql+psycopg://postgres:postgres@127.0.0.1:5432/postgres``).  On
Debian, ``scripts/start-postgres.sh`` installs and starts one that matches the
default.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from kafka2pc import Kafka2pcError

DEFAULT_ADMIN_URL = "postgresql+psycopg://postgres:postgres@127.0.0.1:5432/postgres"

__all__ = ["DEFAULT_ADMIN_URL", "PostgresUnavailable", "fresh_database"]


class PostgresUnavailable(Kafka2pcError, RuntimeError):
    """No PostgreSQL server answered at the admin URL (a :class:`~kafka2pc.Kafka2pcError`)."""


@contextmanager
def fresh_database(admin_url: str | None = None) -> Iterator[str]:
    """Create a uniquely named database, yield its URL, drop it afterwards."""
    import sqlalchemy as sa

    admin_url = admin_url or os.environ.get("KAFKA2PC_PG_ADMIN_URL", DEFAULT_ADMIN_URL)
    try:
        admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    except sa.exc.ArgumentError as exc:
        raise PostgresUnavailable(
            f"KAFKA2PC_PG_ADMIN_URL is not a SQLAlchemy URL: {admin_url!r}"
        ) from exc
    name = f"kafka2pc_test_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        raise PostgresUnavailable(
            f"cannot reach PostgreSQL at {sa.make_url(admin_url).render_as_string(hide_password=True)}: "
            f"{exc.orig}. Start one with scripts/start-postgres.sh or set KAFKA2PC_PG_ADMIN_URL."
        ) from exc
    url = sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
