"""librdkafka's abort race (librdkafka issue #4849) through the dual-write recipe: how often it is still lost.

An abort that races the registration of a partition (AddPartitionsToTxn) can
fail fatally (INVALID_TXN_STATE: the producer must be rebuilt) or leave the
transaction ``Ongoing`` at the coordinator after the producer is gone.  This
script drives, for each of ``DualWriter``, ``AsyncDualWriter``, ``WriterPool``
and ``AsyncWriterPool`` against the real broker and PostgreSQL:

* ``--cycles`` produce -> raise cycles on one writer (or pool): the block
  produces one record, waits 0-20 ms (seeded), raises;
* ``--close-cycles`` produce -> raise -> ``close()`` cycles, each on a new
  writer (or pool) with a transactional id of its own.

It counts, per kind: blocks whose caller saw an exception other than its own,
librdkafka FATAL log lines (the fatal abort), aborts kafka2pc had to finish at
the coordinator, and, at the end, transactions still open at the coordinator
(DescribeTransactions for every id used, which must all be 0) and whether the
topic's LSO equals its high watermark.

Usage::

    python benchmarks/bench_abort_race.py                         # local broker (started or reused)
    python benchmarks/bench_abort_race.py --cycles 2000 --close-cycles 500 --record

Prints a Markdown table; ``--record`` also writes it to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import confluent_kafka
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from kafka2pc import TopicAndPartition, TransactionAdmin
from kafka2pc.recipes.dual_write import DualWriter, WriterPool, define_state_table
from kafka2pc.recipes.dual_write.aio import AsyncDualWriter, AsyncWriterPool
from kafka2pc.testing import create_topic
from kafka2pc.testing.postgres import fresh_database

from _results import record_section  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HEADING = "Abort race (librdkafka #4849): produce -> raise"
KINDS = ("DualWriter", "AsyncDualWriter", "WriterPool", "AsyncWriterPool")


class Boom(Exception):
    """The block's own exception."""


@dataclass
class Tally:
    """What one kind's cycles saw."""

    cycles: int = 0
    close_cycles: int = 0
    foreign_errors: Counter[str] = field(default_factory=Counter)
    fatal_lines: int = 0
    ended_at_coordinator: int = 0
    left_open: int = 0
    lso_equals_hw: bool = False
    seconds: float = 0.0
    tids: set[str] = field(default_factory=set)


class _Count(logging.Handler):
    """Counts librdkafka FATAL lines and kafka2pc's own after-abort endings."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.fatal = 0
        self.ended = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.name == "kafka2pc.librdkafka" and ("FATAL" in text or "Fatal error" in text):
            self.fatal += 1
        elif record.name == "kafka2pc._producer" and ("still held the aborted" in text or "abort failed" in text):
            self.ended += 1


def _bootstrap() -> str:
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    from kafka2pc.testing.broker import LocalKafka

    return LocalKafka.up().bootstrap_servers


def _body(rng: random.Random, topic: str) -> Callable[[Any], None]:
    pause = rng.uniform(0, 0.02)

    def body(tx: Any) -> None:
        tx.produce(topic, value=b"never")
        time.sleep(pause)
        raise Boom

    return body


async def _abody(rng: random.Random, topic: str, tx: Any) -> None:
    await tx.produce(topic, value=b"never")
    await asyncio.sleep(rng.uniform(0, 0.02))
    raise Boom


def _sync_cycles(kind: str, url: str, config: dict[str, Any], topic: str, args: argparse.Namespace,
                 tally: Tally, rng: random.Random) -> None:
    engine = sa.create_engine(url)
    table = define_state_table(sa.MetaData())
    table.create(engine, checkfirst=True)
    series = uuid.uuid4().hex[:8]

    def make(n: int) -> Any:
        if kind == "DualWriter":
            tid = f"race-{series}-{n}"
            tally.tids.add(tid)
            writer = DualWriter(engine, {**config, "transactional.id": tid}, state_table=table)
            writer.recover()
            return writer
        pool = WriterPool(engine, config, prefix=f"race-{series}-{n}", size=1, state_table=table, start=False)
        pool.create_tables()
        pool.start()
        tally.tids.add(f"race-{series}-{n}-0")
        return pool

    def one(target: Any) -> None:
        try:
            with engine.connect() as conn, target.transaction(conn) as tx:
                _body(rng, topic)(tx)
        except Boom:
            pass
        except Exception as exc:  # noqa: BLE001 - counted: the caller must see its own exception
            tally.foreign_errors[type(exc).__name__] += 1

    target = make(0)
    for _ in range(args.cycles):
        one(target)
        tally.cycles += 1
    target.close()
    for i in range(args.close_cycles):
        target = make(1 + i)
        one(target)
        target.close()
        tally.close_cycles += 1
    engine.dispose()


async def _async_cycles(kind: str, url: str, config: dict[str, Any], topic: str, args: argparse.Namespace,
                        tally: Tally, rng: random.Random) -> None:
    engine = create_async_engine(url)
    table = define_state_table(sa.MetaData())
    async with engine.begin() as conn:
        await conn.run_sync(lambda c: table.create(c, checkfirst=True))
    series = uuid.uuid4().hex[:8]

    async def make(n: int) -> Any:
        if kind == "AsyncDualWriter":
            tid = f"race-{series}-{n}"
            tally.tids.add(tid)
            writer = AsyncDualWriter(engine, {**config, "transactional.id": tid}, state_table=table)
            await writer.recover()
            return writer
        pool = AsyncWriterPool(engine, config, prefix=f"race-{series}-{n}", size=1, state_table=table)
        await pool.create_tables()
        await pool.start()
        tally.tids.add(f"race-{series}-{n}-0")
        return pool

    async def one(target: Any) -> None:
        try:
            async with engine.connect() as conn, target.transaction(conn) as tx:
                await _abody(rng, topic, tx)
        except Boom:
            pass
        except Exception as exc:  # noqa: BLE001 - counted: the caller must see its own exception
            tally.foreign_errors[type(exc).__name__] += 1

    target = await make(0)
    for _ in range(args.cycles):
        await one(target)
        tally.cycles += 1
    await target.close()
    for i in range(args.close_cycles):
        target = await make(1 + i)
        await one(target)
        await target.close()
        tally.close_cycles += 1
    await engine.dispose()


def _check_coordinator(bootstrap: str, topic: str, tally: Tally) -> None:
    with TransactionAdmin({"bootstrap.servers": bootstrap}) as admin:
        for tid in sorted(tally.tids):
            info = admin.describe_transaction(tid, timeout=30)
            if info is not None and info.state == "Ongoing":
                tally.left_open += 1
        _, lso, hw = admin.control_plane.partition_offsets(TopicAndPartition(topic, 0), timeout=30)
        tally.lso_equals_hw = lso == hw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--close-cycles", type=int, default=500)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--seed", type=int, default=939)
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    counter = _Count()
    for name in ("kafka2pc.librdkafka", "kafka2pc._producer"):
        logging.getLogger(name).addHandler(counter)
        logging.getLogger(name).setLevel(logging.DEBUG)
    bootstrap = _bootstrap()
    config = {"bootstrap.servers": bootstrap}
    rows = []
    with fresh_database() as url:
        for kind in args.kinds.split(","):
            topic = create_topic(bootstrap, partitions=1)
            tally, rng = Tally(), random.Random(args.seed)
            fatal0, ended0, started = counter.fatal, counter.ended, time.monotonic()
            if kind.startswith("Async"):
                asyncio.run(_async_cycles(kind, url, config, topic, args, tally, rng))
            else:
                _sync_cycles(kind, url, config, topic, args, tally, rng)
            tally.seconds = time.monotonic() - started
            tally.fatal_lines, tally.ended_at_coordinator = counter.fatal - fatal0, counter.ended - ended0
            _check_coordinator(bootstrap, topic, tally)
            rows.append((kind, tally))
            print(f"{kind}: {tally}", flush=True)
    lines = [
        f"{args.label}; confluent-kafka {confluent_kafka.version()} / librdkafka {confluent_kafka.libversion()[0]}, "
        f"Python {platform.python_version()}, seed {args.seed}; each block produces one record, waits 0-20 ms, raises.",
        "",
        "| kind | produce->raise | ->close() | caller saw another error | FATAL lines | ended at coordinator "
        "| left Ongoing | LSO == HW | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, t in rows:
        foreign = ", ".join(f"{k} {v}" for k, v in sorted(t.foreign_errors.items())) or "0"
        lines.append(f"| {kind} | {t.cycles} | {t.close_cycles} | {foreign} | {t.fatal_lines} | "
                     f"{t.ended_at_coordinator} | {t.left_open} | {t.lso_equals_hw} | {t.seconds:.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.record:
        record_section(f"{HEADING} ({args.label})", table)


if __name__ == "__main__":
    main()
