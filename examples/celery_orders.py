"""An order service's Celery tasks: each order row and its event are written atomically (KIP-939 dual write).

``place_order`` inserts the order into the database and produces its
``OrderPlaced`` event to Kafka in one two-phase transaction, on a
:class:`~kafka2pc.recipes.dual_write.WriterPool`.  A task that succeeded has
both committed; a task that failed, or whose worker process was killed, has
committed neither, or (killed between the two commits) has committed the
database, and the pool of a live worker process commits its event.  Run it::

    pip install 'kafka2pc[postgres]' 'celery[redis]'
    export ORDERS_DATABASE_URL=postgresql+psycopg://app:app@localhost/app
    export KAFKA_BOOTSTRAP_SERVERS=localhost:9092
    export CELERY_BROKER_URL=redis://localhost:6379/0
    celery --workdir examples -A celery_orders worker --pool=prefork --concurrency=4

    # from a Python shell with the same environment, in examples/:
    #   from celery_orders import place_order
    #   place_order.delay("o-1", "book", 2).get(timeout=30)

**Where the pool is made.** Celery's prefork pool forks its child processes
from the main one.  confluent-kafka's producers, SQLAlchemy's pooled
connections and the pool's background threads do not survive a fork, so each
child makes its own engine and pool in ``worker_process_init`` and closes them
in ``worker_process_shutdown``.  The main process only creates the tables
(``worker_init``, before it forks), on an engine it disposes of at once.

**Retries and killed workers.** ``acks_late`` with
``task_reject_on_worker_lost`` puts a task whose worker process was killed
back on the queue, and the task runs again.  The dual write makes that safe:
either the first run committed both sides, and the second finds the order and
returns, or it committed neither, and the second places it.  A first run
killed between its database COMMIT and its Kafka commit left the order in the
database: the second run finds it, and the orphan scan of a live process's
pool (within about ``lease_s`` plus ``1.2 * scan_every_s``) commits its event.
So each order has exactly one event, however often its task ran.

Settings (environment variables):

``ORDERS_DATABASE_URL``
    SQLAlchemy URL (default ``sqlite:///orders.db``; use a server database
    with more than one worker process).
``KAFKA_BOOTSTRAP_SERVERS``
    default ``localhost:9092``.
``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND``
    Celery's broker (default ``redis://localhost:6379/0``) and its result
    backend (default: the broker's URL).
``ORDERS_TOPIC``
    the events' topic (default ``orders``; it must exist).
``ORDERS_POOL_PREFIX``
    the pool's transactional-id prefix (default ``orders-celery``), shared by
    every worker process of every host.
``ORDERS_POOL_SIZE``
    the pool's ids (default 32): at least the number of tasks all worker
    processes of all hosts run at once.
``ORDERS_LEASE_S``
    the pool's lease (default 15 s): how long a killed process's open
    transaction can hold ``read_committed`` consumers back before a live
    process settles it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import sqlalchemy as sa
from celery import Celery
from celery.signals import worker_init, worker_process_init, worker_process_shutdown
from kafka2pc.recipes.dual_write import WriterPool, define_lease_table, define_state_table
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kafka2pc import BrokerUnavailableError, RetriableError

logger = logging.getLogger("celery_orders")

DATABASE_URL = os.environ.get("ORDERS_DATABASE_URL", "sqlite:///orders.db")
BOOTSTRAP = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "localhost:9092")
TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
POOL_PREFIX = os.environ.get("ORDERS_POOL_PREFIX", "orders-celery")
POOL_SIZE = int(os.environ.get("ORDERS_POOL_SIZE", "32"))
LEASE_S = float(os.environ.get("ORDERS_LEASE_S", "15"))
BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/0")

app = Celery("celery_orders", broker=BROKER_URL, backend=os.environ.get("CELERY_RESULT_BACKEND", BROKER_URL))
app.conf.update(
    task_acks_late=True,  # a task is acknowledged when it ends, not when it starts ...
    task_reject_on_worker_lost=True,  # ... and put back on the queue when its process dies
    worker_prefetch_multiplier=1,  # a process reserves one task at a time
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
)


class Base(DeclarativeBase):
    pass


class OrderRow(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    item: Mapped[str] = mapped_column(sa.String(64))
    quantity: Mapped[int]


define_state_table(Base.metadata)  # kafka_transaction_state
define_lease_table(Base.metadata)  # kafka_writer_lease

# This worker process's engine and pool: made after the fork, in worker_process_init.
_engine: sa.Engine | None = None
_pool: WriterPool | None = None


@worker_init.connect
def create_tables(**_: Any) -> None:
    """In the main process, before it forks: create the tables (use migrations in a real service)."""
    engine = sa.create_engine(DATABASE_URL)
    try:
        Base.metadata.create_all(engine)
    finally:
        engine.dispose()  # nothing of it crosses the fork


@worker_process_init.connect
def make_pool(**_: Any) -> None:
    """In each child process: its own engine and pool, and the orphans of killed processes settled at once."""
    global _engine, _pool
    _engine = sa.create_engine(DATABASE_URL, pool_pre_ping=True)
    # One slot: a prefork child runs one task at a time.
    _pool = WriterPool(_engine, {"bootstrap.servers": BOOTSTRAP}, prefix=POOL_PREFIX, size=POOL_SIZE,
                       max_slots=1, lease_s=LEASE_S)
    for result in _pool.settle_orphans():  # the pool's scan would, within a third of the lease
        if result.error is not None:
            logger.warning("%s left by a stopped process: not settled yet (%s)", result.transactional_id, result.error)
        else:
            logger.info("%s left by a stopped process: %s", result.transactional_id, result.decision.name)


@worker_process_shutdown.connect
def close_pool(**_: Any) -> None:
    """In each child process as it stops: give the leases back."""
    if _pool is not None:
        _pool.close(timeout=10.0)
    if _engine is not None:
        _engine.dispose()


def _placed(order_id: str) -> bool:
    assert _engine is not None
    with Session(_engine) as session:
        return session.get(OrderRow, order_id) is not None


@app.task(autoretry_for=(RetriableError, BrokerUnavailableError), retry_backoff=True, max_retries=5)
def place_order(order_id: str, item: str, quantity: int) -> str:
    """Insert the order and produce its event, both or neither; a second run of the same order changes nothing."""
    if _pool is None or _engine is None:
        raise RuntimeError("the pool is made in worker_process_init: run this task in a Celery worker")
    if _placed(order_id):  # an earlier run of this task committed (its worker was killed after it)
        return "already placed"
    event = {"type": "OrderPlaced", "id": order_id, "item": item, "quantity": quantity}
    try:
        with Session(_engine) as session, _pool.transaction(session) as tx:
            session.add(OrderRow(id=order_id, item=item, quantity=quantity))
            session.flush()
            tx.produce(TOPIC, key=order_id.encode(), value=json.dumps(event).encode())
    except sa.exc.IntegrityError:  # another run placed it meanwhile: this one rolled back on both sides
        return "already placed"
    return "placed"
