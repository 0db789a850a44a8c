"""Demo: an order service that writes orders to SQLite and order events to Kafka, atomically.

It is killed with SIGKILL at the worst possible moment -- after the database
committed an order, before Kafka committed its event -- restarted, recovers,
and ends consistent: every order row has exactly one event and vice versa.

    python examples/order_service.py            # or: bash scripts/demo.sh

Kafka: ``$KAFKA_BOOTSTRAP_SERVERS``, or a local broker started here (the first
run downloads Apache Kafka from Maven Central; Java 17 and Maven are needed,
``scripts/setup.sh`` installs them).  Exit code 0 iff the final check passes.

What it leaves behind: a broker it started is stopped at the end (its data stays
in ``~/.cache/kafka2pc/run/``), unless ``--keep-broker`` is given; a broker it found
running keeps running, with the demo's topic.  Its temporary folder
(``kafka2pc-demo-*``, the SQLite database) is removed.

The same file is the service itself (``--serve``), run as a child process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    item: Mapped[str] = mapped_column(sa.String(64))
    quantity: Mapped[int]


# -- the service (child process) ---------------------------------------------------------------


def serve(
    db_url: str, bootstrap: str, topic: str, transactional_id: str, first: int, last: int, crash_after_db_commit_of: int
) -> None:
    """Place orders first..last; SIGKILL itself between the two commits of order ``crash_after_db_commit_of``."""
    from kafka2pc.recipes.dual_write import DualWriter, Step, define_state_table

    logging.basicConfig(level=logging.WARNING, format="  [log] %(levelname)s %(name)s: %(message)s")
    pid = os.getpid()
    engine = sa.create_engine(db_url)
    metadata = Base.metadata
    define_state_table(metadata)
    metadata.create_all(engine)
    current = {"order": 0}

    def on_step(step: Step) -> None:
        if step is Step.DB_COMMITTED and current["order"] == crash_after_db_commit_of:
            say(pid, f"order {current['order']}: database COMMITTED, Kafka transaction only PREPARED "
                     "-> kill -9 now (before the Kafka commit)")
            os.kill(pid, signal.SIGKILL)

    writer = DualWriter(
        engine,
        {"bootstrap.servers": bootstrap, "transactional.id": transactional_id},
        state_table=define_state_table(metadata),
        on_step=on_step,
    )
    say(pid, "started; recovering before taking new orders...")
    result = writer.recover()
    settlement = result.settlement
    assert settlement is not None
    if result.stored_state.is_empty and settlement.plan.coordinator is None:
        say(pid, "recovery: first start, nothing to settle")
    else:
        decision = result.decision.value
        say(pid, f"recovery: the database committed Kafka state {result.stored_state}; Kafka's open transaction "
                 f"{'is exactly that one' if decision == 'commit' else 'is not that one'} -> {decision}; "
                 f"the stored transaction is now {settlement.outcome.value}")
    for number in range(first, last + 1):
        current["order"] = number
        order_id = f"order-{number:03d}"
        event = {"type": "OrderPlaced", "order_id": order_id, "item": f"widget-{number % 4}", "quantity": number}
        with Session(engine) as session, writer.transaction(session) as tx:
            session.add(Order(id=order_id, item=event["item"], quantity=number))
            tx.produce(topic, key=order_id, value=json.dumps(event))
        say(pid, f"order {number}: row and event committed")
        time.sleep(0.05)
    writer.close()
    say(pid, "all orders placed; exiting")


def say(pid: int, text: str) -> None:
    print(f"  [order-service pid {pid}] {text}", flush=True)


# -- the demo driver (parent process) -------------------------------------------------------------


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _kafka() -> tuple[str, object | None]:
    """Bootstrap servers, and the LocalKafka to stop at the end if this demo started it."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return os.environ["KAFKA_BOOTSTRAP_SERVERS"], None
    from kafka2pc.testing.broker import LocalKafka

    kafka = LocalKafka()
    already_running = _port_open("127.0.0.1", kafka.nodes[0].port)
    step("Kafka", "reusing the local broker" if already_running else
         "starting a local Apache Kafka broker (the first run downloads it from Maven Central)...")
    kafka = LocalKafka.up()
    return kafka.bootstrap_servers, (None if already_running else kafka)


def step(title: str, text: str) -> None:
    print(f"\n== {title}: {text}", flush=True)


def check(db_url: str, bootstrap: str, topic: str) -> bool:
    """Database rows vs read_committed events: counts, differences, nothing left hanging."""
    from kafka2pc.testing import drain, end_offsets

    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        rows = set(conn.execute(sa.select(Order.id)).scalars())
    engine.dispose()
    events = [json.loads(r.value)["order_id"] for r in drain(bootstrap, topic, "read_committed") if r.value]
    committed_end = end_offsets(bootstrap, topic, "read_committed")
    written_end = end_offsets(bootstrap, topic, "read_uncommitted")
    duplicates = sorted({e for e in events if events.count(e) > 1})
    only_db, only_kafka = sorted(rows - set(events)), sorted(set(events) - rows)
    print(f"   orders in the database:              {len(rows)}")
    print(f"   OrderPlaced events (read_committed): {len(events)}")
    print(f"   orders without an event:             {only_db or 'none'}")
    print(f"   events without an order:             {only_kafka or 'none'}")
    print(f"   duplicated events:                   {duplicates or 'none'}")
    hanging = committed_end != written_end
    print(f"   read_committed end {committed_end} vs read_uncommitted end {written_end}: "
          f"{'a transaction is still open' if hanging else 'nothing held back'}")
    return not (only_db or only_kafka or duplicates or hanging)


def run_child(args: list[str]) -> int:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--serve", *args], check=False)
    return proc.returncode


def demo(orders: int, crash_at: int, keep_broker: bool = False) -> int:
    bootstrap, started = _kafka()
    from kafka2pc.testing import create_topic

    topic = create_topic(bootstrap, f"orders-{uuid.uuid4().hex[:8]}")
    workdir = Path(tempfile.mkdtemp(prefix="kafka2pc-demo-"))
    db_url = f"sqlite:///{workdir / 'orders.db'}"
    common = ["--db", db_url, "--bootstrap", bootstrap, "--topic", topic,
              "--transactional-id", f"order-service-{topic}"]
    try:
        step("Setup", f"orders in {db_url}, events in topic {topic} at {bootstrap}")

        step("Run 1", f"the order service places orders 1..{orders} and is killed during order {crash_at}")
        code = run_child([*common, "--first", "1", "--last", str(orders), "--crash-after-db-commit-of", str(crash_at)])
        print(f"   order service exited with {'SIGKILL' if code == -signal.SIGKILL else code}")
        if code != -signal.SIGKILL:
            print("   expected the service to be killed: demo failed")
            return 1

        step("In between", "the database has the order; Kafka holds its event in a prepared transaction")
        check(db_url, bootstrap, topic)
        print(f"   as expected: order {crash_at} is in the database, its event is prepared in Kafka but not yet "
              "visible to read_committed consumers (nothing lost, nothing duplicated)")

        step("Run 2", f"restart: recovery settles order {crash_at}'s transaction, then orders {crash_at + 1}..{orders}")
        code = run_child([*common, "--first", str(crash_at + 1), "--last", str(orders)])
        if code != 0:
            print(f"   order service exited with {code}: demo failed")
            return 1

        step("Consistency check", "database rows vs read_committed events")
        consistent = check(db_url, bootstrap, topic)
        print(f"\n{'CONSISTENT' if consistent else 'INCONSISTENT'}: "
              f"{'every order has exactly one event and vice versa' if consistent else 'see above'}")
        return 0 if consistent else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if started is not None and not keep_broker:
            step("Kafka", "stopping the broker this demo started (nothing is left running)")
            started.stop()  # type: ignore[attr-defined]
        else:
            step("Kafka", f"the broker keeps running at {bootstrap}; for the README's examples:")
            print(f"   export KAFKA_BOOTSTRAP_SERVERS={bootstrap}")
            if started is not None:
                print("   stop it with: .venv/bin/python -m kafka2pc.testing.broker down")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=8)
    parser.add_argument("--crash-at", type=int, default=5, help="order whose Kafka commit is never reached")
    parser.add_argument("--keep-broker", action="store_true",
                        help="leave the local broker this demo starts running (it prints its address)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--transactional-id", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--last", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--crash-after-db-commit-of", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.db, args.bootstrap, args.topic, args.transactional_id, args.first, args.last,
              args.crash_after_db_commit_of)
        return 0
    if not 1 <= args.crash_at <= args.orders:
        parser.error("--crash-at must be between 1 and --orders")
    return demo(args.orders, args.crash_at, args.keep_broker)


if __name__ == "__main__":
    sys.exit(main())
