"""A process that leaves prepared transactions open, then waits to be killed (SIGKILL).

Run as ``python prepared_child.py BOOTSTRAP TOPIC PARTITIONS SCENARIO...`` where
each SCENARIO is ``KIND:TRANSACTIONAL_ID:RECORDS[:OTHER_TOPIC]`` (an other topic
is written on partition 0 only):

* ``prepared`` -- one transaction, prepared and left open;
* ``stale``    -- transaction 1 prepared and committed, transaction 2 prepared and
  left open (a database that kept transaction 1's state holds a *stale* state);
* ``committed`` -- one transaction, prepared and committed; nothing left open.

For each scenario it prints one JSON line ``{"tid", "kind", "states": [...],
"records": [[partition, offset, txn_index], ...]}``, then ``READY``, then
sleeps until killed: the transactions stay open exactly as a crashed
application would leave them.
"""

from __future__ import annotations

import json
import sys
import time

from kafka2pc import TwoPhaseCommitProducer


def run_transaction(producer: TwoPhaseCommitProducer, topic: str, partitions: int, records: int,
                    index: int, log: list[list[int]]) -> str:
    producer.begin_transaction()
    for i in range(records):
        producer.produce(
            topic, value=f"{producer.transactional_id}-t{index}-r{i}".encode(), partition=i % partitions,
            on_delivery=lambda err, msg: log.append([msg.partition(), msg.offset(), index]),
        )
    return str(producer.prepare_transaction(30))


def main() -> None:
    bootstrap, topic, partitions_text, *scenarios = sys.argv[1:]
    partitions = int(partitions_text)
    producers = []
    for scenario in scenarios:
        kind, tid, records_text, *other = scenario.split(":")
        records = int(records_text)
        target, target_partitions = (other[0], 1) if other else (topic, partitions)
        producer = TwoPhaseCommitProducer({"bootstrap.servers": bootstrap, "transactional.id": tid})
        producers.append(producer)
        producer.init_transactions(30)
        log: list[list[int]] = []
        states = [run_transaction(producer, target, target_partitions, records, 0, log)]
        if kind in ("stale", "committed"):
            producer.commit_transaction(30)
        if kind == "stale":
            states.append(run_transaction(producer, target, target_partitions, records, 1, log))
        print(json.dumps({"tid": tid, "kind": kind, "states": states, "records": log}), flush=True)
    print("READY", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
