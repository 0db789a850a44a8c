"""The dual write's client CPU, part by part, without a profiler: what each layer adds over the 2PC bound.

A profiler inflates Python-heavy code (cProfile about 1.5x here), so this script measures the
parts it can isolate with ``time.process_time()`` alone, one thread, serial transactions,
interleaved rounds (each round runs every part once, in turn), and prints the median CPU
microseconds per transaction and the spread:

* ``kafka: confluent-kafka``: a plain transactional ``Producer``: begin, produce one record with a
  delivery callback, flush, commit (the bound's Kafka side, plus the callback a prepared state's
  anchor needs);
* ``kafka: kafka2pc``: ``TwoPhaseCommitProducer``: begin, produce, ``prepare_transaction()``,
  ``str(state)``, commit;
* ``database: INSERT, COMMIT``: one row and a bare COMMIT on a SQLAlchemy ``Connection`` (the
  bound's database side);
* ``database: INSERT, state update with the COMMIT``: the row, then the store's guarded state
  update sent with the COMMIT in one round trip (``store_and_commit``), as the recipe does on
  PostgreSQL with psycopg 3;
* ``recipe: DualWriter`` and ``recipe: WriterPool(pipelined=True)``: one transaction of the recipe
  on a ``Connection``, one record and one row (for the pool, the Kafka commits run in its
  background threads, whose CPU this process's clock counts too).

The recipe's own layers are what is left of ``recipe`` once both ``kafka2pc`` and ``state update``
parts are taken away.  Run::

    python benchmarks/profile_parts.py --rounds 5 --txns 300

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS`` or the local broker (started if needed).
PostgreSQL: ``$KAFKA2PC_PG_ADMIN_URL`` (a fresh database is created and dropped).  Prints only;
records nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable

import sqlalchemy as sa
from bench_dual_write import PAYLOAD, _bootstrap  # noqa: E402 - benchmarks/ is on sys.path
from confluent_kafka import Producer
from kafka2pc.recipes.dual_write import DualWriter, WriterPool, define_lease_table, define_state_table
from kafka2pc.recipes.dual_write._store import store_for

from kafka2pc import TwoPhaseCommitProducer
from kafka2pc.testing import create_topic
from kafka2pc.testing.postgres import fresh_database


def _cpu_us(part: Callable[[int], None], txns: int, first: int) -> float:
    """CPU microseconds per call of ``part`` over ``txns`` calls (numbered from ``first``)."""
    started = time.process_time()
    for i in range(first, first + txns):
        part(i)
    return (time.process_time() - started) / txns * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--txns", type=int, default=300, help="transactions per part per round")
    args = parser.parse_args()

    bootstrap, _ = _bootstrap()
    topic = create_topic(bootstrap, partitions=3)
    run_id = uuid.uuid4().hex[:8]
    with fresh_database() as url:
        engine = sa.create_engine(url, pool_size=4)
        metadata = sa.MetaData()
        states = define_state_table(metadata)
        define_lease_table(metadata)
        orders = sa.Table("parts_orders", metadata, sa.Column("id", sa.String(80), primary_key=True),
                          sa.Column("payload", sa.String(200)))
        metadata.create_all(engine)  # with the state function (PostgreSQL)

        plain = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"parts-plain-{run_id}"})
        plain.init_transactions()
        k2pc = TwoPhaseCommitProducer({"bootstrap.servers": bootstrap, "transactional.id": f"parts-2pc-{run_id}"})
        k2pc.init_transactions()
        writer = DualWriter(engine, {"bootstrap.servers": bootstrap, "transactional.id": f"parts-dw-{run_id}"},
                            state_table=states)
        writer.recover()
        pool = WriterPool(engine, {"bootstrap.servers": bootstrap}, prefix=f"parts-{run_id}", size=2, max_slots=2,
                          pipelined=True, state_table=define_state_table(sa.MetaData()))
        conn = engine.connect()
        store = store_for(engine.dialect, states)
        tid = f"parts-store-{run_id}"
        with conn.begin():
            token = store.claim(conn, tid, lock_timeout_s=5.0).token
        stored: list[str | None] = [None]
        tokens = [token]

        def row(i: int, tag: str) -> None:
            conn.execute(orders.insert(), [{"id": f"{run_id}-{tag}-{i}", "payload": PAYLOAD}])

        def kafka_plain(i: int) -> None:
            plain.begin_transaction()
            plain.produce(topic, value=PAYLOAD, key=str(i), on_delivery=lambda err, msg: None)
            plain.flush()
            plain.commit_transaction()

        def kafka_2pc(i: int) -> None:
            k2pc.begin_transaction()
            k2pc.produce(topic, value=PAYLOAD, key=str(i))
            str(k2pc.prepare_transaction())
            k2pc.commit_transaction()

        def db_commit(i: int) -> None:
            conn.begin()
            row(i, "c")
            conn.commit()

        def db_state(i: int) -> None:
            conn.begin()
            row(i, "s")
            text = f"kafka2pc:1:0:parts:0:{i}:{topic}"
            tokens[0] = store.store_and_commit(conn, tid, text, tokens[0], stored[0])
            stored[0] = text
            conn.commit()

        def recipe(i: int) -> None:
            with writer.transaction(conn) as tx:
                tx.produce(topic, value=PAYLOAD, key=str(i))
                row(i, "r")

        def pipelined(i: int) -> None:
            with pool.transaction(conn) as tx:
                tx.produce(topic, value=PAYLOAD, key=str(i))
                row(i, "p")

        parts: dict[str, Callable[[int], None]] = {
            "kafka: confluent-kafka": kafka_plain,
            "kafka: kafka2pc": kafka_2pc,
            "database: INSERT, COMMIT": db_commit,
            "database: INSERT, state update with the COMMIT": db_state,
            "recipe: DualWriter": recipe,
            "recipe: WriterPool(pipelined=True)": pipelined,
        }
        for part in parts.values():  # warm-up: connections, metadata, prepared statements
            _cpu_us(part, 20, 10**8)
        pool.wait_visible()
        found: dict[str, list[float]] = {name: [] for name in parts}
        for r in range(args.rounds):
            order = list(parts.items()) if r % 2 == 0 else list(reversed(parts.items()))
            for name, part in order:
                found[name].append(_cpu_us(part, args.txns, r * args.txns))
                pool.wait_visible()
        print(f"client CPU per transaction (microseconds, one thread, {args.rounds} rounds of {args.txns}; "
              "median, min..max)\n")
        print("| part | CPU us/txn |")
        print("|---|---:|")
        for name, values in found.items():
            print(f"| {name} | {statistics.median(values):.0f} ({min(values):.0f}..{max(values):.0f}) |")
        conn.close()
        pool.close()
        writer.close()
        k2pc.close()
        plain.flush()
        engine.dispose()


if __name__ == "__main__":
    main()
