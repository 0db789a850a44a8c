"""A restarted process that forgets ``keep_prepared_txn=True`` is told what its plain init did."""

from __future__ import annotations

import uuid

import pytest

from kafka2pc import IllegalStateError, TransactionAdmin, TransactionOutcome, TwoPhaseCommitProducer
from kafka2pc.testing import create_topic


def test_complete_after_plain_init_says_the_prepared_transaction_was_aborted(kafka_bootstrap: str) -> None:
    topic = create_topic(kafka_bootstrap)
    config = {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"k2pc-plain-{uuid.uuid4().hex[:8]}"}
    old = TwoPhaseCommitProducer(config)
    old.init_transactions(30)
    old.begin_transaction()
    old.produce(topic, value=b"prepared")
    state = old.prepare_transaction(30)  # the database would store this, then the process dies

    restarted = TwoPhaseCommitProducer(config)
    restarted.init_transactions(30)  # forgot keep_prepared_txn=True: KIP-939 aborts the prepared transaction
    with pytest.raises(IllegalStateError, match=r"plain init_transactions\(\).*aborted.*keep_prepared_txn=True"):
        restarted.complete_transaction(state, 30)
    with TransactionAdmin({"bootstrap.servers": kafka_bootstrap}) as admin:
        assert admin.transaction_outcome(config["transactional.id"], state) is TransactionOutcome.ABORTED
    restarted.close()
    old.close()
