"""Throughput of the Django dual write (kafka2pc.recipes.django) against a non-atomic Django write, on PostgreSQL.

Every variant inserts N rows and produces N records per transaction (1 and 10), on one thread:

* Django, non-atomic (the baseline): ``Model.objects.create()`` for each row in one
  ``transaction.atomic()`` (one row: a plain ``save()``), committed, then a plain confluent-kafka
  transaction with the records;
* Django dual write: ``with dual_write() as tx: Model.objects.create(...); tx.produce(...)``;
* SQLAlchemy, non-atomic, and SQLAlchemy ``WriterPool.transaction`` (not pipelined): the same pair
  for the SQLAlchemy recipe, in the same rounds, so that the two recipes' ratios to their own
  baselines are compared on the same machine at the same time.

Rounds are interleaved; ratios are medians of per-round ratios (min..max in brackets).

Run::

    python benchmarks/bench_django.py [--rounds 8] [--seconds 1.5]

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS`` or the local broker (started if needed).
PostgreSQL: ``$KAFKA2PC_PG_ADMIN_URL`` (a fresh database is created and dropped).
Results are printed and recorded under "## Django dual write" in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import sqlalchemy as sa
from confluent_kafka import Producer

from kafka2pc.testing import create_topic
from kafka2pc.testing.postgres import fresh_database

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HEADING = "Django dual write"


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
                  "TRANSACTIONAL_ID_PREFIX": f"bench-dj-{uuid.uuid4().hex[:6]}", "POOL_SIZE": 2,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args()
    bootstrap = _bootstrap()
    topic = create_topic(bootstrap, partitions=3)
    with fresh_database() as db_url:
        url = sa.make_url(db_url)
        _configure_django(url, bootstrap)
        from django.core.management import call_command
        from django.db import connection, transaction
        from kafka2pc.recipes.django import close, dual_write
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

        def django_dual_write(n: int) -> None:
            ks = keys(n)
            with dual_write() as tx:
                for k in ks:
                    Order.objects.create(id=k, payload="x")
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
                for k in ks:
                    conn.execute(sa.insert(sa_orders).values(id=k, payload="x"))
                    tx.produce(topic, key=k, value=b"x")

        variants: dict[str, Callable[[int], None]] = {
            "django non-atomic": django_nonatomic, "django dual write": django_dual_write,
            "sqlalchemy non-atomic": sa_nonatomic, "sqlalchemy WriterPool": sa_pool,
        }
        rows = []
        for n in (1, 10):
            for fn in variants.values():  # warm up: connections, producers, pools
                for _ in range(20):
                    fn(n)
            rates: dict[str, list[float]] = {name: [] for name in variants}
            for r in range(args.rounds):
                order = list(variants.items())
                if r % 2:
                    order.reverse()
                for name, fn in order:
                    done, started = 0, time.perf_counter()
                    while time.perf_counter() - started < args.seconds:
                        fn(n)
                        done += 1
                    rates[name].append(done / (time.perf_counter() - started))
            dj = [a / b for a, b in zip(rates["django dual write"], rates["django non-atomic"], strict=True)]
            sq = [a / b for a, b in zip(rates["sqlalchemy WriterPool"], rates["sqlalchemy non-atomic"], strict=True)]
            rows.append((n, {k: statistics.median(v) for k, v in rates.items()}, dj, sq))
        pool.close()
        close()
        dj_plain.flush(10)
        sa_plain.flush(10)
        engine.dispose()
        connection.close()
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"`python benchmarks/bench_django.py --rounds {args.rounds} --seconds {args.seconds}`, {when}, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f} at the end. One thread, "
        "PostgreSQL; txn/s are medians, ratios medians of per-round ratios (min..max).",
        "",
        "| records/txn | Django non-atomic txn/s | Django dual write txn/s | **Django dual write / non-atomic** "
        "| SQLAlchemy non-atomic txn/s | SQLAlchemy WriterPool txn/s | **WriterPool / non-atomic** |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, med, dj, sq in rows:
        lines.append(
            f"| {n} | {med['django non-atomic']:.1f} | {med['django dual write']:.1f} | "
            f"**{statistics.median(dj):.2f}x** ({min(dj):.2f}..{max(dj):.2f}) | {med['sqlalchemy non-atomic']:.1f} | "
            f"{med['sqlalchemy WriterPool']:.1f} | **{statistics.median(sq):.2f}x** ({min(sq):.2f}..{max(sq):.2f}) |"
        )
    body = "\n".join(lines)
    print(body)
    record_section(HEADING, body)


if __name__ == "__main__":
    main()
