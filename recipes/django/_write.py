"""``dual_write()`` and ``adual_write()``: Django's ``transaction.atomic`` and a Kafka transaction, one outcome.

The block is the outermost ``transaction.atomic`` of its database alias.
Inside it, the dual write's pool (:class:`~kafka2pc.recipes.dual_write.WriterPool`)
runs its usual transaction on a SQLAlchemy connection that *is* Django's
connection (see ``_engines``): the state row is locked or checked, the Kafka
transaction begun, the application's ORM writes and records follow, then the
prepare, the state update and the COMMIT (the decision) and the Kafka commit,
exactly as for a SQLAlchemy application (pipelined, the Kafka commit runs in
the pool's background once the COMMIT is durable).  Django's ``atomic`` then
closes over a transaction that has already committed, and runs its
``on_commit`` callbacks.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db import Error as DjangoDatabaseError
from django.utils.connection import ConnectionDoesNotExist
from sqlalchemy.orm import Session

from kafka2pc import PreparedTxnState, UsageError
from kafka2pc._deprecation import deprecated_property

from ..dual_write import DualWriteTransaction, TransactionMisuseError
from ..dual_write._async_handle import AsyncHandleCalls, Headers
from ._engines import savepoint_block
from ._errors import to_django
from ._guard import BlockGuards
from ._runtime import AliasRuntime, runtime_for

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = ["AsyncDualWriteTransaction", "NestedAtomicError", "adual_write", "dual_write", "in_test_case"]

logger = logging.getLogger("kafka2pc.recipes.django")


class NestedAtomicError(TransactionMisuseError):
    """``dual_write()`` was entered inside ``transaction.atomic`` (or with autocommit off) on its alias.

    Its transaction must be the outermost one: an enclosing block would
    commit (or not) after the Kafka transaction was already committed.
    Raised on entry, before anything is written.
    """


class _RollbackRequested(Exception):
    """The block marked its transaction for rollback (``transaction.set_rollback(True)``)."""


def in_test_case(alias: str) -> bool:
    """True when the only atomic blocks open on ``alias`` are those a ``django.test.TestCase`` opened.

    Django marks them (``Atomic._from_testcase``, the flag its ``durable``
    check reads): a dual write there runs in the test's transaction (see
    :func:`dual_write`).
    """
    return _in_test_case_blocks(connections[alias])


def _in_test_case_blocks(conn: BaseDatabaseWrapper) -> bool:
    blocks = conn.atomic_blocks
    return bool(conn.in_atomic_block and blocks and all(getattr(b, "_from_testcase", False) for b in blocks))


def _atomic_requests_hint(conn: BaseDatabaseWrapper) -> str:
    if conn.settings_dict.get("ATOMIC_REQUESTS"):
        return (f"; DATABASES[{conn.alias!r}]['ATOMIC_REQUESTS'] is on: decorate the view with "
                "@transaction.non_atomic_requests (or non_atomic_requests(using=...)) so that dual_write() "
                "opens the request's transaction itself")
    return ("; a view under @transaction.atomic: remove the decorator (dual_write() is the view's transaction), "
            "and with ATOMIC_REQUESTS decorate the view with @transaction.non_atomic_requests")


def _connection(alias: str) -> BaseDatabaseWrapper:
    """Django's connection of ``alias`` in this thread (looked up once per block)."""
    try:
        return connections[alias]
    except ConnectionDoesNotExist as exc:
        raise UsageError(f"dual_write(using={alias!r}): settings.DATABASES has no database {alias!r}") from exc


def _check_outermost(conn: BaseDatabaseWrapper) -> bool:
    """Refuse an enclosing transaction; True if the enclosing ones are a ``TestCase``'s (test-case mode)."""
    alias = conn.alias
    if conn.in_atomic_block:
        if _in_test_case_blocks(conn):
            if conn.vendor == "sqlite":
                raise NestedAtomicError(
                    f"dual_write(using={alias!r}) inside a django.test.TestCase on SQLite: SQLite admits one writer, "
                    "and the test's transaction holds the database, so the pool's leases cannot be written. Use "
                    "TransactionTestCase (pytest: django_db(transaction=True)) on SQLite, or TestCase on "
                    "PostgreSQL or MySQL/MariaDB"
                )
            return True
        raise NestedAtomicError(
            f"dual_write(using={alias!r}) must be the outermost transaction.atomic of database {alias!r}, but it "
            f"was entered inside one{_atomic_requests_hint(conn)}. Nothing was written"
        )
    if not conn.get_autocommit():
        raise NestedAtomicError(f"dual_write(using={alias!r}) needs autocommit on database {alias!r} (Django's "
                                "default); transaction.set_autocommit(False) is in effect")
    return False


@contextmanager
def dual_write(using: str | None = None, *, wait_visible: bool = False) -> Iterator[DualWriteTransaction]:
    """Write rows with Django's ORM and records to Kafka in one transaction: both commit, or neither.

    ``using`` is the database alias (default ``"default"``).  The block is
    the outermost ``transaction.atomic`` of that alias: entered inside
    another one it raises :class:`NestedAtomicError` at once.  An exception
    in the block, or ``transaction.set_rollback(True)``, rolls the rows back
    and aborts the Kafka transaction (the exception propagates; a rollback
    asked for by ``set_rollback`` ends the block quietly).  Statements that
    would end the database transaction are refused
    (:class:`~kafka2pc.recipes.dual_write.TransactionMisuseError`, and the
    block rolls back on both sides), and so are writes sent, in the block's
    thread, to another database alias (they would commit outside the
    two-phase commit).  The yielded handle's ``produce()`` is
    :meth:`~kafka2pc.recipes.dual_write.DualWriteTransaction.produce`.

    With ``POOL_OPTIONS["pipelined"]`` the block returns once the database
    COMMIT is durable (the outcome is decided then) and the Kafka commit
    completes in the background: its records reach ``read_committed``
    consumers a moment later, and ``on_commit`` callbacks run before that.
    ``wait_visible=True`` waits for the Kafka commit too (so does a block in
    a ``django.test.TestCase``); without pipelining every block does.

    Bounds: waiting for a free transactional id, including the recovery of
    a newly leased one, ``POOL_OPTIONS["acquire_timeout_s"]`` (default 30 s);
    the Kafka calls, ``POOL_OPTIONS["kafka_timeout_s"]`` (default 30 s); the state-row
    lock, ``POOL_OPTIONS["lock_timeout_s"]``; pipelined, a free place among
    ``max_in_flight`` background commits (each ends within ``kafka_timeout_s``).  Errors are those of
    :meth:`WriterPool.transaction <kafka2pc.recipes.dual_write.WriterPool.transaction>`,
    with every database error as Django's (``django.db.OperationalError``,
    ``IntegrityError``...; never ``sqlalchemy.exc``).

    Example::

        from kafka2pc.recipes.django import dual_write

        with dual_write() as tx:
            order = Order.objects.create(sku="book", quantity=1)
            tx.produce("orders", key=str(order.pk), value=order.to_json())
    """
    # One generator and one lookup of Django's connection per block: this runs on every request.
    alias = using or DEFAULT_DB_ALIAS
    conn = _connection(alias)
    test_case = _check_outermost(conn)
    runtime = runtime_for(alias)
    guards = BlockGuards(conn)
    try:
        if test_case:
            with _in_test_case(runtime, conn) as session, guards, \
                    runtime.pool.transaction(session, wait_visible=True) as tx:
                yield tx
                _check_block_end(guards, conn)
        else:
            engine = runtime.borrowed()  # made (its dialect initialised) outside the block's transaction
            # The block's transaction.atomic (the request's transaction), and the SQLAlchemy connection on it.
            atomic = transaction.atomic(using=alias)
            atomic.__enter__()
            try:
                with engine.connect() as bind, guards, runtime.pool.transaction(bind, wait_visible=wait_visible) as tx:
                    yield tx
                    _check_block_end(guards, conn)
            except BaseException:
                atomic.__exit__(*sys.exc_info())
                raise
            _close_atomic(atomic, conn)
    except _RollbackRequested:
        logger.debug("%s: the block asked for a rollback; both sides rolled back", alias)
    except sa.exc.SQLAlchemyError as exc:
        raise to_django(exc, alias) from exc


def _check_block_end(guards: BlockGuards, conn: BaseDatabaseWrapper) -> None:
    """At the end of the block's body: fail on a refused statement (even one whose error was caught), and
    roll back quietly when the block asked for it (``transaction.set_rollback(True)``)."""
    refused = guards.refused()
    if refused is not None:
        raise refused
    if conn.needs_rollback:
        raise _RollbackRequested


def _close_atomic(atomic: transaction.Atomic, conn: BaseDatabaseWrapper) -> None:
    """Leave the block's ``transaction.atomic`` after the pool's transaction ended normally.

    The database has committed then: its COMMIT was answered, or its answer
    was lost and the read-back of the state row found it committed
    (``IndefiniteOutcomeError`` when the read-back cannot tell).  Django's
    own COMMIT at the atomic block's exit then has nothing left to commit,
    but it still talks to the connection (MySQL sends it), which may be dead
    by then: its error would turn a write that committed on both sides into
    a failure, and drop the ``on_commit`` callbacks.  So that error is
    logged, not raised (Django has already closed the connection, as for any
    connection lost in a transaction), and the callbacks run here, in order,
    as Django would have run them.
    """
    callbacks = list(conn.run_on_commit)
    try:
        atomic.__exit__(None, None, None)
    except DjangoDatabaseError as exc:
        logger.warning("%s: the block committed on both sides, then Django's connection failed (%r): the block "
                       "succeeded; Django reconnects", conn.alias, exc)
        _run_on_commit(conn.alias, callbacks)


def _run_on_commit(alias: str, callbacks: list[Any]) -> None:
    """Django's ``on_commit`` callbacks, ``(savepoint ids, callback, robust)`` each, as Django runs them."""
    for _sids, callback, robust in callbacks:
        if robust:
            try:
                callback()
            except Exception:
                logger.exception("%s: a robust on_commit callback failed", alias)
        else:
            callback()


@contextmanager
def _in_test_case(runtime: AliasRuntime, conn: BaseDatabaseWrapper) -> Iterator[Session]:
    """The block's savepoint in the test's transaction, and a Session on it whose COMMIT sends nothing.

    A Session, not a Connection: the pool then sends the state update and the
    COMMIT as two calls (never the one-statement ``...; COMMIT`` of psycopg 3),
    and the COMMIT is ``_engines.test_case_engine``'s, which sends nothing and keeps
    the rows in the test's transaction.
    """
    with transaction.atomic(using=conn.alias), runtime.test_case().connect() as borrowed, \
            savepoint_block(conn, conn.savepoint_ids[-1]), Session(bind=borrowed) as session:
        yield session


class AsyncDualWriteTransaction:
    """The handle ``adual_write()`` yields: :class:`DualWriteTransaction`'s methods as coroutines.

    The Django twin of :class:`kafka2pc.recipes.dual_write.aio.AsyncDualWriteTransaction`, under the same
    name; its :attr:`connection` is the block's sync connection (Django's own), since the block's database
    work runs in Django's thread.  ``AsyncDualWrite`` is its deprecated name.

    Each call runs in Django's thread-sensitive executor thread, the thread
    where the block's transaction (and Django's async ORM calls) run.
    """

    def __init__(self, handle: DualWriteTransaction) -> None:
        self._calls = AsyncHandleCalls(handle, _in_block_thread)

    @property
    def transactional_id(self) -> str:
        """The Kafka transactional id this transaction runs under."""
        return self._calls.handle.transactional_id

    @property
    def prepared_state(self) -> PreparedTxnState | None:
        """The state stored in the database once the transaction is prepared."""
        return self._calls.handle.prepared_state

    @property
    def records_produced(self) -> int:
        """How many records this transaction produced so far."""
        return self._calls.handle.records_produced

    @property
    def sync_transaction(self) -> DualWriteTransaction:
        """The synchronous handle (for code already running in the block's thread)."""
        return self._calls.handle

    sync = deprecated_property("sync", "sync_transaction", lambda self: self._calls.handle)

    @property
    def connection(self) -> Any:
        """The block's database connection, as a SQLAlchemy ``Connection`` (Django's own underneath)."""
        return self._calls.handle.connection

    async def produce(
        self,
        topic: str,
        value: str | bytes | None = None,
        key: str | bytes | None = None,
        partition: int | None = None,
        on_delivery: Callable[[Any, Any], None] | None = None,
        timestamp: int | None = None,
        headers: Headers | None = None,
    ) -> None:
        """Produce one record in the transaction (arguments as :meth:`DualWriteTransaction.produce`).

        Returns once librdkafka has the record (an enqueue; the prepare
        waits for its delivery).  ``error`` in ``on_delivery(error, message)``
        is the kafka2pc error of a failed delivery.  A full local queue is
        waited out for up to the writer's ``queue_full_timeout_s``; the first
        record of a topic the writer has not seen yet waits for one metadata
        request.  The waits happen in the block's thread.
        """
        await self._calls.produce(topic, value, key, partition, on_delivery, timestamp, headers)

    async def send_offsets_to_transaction(self, offsets: list[Any], group_metadata: Any) -> None:
        """Commit consumer offsets with this transaction (exactly-once consume-transform-produce)."""
        await self._calls.send_offsets_to_transaction(offsets, group_metadata)

    async def send_consumer_offsets(self, consumer: Any) -> None:
        """Commit the current positions of ``consumer``'s assignment (a ``confluent_kafka.Consumer``)."""
        await self._calls.send_consumer_offsets(consumer)


async def _in_block_thread(call: Callable[[], None]) -> None:
    """Run ``call`` in Django's thread-sensitive executor thread (the block's)."""
    from asgiref.sync import sync_to_async

    await sync_to_async(call, thread_sensitive=True)()


@asynccontextmanager
async def adual_write(using: str | None = None, *, wait_visible: bool = False
                      ) -> AsyncIterator[AsyncDualWriteTransaction]:
    """:func:`dual_write` for async views: ``async with adual_write() as tx``.

    Django runs transactions only in synchronous code, so the block's
    database work happens in Django's thread-sensitive executor thread: the
    entry (lease, begin, state-row lock), every ``await tx.produce(...)``,
    the end (prepare, state update, COMMIT, Kafka commit) and the async ORM
    calls in the block (``await Order.objects.acreate(...)``), which Django
    sends to that same thread and so to the same connection and
    transaction.  The event loop only awaits.  The bounds, and
    ``wait_visible`` with a pipelined pool, are :func:`dual_write`'s.

    A cancellation (Django cancels an async view whose client disconnected)
    at any ``await`` releases everything the block holds: cancelled while
    the entry runs, the entry is left to finish in its thread and is then
    rolled back on both sides; in the block, the block rolls back; during the
    end, the end runs to its outcome.  The cancelled task does not wait
    longer than that work (the bounds above); the ``CancelledError`` then
    propagates.
    """
    from asgiref.sync import sync_to_async

    manager = dual_write(using, wait_visible=wait_visible)
    enter = asyncio.ensure_future(sync_to_async(manager.__enter__, thread_sensitive=True)())
    try:
        # Shielded: a cancellation (the client went away) must not leave the entry running unseen in
        # Django's thread, holding a lease, a Kafka transaction and the state-row lock until garbage collection.
        tx = await asyncio.shield(enter)
    except BaseException as exc:
        if not (enter.done() and (enter.cancelled() or enter.exception() is not None)):
            await _finish_in_background(_undo_entry(enter, manager, exc))
        raise
    try:
        yield AsyncDualWriteTransaction(tx)
    except BaseException as exc:
        end = asyncio.ensure_future(
            sync_to_async(manager.__exit__, thread_sensitive=True)(type(exc), exc, exc.__traceback__))
        suppress = await _finish_in_background(end)
        if not suppress:
            raise
    else:
        await _finish_in_background(sync_to_async(manager.__exit__, thread_sensitive=True)(None, None, None))


_ending: set[asyncio.Future[Any]] = set()
"""The ends of blocks whose awaiting task was cancelled, kept referenced until they are done."""


async def _finish_in_background(work: Awaitable[Any]) -> Any:
    """Await ``work``; cancelled meanwhile, it still runs to its end (bounded by the block's bounds).

    The rollback or commit of a block runs in Django's thread whatever the
    event loop does; a cancellation of the task awaiting it (the client went
    away) only stops the waiting.
    """
    future = asyncio.ensure_future(work)
    _ending.add(future)
    future.add_done_callback(_ending.discard)
    return await asyncio.shield(future)


async def _undo_entry(enter: asyncio.Future[DualWriteTransaction], manager: AbstractContextManager[Any],
                      cause: BaseException) -> None:
    """The entry was interrupted while it ran: wait for it, then roll back what it opened (both sides)."""
    from asgiref.sync import sync_to_async

    try:
        await enter
    except BaseException:  # noqa: BLE001 - the entry failed: it let go of everything itself
        return
    try:
        await sync_to_async(manager.__exit__, thread_sensitive=True)(type(cause), cause, cause.__traceback__)
    except BaseException as exc:  # noqa: BLE001 - the caller's cancellation is what it sees
        logger.warning("adual_write(): rolling back the block whose entry was cancelled raised %r", exc)
