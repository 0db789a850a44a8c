"""The dual-write recipe for asyncio services: SQLAlchemy's asyncio extension, FastAPI, Starlette.

::

    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
    from kafka2pc.recipes.dual_write.aio import AsyncDualWriter

    engine = create_async_engine("postgresql+psycopg://app@db/app")   # or sqlite+aiosqlite:///app.db
    writer = AsyncDualWriter(engine, {"bootstrap.servers": "kafka:9092",
                                      "transactional.id": "orders-1"})
    await writer.recover()                      # at start-up (a FastAPI lifespan)
    async with AsyncSession(engine) as session:
        async with writer.transaction(session) as tx:
            session.add(Order(id=42))
            await tx.produce("orders", key=b"42", value=b"created")

:class:`AsyncDualWriter` is :class:`~kafka2pc.recipes.dual_write.DualWriter`
run on the event loop: the same steps, state table, recovery, misuse guards
and errors (the sync recipe's code, unchanged, in SQLAlchemy's greenlet
bridge), with an :class:`~kafka2pc.aio.AsyncTwoPhaseCommitProducer` for Kafka.
The value types (:class:`~kafka2pc.recipes.dual_write.Step`,
:class:`~kafka2pc.recipes.dual_write.RecoveryResult`, the errors, the
tables) are the sync recipe's; import them from
``kafka2pc.recipes.dual_write``.  :class:`AsyncWriterPool` is
:class:`~kafka2pc.recipes.dual_write.WriterPool` on the event loop the same
way: leased transactional ids, one slot per concurrent transaction, orphans
of dead instances settled.  See ``docs/asyncio.md``.
"""

from kafka2pc._extras import missing_extra

try:
    import importlib

    importlib.import_module("greenlet")  # SQLAlchemy's asyncio extension needs it (sqlalchemy[asyncio])
    import sqlalchemy.ext.asyncio  # noqa: F401
except ImportError as exc:
    raise missing_extra(exc, extra="aio", feature="kafka2pc.recipes.dual_write.aio") from exc

from ._pool import AsyncWriterPool
from ._writer import AsyncBind, AsyncDualWriter, AsyncDualWriteTransaction, recover_all

__all__ = ["AsyncBind", "AsyncDualWriteTransaction", "AsyncDualWriter", "AsyncWriterPool", "recover_all"]
