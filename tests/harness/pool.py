"""The writer pools' tests: their database and their id prefixes."""

from __future__ import annotations

import os

import sqlalchemy as sa
from kafka2pc.recipes.dual_write import define_lease_table, define_state_table

from harness.dw_crash import items_table


def pool_engine(url: str, *, pool_size: int = 5) -> sa.Engine:
    """An engine on ``url`` with the pool's tables (state, leases) and the crash tests' items table created.

    SQLite waits up to 30 s for its write lock: the pool's threads and instances share one file.
    """
    connect_args = {"timeout": 30} if url.startswith("sqlite") else {}
    engine = sa.create_engine(url, pool_size=pool_size, connect_args=connect_args)
    metadata = sa.MetaData()
    define_state_table(metadata)
    define_lease_table(metadata)
    items_table(metadata)
    metadata.create_all(engine)
    return engine


def pool_prefix(kind: str, name: str) -> str:
    """A transactional-id prefix of its own for one test: ``<kind>-<name>-<6 hex digits>``."""
    return f"{kind}-{name}-{os.urandom(3).hex()}"
