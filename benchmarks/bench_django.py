"""Throughput of the Django dual write (kafka2pc.recipes.django) against a non-atomic Django write, on PostgreSQL.

Every variant inserts N rows and produces N records per transaction (1 and 10), on one thread:

* Django, non-atomic (the baseline): ``Model.objects.create()`` for each row in one
  ``transaction.atomic()``, committed, then a plain confluent-kafka
  transaction with the records;
* Django dual write: ``with dual_write() as tx:`` the same ``create()`` calls, then ``tx.produce(...)``
  for each record (every variant writes its rows, then produces its records);
* Django dual write, pipelined: the same with ``POOL_OPTIONS["pipelined"]`` (its round ends when its
  last Kafka commit did);
* SQLAlchemy, non-atomic, and SQLAlchemy ``WriterPool.transaction`` (not pipelined): the same pair
  for the SQLAlchemy recipe, in the same rounds, so that the two recipes' ratios to their own
  baselines are compared on the same machine at the same time.

``--gunicorn`` measures the Django variants behind HTTP instead: two gunicorn servers of
``--workers`` workers (gthread, 2 threads) serve ``benchmarks/_django_bench_app.py``, one with the
pipelined commit, one without; ``--clients`` threads post requests over keep-alive connections
(``http.client``), for ``--seconds`` per variant and round, and the rate is requests per second.

Rounds are interleaved; ratios are medians of per-round ratios (min..max in brackets).

Run::

    python benchmarks/bench_django.py [--rounds 8] [--seconds 1.5]
    python benchmarks/bench_django.py --gunicorn [--workers 4] [--clients 8] [--rounds 6] [--seconds 3]

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS`` or the local broker (started if needed).
PostgreSQL: ``$KAFKA2PC_PG_ADMIN_URL`` (a fresh database is created and dropped).
Results are printed and recorded under "## Django dual write" (one thread) or "## Django dual write
under gunicorn" in benchmarks/RESULTS.md (``--no-record``: printed only).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

import sqlalchemy as sa
from confluent_kafka import Producer

from kafka2pc.testing import create_topic
from kafka2pc.testing.postgres import fresh_database

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HEADING = "Django dual write"
GUNICORN_HEADING = "Django dual write under gunicorn"
HERE = Path(__file__).resolve().parent
#: Pipelined pools: slots enough for one thread's next transaction while the last commits run.
PIPELINED_OPTIONS = {"pipelined": True, "max_slots": 3}


def _bootstrap() -> str:
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    from kafka2pc.testing.broker import LocalKafka

    return LocalKafka.up().bootstrap_servers


def _configure_django(url: sa.URL, bootstrap: str) -> None:
    import django
    from django.conf import settings

    settings.configure(
        DATABASES={"default": {
            "ENGINE": "django.db.backends.postgresql", "NAME": url.database, "USER": url.username,
            "PASSWORD": url.password, "HOST": url.host, "PORT": str(url.port or 5432),
        }},
        INSTALLED_APPS=["django.contrib.contenttypes", "kafka2pc.recipes.django"],
        USE_TZ=True,
        KAFKA2PC={"PRODUCER": {"bootstrap.servers": bootstrap, "linger.ms": 0},
                  "TRANSACTIONAL_ID_PREFIX": f"bench-dj-{uuid.uuid4().hex[:6]}", "POOL_SIZE": 4,
                  "POOL_OPTIONS": {"max_slots": 1}},
    )
    django.setup()


def _order_model() -> type:
    from django.db import models

    class BenchOrder(models.Model):
        id = models.CharField(max_length=64, primary_key=True)
        payload = models.CharField(max_length=200)

        class Meta:
            app_label = "kafka2pc"
            db_table = "bench_orders"

    return BenchOrder


def _plain_producer(bootstrap: str) -> Producer:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"bench-plain-{uuid.uuid4().hex[:8]}",
                         "linger.ms": 0})
    producer.init_transactions(30)
    return producer


def _ratios(rates: dict[str, list[float]], of: str, to: str) -> list[float]:
    return [a / b for a, b in zip(rates[of], rates[to], strict=True)]


def _cell(ratios: list[float]) -> str:
    return f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}..{max(ratios):.2f})"


def _header(args: argparse.Namespace, load_before: float, what: str) -> str:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"`python benchmarks/bench_django.py {' '.join(sys.argv[1:])}`, {when}, "
            f"Python {platform.python_version()}, load average {load_before:.1f} before and "
            f"{os.getloadavg()[0]:.1f} after. {what}; rates are medians, ratios medians of per-round ratios "
            "(min..max).")


def one_thread(args: argparse.Namespace, bootstrap: str, topic: str) -> str:
    load_before = os.getloadavg()[0]
    with fresh_database() as db_url:
        url = sa.make_url(db_url)
        _configure_django(url, bootstrap)
        from django.conf import settings
        from django.core.management import call_command
        from django.db import connection, transaction
        from django.test.utils import override_settings
        from kafka2pc.recipes.django import close, dual_write
        from kafka2pc.recipes.django._runtime import existing_runtime
        from kafka2pc.recipes.dual_write import WriterPool, define_lease_table, define_state_table

        call_command("migrate", verbosity=0)
        Order = _order_model()
        with connection.schema_editor() as editor:
            editor.create_model(Order)
        engine = sa.create_engine(db_url, pool_size=4)
        metadata = sa.MetaData()
        sa_orders = sa.Table("bench_orders", metadata, autoload_with=engine)
        pool = WriterPool(engine, {"bootstrap.servers": bootstrap, "linger.ms": 0}, prefix=f"bench-sa-{uuid.uuid4().hex[:6]}",
                          size=2, max_slots=1, state_table=define_state_table(metadata),
                          lease_table=define_lease_table(metadata))
        dj_plain, sa_plain = _plain_producer(bootstrap), _plain_producer(bootstrap)
        counter = iter(range(10**9))
        serial_setting = settings.KAFKA2PC
        pipelined_setting = {**serial_setting, "TRANSACTIONAL_ID_PREFIX": serial_setting["TRANSACTIONAL_ID_PREFIX"] + "-p",
                             "POOL_OPTIONS": PIPELINED_OPTIONS}

        def keys(n: int) -> list[str]:
            return [f"k{next(counter)}" for _ in range(n)]

        def django_nonatomic(n: int) -> None:
            ks = keys(n)
            with transaction.atomic():  # the rows in one transaction, as the dual write's
                for k in ks:
                    Order.objects.create(id=k, payload="x")
            dj_plain.begin_transaction()
            for k in ks:
                dj_plain.produce(topic, key=k, value=b"x")
            dj_plain.commit_transaction(30)

        # Every variant writes its rows, then produces its records (the non-atomic writes cannot do otherwise):
        # with linger.ms 0, records produced between the rows' round trips would each go out in a request of
        # their own, a cost of the order, not of the protocol.
        def django_dual_write(n: int) -> None:
            ks = keys(n)
            with dual_write() as tx:
                for k in ks:
                    Order.objects.create(id=k, payload="x")
                for k in ks:
                    tx.produce(topic, key=k, value=b"x")

        def sa_nonatomic(n: int) -> None:
            ks = keys(n)
            with engine.begin() as conn:
                conn.execute(sa.insert(sa_orders), [{"id": k, "payload": "x"} for k in ks])
            sa_plain.begin_transaction()
            for k in ks:
                sa_plain.produce(topic, key=k, value=b"x")
            sa_plain.commit_transaction(30)

        def sa_pool(n: int) -> None:
            ks = keys(n)
            with engine.connect() as conn, pool.transaction(conn) as tx:
                conn.execute(sa.insert(sa_orders), [{"id": k, "payload": "x"} for k in ks])
                for k in ks:
                    tx.produce(topic, key=k, value=b"x")

        def drained() -> None:
            runtime = existing_runtime("default")
            if runtime is not None:
                runtime.pool.wait_visible(60)

        @contextlib.contextmanager
        def kafka2pc(value: dict[str, object]) -> Iterator[None]:
            """The Django app under ``value`` (a change of ``KAFKA2PC`` closes its pools; the next write makes one)."""
            if settings.KAFKA2PC is value:
                yield
                return
            with override_settings(KAFKA2PC=value):
                yield

        # name -> (the call, the KAFKA2PC it runs under)
        variants: dict[str, tuple[Callable[[int], None], dict[str, object]]] = {
            "django non-atomic": (django_nonatomic, serial_setting),
            "django dual write": (django_dual_write, serial_setting),
            "django pipelined": (django_dual_write, pipelined_setting),
            "sqlalchemy non-atomic": (sa_nonatomic, serial_setting),
            "sqlalchemy WriterPool": (sa_pool, serial_setting),
        }
        rows = []
        for n in (1, 10):
            rates: dict[str, list[float]] = {name: [] for name in variants}
            for r in range(args.rounds):
                order = list(variants.items())
                if r % 2:
                    order.reverse()
                for name, (fn, value) in order:
                    with kafka2pc(value):
                        for _ in range(10 if r == 0 else 5):  # warm up: connections, producers, the pool's slots
                            fn(n)
                        drained()
                        done, started = 0, time.perf_counter()
                        while time.perf_counter() - started < args.seconds:
                            fn(n)
                            done += 1
                        drained()  # a pipelined round ends when its last Kafka commit did
                        rates[name].append(done / (time.perf_counter() - started))
            rows.append((n, {k: statistics.median(v) for k, v in rates.items()},
                         _ratios(rates, "django dual write", "django non-atomic"),
                         _ratios(rates, "django pipelined", "django non-atomic"),
                         _ratios(rates, "sqlalchemy WriterPool", "sqlalchemy non-atomic")))
        pool.close()
        close()
        dj_plain.flush(10)
        sa_plain.flush(10)
        engine.dispose()
        connection.close()
    lines = [
        _header(args, load_before, "One thread, PostgreSQL; txn/s"),
        "",
        "| records/txn | Django non-atomic txn/s | Django dual write txn/s | Django pipelined txn/s "
        "| **Django dual write / non-atomic** | **Django pipelined / non-atomic** "
        "| SQLAlchemy non-atomic txn/s | SQLAlchemy WriterPool txn/s | **WriterPool / non-atomic** |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, med, dj, djp, sq in rows:
        lines.append(
            f"| {n} | {med['django non-atomic']:.1f} | {med['django dual write']:.1f} | "
            f"{med['django pipelined']:.1f} | {_cell(dj)} | {_cell(djp)} | {med['sqlalchemy non-atomic']:.1f} | "
            f"{med['sqlalchemy WriterPool']:.1f} | {_cell(sq)} |"
        )
    return "\n".join(lines)


def _serve(db_url: str, bootstrap: str, topic: str, port: int, workers: int, pipelined: bool,
           log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "BENCH_DB_URL": db_url, "BENCH_BOOTSTRAP": bootstrap, "BENCH_TOPIC": topic,
           "BENCH_PREFIX": f"bench-http-{'p' if pipelined else 's'}-{uuid.uuid4().hex[:6]}",
           "BENCH_POOL_SIZE": str(workers * 8), "BENCH_PIPELINED": "1" if pipelined else "0"}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "--chdir", str(HERE), "-w", str(workers), "-k", "gthread",
             "--threads", "2", "-b", f"127.0.0.1:{port}", "--keep-alive", "30", "--log-level", "warning",
             "_django_bench_app:application"],
            env=env, stdout=out, stderr=out)


def _wait_up(port: int, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 90
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"gunicorn exited: {log.read_text()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/nonatomic/1")
            if conn.getresponse().status == 201:
                conn.close()
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"gunicorn on {port} did not answer: {log.read_text()[-2000:]}")
        time.sleep(0.2)


def _load(port: int, path: str, clients: int, seconds: float) -> float:
    """``clients`` threads posting to ``path`` over keep-alive connections for ``seconds``: requests/s."""
    stop = threading.Event()
    done = [0] * clients
    errors: list[str] = []

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            while not stop.is_set():
                conn.request("POST", path, body=b"", headers={"Content-Length": "0"})
                response = conn.getresponse()
                response.read()
                if response.status != 201:
                    errors.append(f"{path}: {response.status}")
                    return
                done[i] += 1
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    if errors:
        raise RuntimeError(errors[0])
    return sum(done) / (time.perf_counter() - started)


def under_gunicorn(args: argparse.Namespace, bootstrap: str, topic: str) -> str:
    from kafka2pc.testing.broker import port_base

    load_before = os.getloadavg()[0]
    serial_port, pipelined_port = port_base() + 1880, port_base() + 1881
    with fresh_database() as db_url:
        engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
        _configure_django(sa.make_url(db_url), bootstrap)
        from django.core.management import call_command
        from django.db import connection

        call_command("migrate", verbosity=0)
        with connection.schema_editor() as editor:
            editor.create_model(_order_model())
        connection.close()
        engine.dispose()
        logs = Path(os.environ.get("TMPDIR", "/tmp"))
        servers = [_serve(db_url, bootstrap, topic, serial_port, args.workers, False, logs / "bench-django-serial.log"),
                   _serve(db_url, bootstrap, topic, pipelined_port, args.workers, True,
                          logs / "bench-django-pipelined.log")]
        try:
            _wait_up(serial_port, servers[0], logs / "bench-django-serial.log")
            _wait_up(pipelined_port, servers[1], logs / "bench-django-pipelined.log")
            variants = {"non-atomic": (serial_port, "nonatomic"), "dual write": (serial_port, "dual"),
                        "pipelined": (pipelined_port, "dual")}
            rows = []
            for n in (1, 10):
                for port, endpoint in variants.values():  # warm up every worker: connections, producers, slots
                    _load(port, f"/{endpoint}/{n}", args.clients, 2.0)
                rates: dict[str, list[float]] = {name: [] for name in variants}
                for r in range(args.rounds):
                    order = list(variants.items())
                    if r % 2:
                        order.reverse()
                    for name, (port, endpoint) in order:
                        rates[name].append(_load(port, f"/{endpoint}/{n}", args.clients, args.seconds))
                rows.append((n, {k: statistics.median(v) for k, v in rates.items()},
                             _ratios(rates, "dual write", "non-atomic"), _ratios(rates, "pipelined", "non-atomic")))
        finally:
            for server in servers:
                server.terminate()
            for server in servers:
                try:
                    server.wait(60)
                except subprocess.TimeoutExpired:
                    server.kill()
    lines = [
        _header(args, load_before, f"gunicorn, {args.workers} workers (gthread, 2 threads), {args.clients} "
                                   "keep-alive clients, PostgreSQL; requests/s"),
        "",
        "| records/txn | Django non-atomic req/s | Django dual write req/s | Django pipelined req/s "
        "| **Django dual write / non-atomic** | **Django pipelined / non-atomic** |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n, med, dj, djp in rows:
        lines.append(f"| {n} | {med['non-atomic']:.1f} | {med['dual write']:.1f} | {med['pipelined']:.1f} | "
                     f"{_cell(dj)} | {_cell(djp)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--gunicorn", action="store_true", help="the Django variants behind HTTP, under gunicorn")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--no-record", action="store_true", help="print only; leave benchmarks/RESULTS.md alone")
    args = parser.parse_args()
    bootstrap = _bootstrap()
    topic = create_topic(bootstrap, partitions=3)
    print(f"load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    body = under_gunicorn(args, bootstrap, topic) if args.gunicorn else one_thread(args, bootstrap, topic)
    print(body)
    if not args.no_record:
        record_section(GUNICORN_HEADING if args.gunicorn else HEADING, body)


if __name__ == "__main__":
    main()
