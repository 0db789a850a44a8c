"""Database failures under ``dual_write()`` keep Django's promises: real PostgreSQL and MariaDB, a real broker.

A connection killed (``pg_terminate_backend``, MariaDB's ``KILL CONNECTION``) during the block, while idle
before it (the first statement is the state row's), just before the COMMIT and just after it; a COMMIT
whose answer is lost (a TCP proxy drops the server's replies, then cuts the connection) while the
database committed.  Each time: the error that leaves ``dual_write()`` is a ``django.db`` error (never
``sqlalchemy.exc``), a write whose COMMIT happened returns normally with its ``on_commit`` callbacks run,
rows = ``read_committed`` records, nothing is left open, and a disconnect in one thread closes no other
thread's connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from django.db import Error, OperationalError, connections, transaction
from djtest.models import Item
from harness.tcp_proxy import TcpProxy
from kafka2pc.recipes.django import dual_write
from kafka2pc.recipes.django._runtime import close_all
from kafka2pc.recipes.dual_write import Step

from kafka2pc.testing import drain, end_offsets, settled_end_offsets

#: ``alias`` on PostgreSQL (with SQLite's ``default``, which Django's test databases depend on).
_ON_PG = [pytest.param("pg", id="postgresql",
                       marks=pytest.mark.django_db(transaction=True, databases=["default", "pg"]))]


def _records(bootstrap: str, topic: str) -> list[str]:
    return sorted(r.value.decode() for r in drain(bootstrap, topic, "read_committed") if r.value)


def _rows(alias: str) -> list[str]:
    return sorted(Item.objects.using(alias).values_list("id", flat=True))


def _backend_id(alias: str) -> int:
    conn = connections[alias]
    conn.ensure_connection()
    with conn.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()" if conn.vendor == "postgresql" else "SELECT CONNECTION_ID()")
        return int(cursor.fetchone()[0])


_ADMINS: dict[str, sa.Engine] = {}


def _admin(alias: str) -> sa.Engine:
    """An engine straight to the alias's server (past any proxy), for the kills."""
    if alias not in _ADMINS:
        s = connections[alias].settings_dict
        driver = "postgresql+psycopg" if connections[alias].vendor == "postgresql" else "mysql+pymysql"
        # AUTOCOMMIT: PostgreSQL keeps one snapshot of pg_stat_activity per transaction, so a poll inside one
        # transaction would see a terminated backend for as long as it runs.
        _ADMINS[alias] = sa.create_engine(sa.URL.create(driver, s["USER"], s["PASSWORD"], s["HOST"], int(s["PORT"]),
                                                        s["NAME"]), poolclass=sa.pool.NullPool,
                                          isolation_level="AUTOCOMMIT")
    return _ADMINS[alias]


def _kill(alias: str, backend: int) -> None:
    """Kill the server side of one connection, from another connection, and wait until it is gone."""
    with _admin(alias).connect() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": backend})
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                left = conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"),
                                    {"pid": backend}).scalar_one()
                if left == 0:
                    return
                time.sleep(0.02)
            raise AssertionError(f"backend {backend} still there")
        conn.exec_driver_sql(f"KILL CONNECTION {int(backend)}")


def _write(alias: str, topic: str, rid: str, hooks: list[str] | None = None) -> None:
    with dual_write(using=alias) as tx:
        Item.objects.using(alias).create(id=rid, series="s")
        tx.produce(topic, value=rid.encode(), key=rid.encode())
        if hooks is not None:
            transaction.on_commit(lambda: hooks.append(rid), using=alias)


def _heal(alias: str) -> None:
    """What Django does at the end of a request whose database failed: close an unusable connection."""
    connections[alias].close_if_unusable_or_obsolete()


def _consistent(alias: str, bootstrap: str, topic: str) -> list[str]:
    rows = _rows(alias)
    assert rows == _records(bootstrap, topic)
    assert settled_end_offsets(bootstrap, topic) == end_offsets(bootstrap, topic, "read_uncommitted")
    return rows


def _arm(k2pc_settings: dict[str, Any], step: Step, action: Any) -> list[Step]:
    """A pool whose ``on_step`` runs ``action`` once, at the first ``step``; returns the steps seen."""
    seen: list[Step] = []

    def hook(at: Step) -> None:
        seen.append(at)
        if at is step and seen.count(step) == 1:
            action()

    close_all()
    k2pc_settings["POOL_OPTIONS"] = {**k2pc_settings["POOL_OPTIONS"], "on_step": hook}
    return seen


def test_killed_during_the_block(alias_pg_maria: str, kafka_bootstrap: str, topic_factory: Any) -> None:
    alias, topic = alias_pg_maria, topic_factory()
    with pytest.raises(Error) as raised:  # OperationalError, or InterfaceError from PyMySQL
        with dual_write(using=alias) as tx:
            Item.objects.using(alias).create(id="lost", series="s")
            tx.produce(topic, value=b"lost")
            _kill(alias, _backend_id(alias))
            Item.objects.using(alias).create(id="lost-2", series="s")
    assert not type(raised.value).__module__.startswith("sqlalchemy")
    _heal(alias)
    _write(alias, topic, "after")
    assert _consistent(alias, kafka_bootstrap, topic) == ["after"]


def test_idle_connection_killed_before_the_block(alias_pg_maria: str, kafka_bootstrap: str,
                                                 topic_factory: Any) -> None:
    alias, topic = alias_pg_maria, topic_factory()
    _write(alias, topic, "before")
    _kill(alias, _backend_id(alias))  # a PgBouncer or a server timeout closing an idle connection
    with pytest.raises(OperationalError) as raised:  # the state row's statement is the first to fail
        _write(alias, topic, "lost")
    assert not type(raised.value).__module__.startswith("sqlalchemy")
    _heal(alias)
    _write(alias, topic, "after")
    assert _consistent(alias, kafka_bootstrap, topic) == ["after", "before"]


def test_killed_just_before_the_commit(alias_pg_maria: str, k2pc_settings: dict[str, Any], kafka_bootstrap: str,
                                       topic_factory: Any) -> None:
    alias, topic = alias_pg_maria, topic_factory()
    backend = _backend_id(alias)
    seen = _arm(k2pc_settings, Step.DB_COMMITTING, lambda: _kill(alias, backend))
    hooks: list[str] = []
    with pytest.raises(OperationalError):  # the COMMIT did not happen: an error is the truth
        _write(alias, topic, "lost", hooks)
    assert Step.DB_COMMITTING in seen and Step.DB_COMMITTED not in seen and hooks == []
    _heal(alias)
    _write(alias, topic, "after", hooks)
    assert hooks == ["after"]
    assert _consistent(alias, kafka_bootstrap, topic) == ["after"]


def test_killed_just_after_the_commit(alias_pg_maria: str, k2pc_settings: dict[str, Any], kafka_bootstrap: str,
                                      topic_factory: Any) -> None:
    alias, topic = alias_pg_maria, topic_factory()
    backend = _backend_id(alias)
    _arm(k2pc_settings, Step.DB_COMMITTED, lambda: _kill(alias, backend))
    hooks: list[str] = []
    _write(alias, topic, "kept", hooks)  # committed on both sides: no error
    assert hooks == ["kept"]
    _heal(alias)
    _write(alias, topic, "after", hooks)
    assert _consistent(alias, kafka_bootstrap, topic) == ["after", "kept"]


class _MutingProxy(TcpProxy):
    """A :class:`TcpProxy` that can drop the server's replies (``muted``) while still forwarding the client's."""

    muted = False

    def cut(self) -> None:
        """Close the open connections (the listener stays: new connections go through)."""
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        upstream = src.getpeername()[1] == self.upstream[1]
        try:
            while data := src.recv(65536):
                if not (upstream and self.muted):
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            src.close()


@contextlib.contextmanager
def _through_proxy(alias: str) -> Iterator[_MutingProxy]:
    settings = connections[alias].settings_dict  # the dict every wrapper of the alias reads, the pool's too
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proxy = _MutingProxy(port, (settings["HOST"], int(settings["PORT"])))
    proxy.up()
    original = (settings["HOST"], settings["PORT"])
    close_all()
    connections[alias].close()
    settings["HOST"], settings["PORT"] = "127.0.0.1", str(port)
    try:
        yield proxy
    finally:
        close_all()
        connections[alias].close()
        settings["HOST"], settings["PORT"] = original
        proxy.down()


@pytest.mark.parametrize("alias", _ON_PG, indirect=True)
def test_a_lost_commit_answer_of_a_committed_write_is_a_success(alias: str, k2pc_settings: dict[str, Any],
                                                                 kafka_bootstrap: str, topic_factory: Any) -> None:
    topic = topic_factory()
    with _through_proxy(alias) as proxy:
        def lose_the_answer() -> None:
            proxy.muted = True  # the COMMIT goes through, PostgreSQL commits, its answer is dropped

            def cut() -> None:
                time.sleep(1.0)
                proxy.muted = False  # the answer was dropped, not held back
                proxy.cut()  # the client's wait ends with a lost connection; the read-back connects anew

            threading.Thread(target=cut, daemon=True).start()

        seen = _arm(k2pc_settings, Step.DB_COMMITTING, lose_the_answer)
        hooks: list[str] = []
        _write(alias, topic, "kept", hooks)  # no OperationalError: both sides committed
        assert hooks == ["kept"]  # and its on_commit callback ran
        assert Step.DB_COMMITTING in seen
        _heal(alias)
        _write(alias, topic, "after", hooks)
        assert hooks == ["kept", "after"]
    assert _consistent(alias, kafka_bootstrap, topic) == ["after", "kept"]


@pytest.mark.parametrize("alias", _ON_PG, indirect=True)
def test_a_disconnect_closes_no_other_threads_connection(alias: str, kafka_bootstrap: str,
                                                         topic_factory: Any) -> None:
    topic = topic_factory()
    healthy: dict[str, Any] = {}
    go, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            _write(alias, topic, "b1")
            healthy["raw"] = connections[alias].connection
            go.wait(30)
            _write(alias, topic, "b2")  # after the other thread's disconnect
            healthy["after"] = connections[alias].connection
            healthy["closed"] = healthy["raw"].closed
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
        finally:
            connections[alias].close()
            done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    while "raw" not in healthy and not done.is_set():
        time.sleep(0.01)
    _write(alias, topic, "a1")
    _kill(alias, _backend_id(alias))
    with pytest.raises(OperationalError):
        _write(alias, topic, "a-lost")  # SQLAlchemy sees a disconnect on this thread's connection
    go.set()
    thread.join(60)
    assert errors == []
    assert healthy["after"] is healthy["raw"] and not healthy["closed"]  # untouched, still in use
    _heal(alias)
    _write(alias, topic, "a2")
    assert _consistent(alias, kafka_bootstrap, topic) == ["a1", "a2", "b1", "b2"]


@pytest.mark.parametrize("alias", _ON_PG, indirect=True)
def test_the_apps_own_connections_get_djangos_set_up(alias: str) -> None:
    from kafka2pc.recipes.django._runtime import runtime_for

    with connections[alias].cursor() as cursor:  # Django's: its time zone, set by Django on each connection
        cursor.execute("SHOW TimeZone")
        django_zone = cursor.fetchone()[0]
    with _admin(alias).connect() as raw:  # a bare connection: the server's default
        assert raw.exec_driver_sql("SHOW TimeZone").scalar_one() != django_zone, "the test needs a server default"
    own = runtime_for(alias, start=False).own
    with own.connect() as conn:
        assert conn.exec_driver_sql("SHOW TimeZone").scalar_one() == django_zone
    assert own.pool._max_overflow == own.pool.size()  # type: ignore[attr-defined] - the budget: 2 x pool_size
