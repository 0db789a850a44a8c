"""An order service on FastAPI: each order row and its event are written atomically (KIP-939 dual write).

``POST /orders`` inserts the order into the database (SQLAlchemy's asyncio
extension) and produces its ``OrderPlaced`` event to Kafka in one two-phase
transaction: the 201 answer means both are committed; any failure means
neither is, or, if the service died between the two commits, that the
recovery at the next start-up commits the event of the order the database
kept.  Run it::

    pip install 'kafka2pc[aio,postgres]' fastapi uvicorn
    export ORDERS_DATABASE_URL=postgresql+psycopg://app:app@localhost/app   # or sqlite+aiosqlite:///orders.db
    export KAFKA_BOOTSTRAP_SERVERS=localhost:9092
    uvicorn fastapi_orders:app --app-dir examples --port 8000

    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"id": "o-1", "item": "book", "quantity": 2}'

Settings (environment variables):

``ORDERS_DATABASE_URL``
    SQLAlchemy async URL (default ``sqlite+aiosqlite:///orders.db``).
``KAFKA_BOOTSTRAP_SERVERS``
    default ``localhost:9092``.
``ORDERS_TOPIC``
    the events' topic (default ``orders``; it must exist).
``ORDERS_TRANSACTIONAL_ID``
    prefix of the writers' transactional ids (default ``orders-service``).
    Each instance of the service needs its own: two running instances with
    the same ids fence each other.
``ORDERS_WRITERS``
    how many writers (transactional ids ``<prefix>-0`` ... ``<prefix>-<n-1>``)
    serve requests in parallel (default 4).  One writer runs one
    transaction at a time; requests wait for a free one.  Keep the number
    when restarting: recovery settles exactly the ids it is given.
``ORDERS_KAFKA_TIMEOUT_S``
    bound on the prepare, commit and abort calls (default 30).

Start-up (the lifespan) creates the tables if missing (use migrations in a
real service) and recovers every writer before the first request: a
transaction the previous process left prepared is committed if its state is
in the database, aborted otherwise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import sqlalchemy as sa
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from kafka2pc.recipes.dual_write import define_state_table
from kafka2pc.recipes.dual_write.aio import AsyncDualWriter, recover_all
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kafka2pc import Decision, Kafka2pcError

logger = logging.getLogger("fastapi_orders")


class Base(DeclarativeBase):
    pass


class OrderRow(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    item: Mapped[str] = mapped_column(sa.String(64))
    quantity: Mapped[int]


STATE_TABLE = define_state_table(Base.metadata)  # kafka_transaction_state, created with the orders table


class Order(BaseModel):
    id: str = Field(min_length=1, max_length=64)
    item: str = Field(min_length=1, max_length=64)
    quantity: int = Field(gt=0)
    request_id: str | None = Field(default=None, max_length=64, description="echoed in the event")


class Settings:
    """The service's settings, read from the environment once."""

    def __init__(self) -> None:
        self.database_url = os.environ.get("ORDERS_DATABASE_URL", "sqlite+aiosqlite:///orders.db")
        self.bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "localhost:9092")
        self.topic = os.environ.get("ORDERS_TOPIC", "orders")
        self.transactional_id = os.environ.get("ORDERS_TRANSACTIONAL_ID", "orders-service")
        self.writers = int(os.environ.get("ORDERS_WRITERS", "4"))
        self.kafka_timeout_s = float(os.environ.get("ORDERS_KAFKA_TIMEOUT_S", "30"))


class Writers:
    """A fixed set of writers; a request borrows a free one for the duration of its transaction."""

    def __init__(self, writers: list[AsyncDualWriter]) -> None:
        self.all = writers
        self._free: asyncio.Queue[AsyncDualWriter] = asyncio.Queue()
        for writer in writers:
            self._free.put_nowait(writer)

    @asynccontextmanager
    async def borrow(self) -> AsyncIterator[AsyncDualWriter]:
        writer = await self._free.get()
        try:
            yield writer
        finally:
            self._free.put_nowait(writer)


def make_engine(url: str) -> AsyncEngine:
    if url.startswith("sqlite"):
        # One write lock for the whole database: let a transaction wait for it (seconds) rather than fail.
        return create_async_engine(url, connect_args={"timeout": 30})
    return create_async_engine(url, pool_size=10, max_overflow=10)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings = Settings()
    engine = make_engine(settings.database_url)
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    config = {"bootstrap.servers": settings.bootstrap}
    writers = [
        AsyncDualWriter(engine, {**config, "transactional.id": f"{settings.transactional_id}-{i}"},
                        state_table=STATE_TABLE, kafka_timeout_s=settings.kafka_timeout_s)
        for i in range(settings.writers)
    ]
    # Recovery before the first request: settle what the previous process left prepared.
    results = await recover_all(writers)
    failed = {tid: result for tid, result in results.items() if not result.ok}
    if failed:
        raise RuntimeError(f"recovery failed, not starting: {failed}")
    for tid, result in sorted(results.items()):
        if result.decision is not Decision.NOTHING:
            logger.warning("%s: recovered the previous transaction: %s", tid, result.decision.value)
    app.state.settings, app.state.engine, app.state.writers = settings, engine, Writers(writers)
    try:
        yield
    finally:
        for writer in writers:
            await writer.close()
        await engine.dispose()


app = FastAPI(title="orders", lifespan=lifespan)


@app.exception_handler(Kafka2pcError)
async def kafka2pc_error(request: Request, exc: Kafka2pcError) -> JSONResponse:
    # Neither side committed, or (IndefiniteOutcomeError) the outcome is settled by the next recovery:
    # the client may retry with the same order id (a duplicate is refused with 409).
    logger.warning("%s %s failed: %r", request.method, request.url.path, exc)
    return JSONResponse({"detail": f"{type(exc).__name__}: {exc}"}, status_code=503)


@app.post("/orders", status_code=201)
async def place_order(order: Order, request: Request) -> dict[str, Any]:
    """Insert the order and produce its event, atomically."""
    state = request.app.state
    event = {"type": "OrderPlaced", **order.model_dump()}
    async with state.writers.borrow() as writer, AsyncSession(state.engine) as session:
        try:
            async with writer.transaction(session) as tx:
                session.add(OrderRow(id=order.id, item=order.item, quantity=order.quantity))
                await tx.produce(state.settings.topic, key=order.id, value=json.dumps(event))
        except sa.exc.IntegrityError as exc:  # at the flush before the prepare: both sides rolled back
            raise HTTPException(409, f"order {order.id!r} exists") from exc
    return {"id": order.id, "transactional_id": writer.transactional_id}


@app.get("/orders/{order_id}")
async def get_order(order_id: str, request: Request) -> dict[str, Any]:
    async with AsyncSession(request.app.state.engine) as session:
        row = await session.get(OrderRow, order_id)
    if row is None:
        raise HTTPException(404, f"no order {order_id!r}")
    return {"id": row.id, "item": row.item, "quantity": row.quantity}


@app.get("/health")
async def health(request: Request) -> dict[str, Any]:
    writers = request.app.state.writers.all
    return {
        "writers": {w.transactional_id: w.state.value for w in writers},
        "committed": sum(w.metrics().transactions_committed for w in writers),
        "rolled_back": sum(w.metrics().transactions_rolled_back for w in writers),
    }


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(os.environ.get("PORT", "8000")))
