"""A producer application for the log-volume test: transactions in a loop, through a broker outage.

Run as ``python _log_child.py BOOTSTRAP TOPIC TRANSACTIONAL_ID``.  Logging is
configured as an application would (``logging.basicConfig()``: WARNING and up
to stderr), plus a counter of every INFO-and-up record.  stdout carries
markers for the test: ``COMMITTED <n>`` after each commit (at most one a
second), ``MARK <phase>`` at phase boundaries, ``COUNTS <json>`` at the end.
The test writes ``stop`` to stdin to end the run.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import Counter

from kafka2pc import Kafka2pcError, TwoPhaseCommitProducer, TxnState

counts: Counter[str] = Counter()


class _Count(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        counts[f"{record.levelname} {record.name.split('.')[0]}"] += 1


def main() -> None:
    bootstrap, topic, tid = sys.argv[1:4]
    logging.basicConfig(format="LOG %(levelname)s %(name)s %(message)s")  # WARNING to stderr
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger().handlers[0].setLevel(logging.WARNING)
    logging.getLogger().addHandler(_Count(logging.INFO))
    stop = threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                stop.set()
                return
            print(f"MARK {line.strip()}", flush=True)
            print(f"MARK {line.strip()}", file=sys.stderr, flush=True)

    threading.Thread(target=read_stdin, daemon=True).start()
    config = {"bootstrap.servers": bootstrap, "transactional.id": tid}
    producer = TwoPhaseCommitProducer(config)
    producer.init_transactions(60)
    committed, last_report = 0, 0.0
    while not stop.is_set():
        try:
            state = producer.state
            if state is TxnState.UNINITIALIZED:
                producer.init_transactions(10)
                continue
            if state is TxnState.READY:
                producer.begin_transaction()
                producer.produce(topic, value=b"%d" % committed)
                state = TxnState.IN_TRANSACTION
            if state is TxnState.IN_TRANSACTION:
                producer.prepare_transaction(5)
                state = TxnState.PREPARED
            if state is TxnState.PREPARED:
                producer.commit_transaction(10)
                committed += 1
            elif state is TxnState.IN_DOUBT:
                prepared = producer.prepared_state
                assert prepared is not None
                producer.complete_transaction(prepared, 10)
            elif state is TxnState.ABORTABLE_ERROR:
                producer.abort_transaction(10)
            elif state is TxnState.FATAL_ERROR:
                producer.close()
                producer = TwoPhaseCommitProducer(config)
                producer.init_transactions(10)
            producer.poll(0)
        except Kafka2pcError as exc:
            counts[f"app-error {type(exc).__name__}"] += 1
            time.sleep(0.5)
            continue
        if time.monotonic() - last_report >= 1.0:
            last_report = time.monotonic()
            print(f"COMMITTED {committed}", flush=True)
        time.sleep(0.05)
    producer.close()
    print("COUNTS " + json.dumps(dict(counts)), flush=True)


if __name__ == "__main__":
    main()
