"""The normal path: what a prepared state names, and that it costs no control-plane request."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from kafka2pc import PreparedTxnState, TopicAndPartition, TwoPhaseCommitProducer, TxnState
from kafka2pc.testing import drain


def test_steady_state_transactions_send_no_control_plane_request(
    kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory(partitions=3)
    config = {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"k2pc-steady-{uuid.uuid4().hex[:8]}"}
    with TwoPhaseCommitProducer(config) as producer:
        producer.init_transactions(30)
        after_init = producer.control_plane.requests_sent
        assert after_init.get("DescribeTransactions") == 1  # the producer id and epoch, once

        states: list[PreparedTxnState] = []
        first_offsets: list[tuple[str, int, int]] = []
        for txn in range(5):
            producer.begin_transaction()
            reports: list[tuple[str, int, int]] = []
            for i in range(6):
                producer.produce(
                    topic, key=b"%d" % i, value=b"%d-%d" % (txn, i),
                    on_delivery=lambda err, msg, r=reports: r.append((msg.topic(), msg.partition(), msg.offset())),
                )
            states.append(producer.prepare_transaction(30))
            assert producer.state is TxnState.PREPARED
            first_offsets.append(reports[0])  # the user callback still runs, in delivery order
            producer.commit_transaction(30)
        assert producer.control_plane.requests_sent == after_init  # nothing per transaction

        # Every state names its own transaction: same producer id and epoch, its own anchor.
        assert len({(s.producer_id, s.epoch) for s in states}) == 1
        assert len(set(states)) == 5
        for state, (t, partition, offset) in zip(states, first_offsets):
            assert state.anchor == (TopicAndPartition(t, partition), offset)

        # After an abort librdkafka may have bumped the epoch: the next prepare asks once.
        producer.begin_transaction()
        producer.produce(topic, value=b"aborted")
        producer.abort_transaction(30)
        producer.begin_transaction()
        producer.produce(topic, value=b"last")
        producer.prepare_transaction(30)
        producer.commit_transaction(30)
        sent = producer.control_plane.requests_sent
        assert sent["DescribeTransactions"] == after_init["DescribeTransactions"] + 1
        assert sum(sent.values()) == sum(after_init.values()) + 1

    values = sorted(r.value for r in drain(kafka_bootstrap, topic) if r.value)
    assert values == sorted([b"%d-%d" % (t, i) for t in range(5) for i in range(6)] + [b"last"])


def test_complete_in_the_same_process_commits_only_its_own_state(
    kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    """KIP-939: completeTransaction(state) commits iff state names the prepared transaction."""
    topic = topic_factory()
    config = {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"k2pc-steady-{uuid.uuid4().hex[:8]}"}
    with TwoPhaseCommitProducer(config) as producer:
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce(topic, value=b"kept")
        own = producer.prepare_transaction(30)
        assert producer.prepared_state == own
        producer.complete_transaction(PreparedTxnState(str(own)))  # as read back from a database
        assert producer.state is TxnState.READY and producer.prepared_state is None

        for other in (PreparedTxnState(), own):  # nothing stored / the previous transaction's state
            producer.begin_transaction()
            producer.produce(topic, value=b"dropped")
            assert producer.prepare_transaction(30) != other
            producer.complete_transaction(other)
            assert producer.state is TxnState.READY
    assert [r.value for r in drain(kafka_bootstrap, topic)] == [b"kept"]
