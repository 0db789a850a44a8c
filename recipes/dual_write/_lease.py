"""Leases on a bounded set of transactional ids, kept in the application's database.

A :class:`~kafka2pc.recipes.dual_write.WriterPool` draws its transactional ids
from a set recorded in one table, one row per id (``<prefix>-0`` ..
``<prefix>-<size-1>``)::

    kafka_writer_lease (
        transactional_id VARCHAR(255) PRIMARY KEY,
        pool             VARCHAR(255),   -- the prefix: which set the id belongs to
        owner            VARCHAR(255),   -- NULL: free (released cleanly, nothing open)
        expires_at       TIMESTAMP,      -- UTC; past: the owner is presumed dead
        epoch            BIGINT          -- +1 at every claim: the lease's fencing epoch
    )

Every change is one conditional ``UPDATE`` whose ``WHERE`` names the epoch
the caller saw, so of two instances racing for one expired lease exactly one
gets a row count of 1; the other moves on.  The lease is *advisory*: what
makes a takeover safe is the claim-before-Kafka recovery that follows it (the
state row's version bump, then a new producer that fences the old one).  A
lease only decides who runs that recovery, and when: an instance that stops
renewing is presumed dead one lease interval later.

Times are the instances' own UTC clocks: keep them within a small fraction of
the lease (NTP does).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Final

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

__all__ = ["DEFAULT_LEASE_TABLE", "Lease", "LeaseBook", "define_lease_table"]

DEFAULT_LEASE_TABLE: Final = "kafka_writer_lease"


def define_lease_table(
    metadata: sa.MetaData, name: str = DEFAULT_LEASE_TABLE, *, schema: str | None = None
) -> sa.Table:
    """The lease table of :class:`~kafka2pc.recipes.dual_write.WriterPool` (SQLAlchemy Core, on ``metadata``).

    One row per transactional id of every pool sharing the database; create
    it with ``metadata.create_all(engine)`` (or an Alembic migration) next to
    :func:`~kafka2pc.recipes.dual_write.define_state_table`.  Calling it again with
    the same name returns the table already defined.
    """
    key = name if schema is None else f"{schema}.{name}"
    existing = metadata.tables.get(key)
    if existing is not None:
        return existing
    stamp = sa.TIMESTAMP().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
    return sa.Table(
        name,
        metadata,
        sa.Column("transactional_id", sa.String(255), primary_key=True),
        sa.Column("pool", sa.String(255), nullable=False, index=True),
        sa.Column("owner", sa.String(255), nullable=True),
        sa.Column("expires_at", stamp, nullable=True),
        sa.Column("epoch", sa.BigInteger(), nullable=False, default=0),
        schema=schema,
    )


def utcnow() -> datetime:
    """Naive UTC now (the lease table's timestamps are naive UTC, like the state table's)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


@dataclass(frozen=True)
class Lease:
    """One lease as read or claimed: the id, its owner, when it expires, and its fencing epoch."""

    transactional_id: str
    owner: str | None
    expires_at: datetime | None
    epoch: int


class LeaseBook:
    """The SQL of the lease table for one pool (``prefix``) and one owner; each method is one short
    database transaction on its own connection (never the application's)."""

    def __init__(self, engine: sa.Engine, table: sa.Table, prefix: str, owner: str, lease_s: float) -> None:
        self.engine = engine
        self.table = table
        self.prefix = prefix
        self.owner = owner
        self.lease = timedelta(seconds=lease_s)

    def ids(self, size: int) -> list[str]:
        """The transactional ids of a pool of ``size``."""
        return [f"{self.prefix}-{i}" for i in range(size)]

    def ensure(self, size: int) -> None:
        """Record the ids ``<prefix>-0`` .. ``<prefix>-<size-1>`` (the ones missing; concurrent callers agree)."""
        t = self.table
        wanted = self.ids(size)
        with self.engine.connect() as conn:
            present = set(conn.execute(sa.select(t.c.transactional_id).where(t.c.pool == self.prefix)).scalars())
            conn.rollback()
            for tid in wanted:
                if tid in present:
                    continue
                try:
                    with conn.begin():
                        conn.execute(sa.insert(t).values(transactional_id=tid, pool=self.prefix, owner=None,
                                                         expires_at=None, epoch=0))
                except sa.exc.IntegrityError:
                    pass  # recorded concurrently by another instance

    def candidates(self, *, limit: int, expired_only: bool = False) -> list[Lease]:
        """Leases that may be claimed: free ones first (unless ``expired_only``), then expired ones."""
        t = self.table
        now = utcnow()
        expired = sa.and_(t.c.owner.is_not(None), t.c.expires_at < now)
        claimable = expired if expired_only else sa.or_(t.c.owner.is_(None), expired)
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.c.transactional_id, t.c.owner, t.c.expires_at, t.c.epoch)
                .where(t.c.pool == self.prefix, claimable, sa.or_(t.c.owner.is_(None), t.c.owner != self.owner))
                .order_by(t.c.expires_at.is_not(None), t.c.expires_at, t.c.transactional_id)
                .limit(limit)
            ).all()
            conn.rollback()
        return [Lease(r[0], r[1], r[2], int(r[3])) for r in rows]

    def claim(self, seen: Lease) -> Lease | None:
        """Take ``seen`` over if it is still as seen (same epoch, still free or expired); the new lease or ``None``."""
        t = self.table
        now = utcnow()
        with self.engine.begin() as conn:
            result = conn.execute(
                sa.update(t)
                .where(t.c.transactional_id == seen.transactional_id, t.c.epoch == seen.epoch,
                       sa.or_(t.c.owner.is_(None), t.c.expires_at < now))
                .values(owner=self.owner, expires_at=now + self.lease, epoch=seen.epoch + 1)
            )
            if result.rowcount != 1:
                return None
        return Lease(seen.transactional_id, self.owner, now + self.lease, seen.epoch + 1)

    def renew(self) -> dict[str, int]:
        """Extend every lease this owner holds; return them (``id -> epoch``) as the database has them now."""
        t = self.table
        mine = sa.and_(t.c.pool == self.prefix, t.c.owner == self.owner)
        with self.engine.begin() as conn:
            conn.execute(sa.update(t).where(mine).values(expires_at=utcnow() + self.lease))
            rows = conn.execute(sa.select(t.c.transactional_id, t.c.epoch).where(mine)).all()
        return {r[0]: int(r[1]) for r in rows}

    def release(self, held: Iterable[tuple[str, int]]) -> None:
        """Give leases back (nothing is open under them): free for any instance, no recovery needed."""
        self._end(held, owner=None, expires_at=None)

    def expire(self, held: Iterable[tuple[str, int]]) -> None:
        """Abandon leases (something may be open under them): expired now, under an owner that is not
        this one, so that the next orphan scan of any instance, this one included, recovers them."""
        self._end(held, owner=f"{self.owner}!abandoned", expires_at=utcnow() - timedelta(microseconds=1))

    def _end(self, held: Iterable[tuple[str, int]], *, owner: str | None, expires_at: datetime | None) -> None:
        t = self.table
        items = list(held)
        if not items:
            return
        with self.engine.begin() as conn:
            for tid, epoch in items:
                conn.execute(
                    sa.update(t)
                    .where(t.c.transactional_id == tid, t.c.owner == self.owner, t.c.epoch == epoch)
                    .values(owner=owner, expires_at=expires_at)
                )

    def read(self) -> list[Lease]:
        """Every lease of this pool (for metrics and tests)."""
        t = self.table
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.c.transactional_id, t.c.owner, t.c.expires_at, t.c.epoch)
                .where(t.c.pool == self.prefix).order_by(t.c.transactional_id)
            ).all()
            conn.rollback()
        return [Lease(r[0], r[1], r[2], int(r[3])) for r in rows]
