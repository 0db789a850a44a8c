"""``PreparedTxnState``: the serializable name of one prepared Kafka transaction.

KIP-939 serializes a prepared transaction as ``producerId:epoch``.  That pair
only names one transaction when the coordinator bumps the epoch on every
transaction (KIP-890 part 2, "transaction version 2").  librdkafka does not:
consecutive transactions of one producer share ``producerId:epoch``, so a
recovery comparing only those numbers could commit transaction N+1 when the
database kept the state of transaction N.

kafka2pc therefore adds an *anchor*: the topic, partition and offset of the
first record the transaction wrote to one partition (known for free from the
delivery reports).  Offsets are never reused within a partition, so the anchor
names exactly one transaction; the partition leader reports the same number as
``CurrentTxnStartOffset`` (DescribeProducers) while the transaction is open,
and a ``read_committed`` fetch at that offset tells whether it committed.
Unlike KIP-939's rejected "partition offsets" alternative, a single anchor is
bounded in size whatever the number of partitions written.

Every shape of transaction gets an exact name:

* records on one or many partitions: the first delivered record is the anchor
  (no extra broker round trip);
* consumer offsets only (``send_offsets_to_transaction`` and no record): the
  producer writes one tiny *marker record* inside the transaction to the
  anchor topic (``kafka2pc.anchor.topic``, created on demand) and anchors on
  it.  The alternative, anchoring on the offset-commit record the group
  coordinator writes to ``__consumer_offsets`` (DescribeProducers reports its
  ``CurrentTxnStartOffset`` there too), was rejected: that topic is compacted,
  so the record is removed once the group commits again and a later outcome
  probe would read "aborted" (a false heuristic outcome); it also needs READ on
  an internal topic;
* nothing at all: the transaction sent nothing to Kafka, which the state says
  explicitly (``:-``).  Completing it commits nothing and aborts whatever
  transaction is open under the id, since that can only be another one.

Serialized forms (all at most 255 characters):

==========================================  =====================================
``k2pc1:<pid>:<epoch>:<tid>:<p>:<off>:<t>``  anchored (topic last)
``k2pc1:<pid>:<epoch>:<tid>:-``              the transaction sent nothing to Kafka
``k2pc1:<pid>:<epoch>:<tid>``                written by kafka2pc before the marker
                                             record: no record (offsets only, or
                                             nothing); ambiguous, still parsed
``<pid>:<epoch>``                            the Java client's form (no anchor)
``-1:-1``                                    the empty state
==========================================  =====================================

``<tid>`` is the first 8 hex digits of SHA-256 of the ``transactional.id``: it
catches a state handed to the wrong producer.  A topic name too long to fit is
stored as ``#`` plus 24 hex digits of its SHA-256 and resolved against the
cluster's topic list.  The leading ``k2pc<N>`` lets later identity schemes
(e.g. when librdkafka gains per-transaction epochs) add a version 2 while
version 1 strings stay readable.
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Any, Final

from kafka2pc._exceptions import InvalidPreparedStateError, TransactionalIdMismatchError
from kafka2pc._types import TopicAndPartition

__all__ = ["MAX_STATE_LENGTH", "PreparedTxnState", "topic_digest", "transactional_id_digest"]

MAX_STATE_LENGTH: Final = 255
_PREFIX: Final = "k2pc1"
_INT64_MAX: Final = 2**63 - 1
_INT32_MAX: Final = 2**31 - 1
_INT16_MAX: Final = 2**15 - 1
_NUMBER = r"(0|[1-9][0-9]{0,18})"
_JAVA_RE: Final = re.compile(rf"(?:-1:-1|{_NUMBER}:{_NUMBER})")
_V1_RE: Final = re.compile(
    rf"{_PREFIX}:{_NUMBER}:{_NUMBER}:([0-9a-f]{{8}})"
    rf"(?::{_NUMBER}:{_NUMBER}:([A-Za-z0-9._-]{{1,249}}|#[0-9a-f]{{24}})|(:-))?"
)
_SENT_NOTHING: Final = ":-"


@functools.lru_cache(maxsize=1024)
def transactional_id_digest(transactional_id: str) -> str:
    """The 8-hex-digit digest of a transactional id stored in version-1 states (cached: a producer asks per prepare)."""
    return hashlib.sha256(transactional_id.encode()).hexdigest()[:8]


def topic_digest(topic: str) -> str:
    """The ``#``-prefixed digest that stands for a topic name too long to store."""
    return "#" + hashlib.sha256(topic.encode()).hexdigest()[:24]


class PreparedTxnState:
    """An immutable, serializable identity of one prepared Kafka transaction.

    ``PreparedTxnState()`` is the empty state (no prepared transaction);
    ``PreparedTxnState(text)`` parses ``str(state)`` of any earlier state, or the
    Java client's ``producerId:epoch`` form.  Equal states name the same
    transaction.  Store ``str(state)`` in the same database transaction as the
    data it belongs to::

        state = producer.prepare_transaction()
        db.execute(upsert, {"tid": tid, "state": str(state)})
        ...
        producer.complete_transaction(PreparedTxnState(row.state))
    """

    __slots__ = ("_producer_id", "_epoch", "_tid_digest", "_anchor_tp", "_anchor_offset", "_sent_nothing")

    _producer_id: int
    _epoch: int
    _tid_digest: str | None
    _anchor_tp: TopicAndPartition | None
    _anchor_offset: int
    _sent_nothing: bool

    def __init__(self, serialized_state: str | None = None) -> None:
        if serialized_state is None:
            self._set(-1, -1, None, None, -1)
            return
        if not isinstance(serialized_state, str):
            raise InvalidPreparedStateError(
                f"a prepared state is a str, not {type(serialized_state).__name__}"
            )
        text = serialized_state.strip()
        if len(text) > MAX_STATE_LENGTH:
            raise InvalidPreparedStateError(
                f"prepared state is {len(text)} characters long; at most {MAX_STATE_LENGTH} are valid"
            )
        match = _V1_RE.fullmatch(text)
        if match is not None:
            pid, epoch, tid, part, off, topic, nothing = match.groups()
            anchor = None if part is None else TopicAndPartition(topic, int(part))
            self._set(
                int(pid), int(epoch), tid, anchor, -1 if off is None else int(off), sent_nothing=nothing is not None
            )
            return
        if _JAVA_RE.fullmatch(text):
            pid_text, epoch_text = text.split(":")
            self._set(int(pid_text), int(epoch_text), None, None, -1)
            return
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise InvalidPreparedStateError(
            f"malformed prepared state {shown!r}: expected 'k2pc1:<producerId>:<epoch>:<tid>[:<partition>:"
            f"<offset>:<topic>|:-]', the Java form '<producerId>:<epoch>', or '-1:-1'"
        )

    @classmethod
    def _build(
        cls,
        producer_id: int,
        epoch: int,
        transactional_id: str,
        anchor: TopicAndPartition | None = None,
        anchor_offset: int = -1,
        *,
        sent_nothing: bool = False,
    ) -> PreparedTxnState:
        """Create a version-1 state (used by the producer after prepare).

        ``sent_nothing=True`` (no anchor) marks a transaction that sent nothing
        to Kafka; without it and without an anchor the result is the legacy,
        ambiguous form (kept for tests of old strings).
        """
        state = cls.__new__(cls)
        state._set(
            producer_id, epoch, transactional_id_digest(transactional_id), anchor, anchor_offset,
            sent_nothing=sent_nothing,
        )
        if anchor is not None and len(str(state)) > MAX_STATE_LENGTH:
            state._set(
                producer_id, epoch, state._tid_digest,
                TopicAndPartition(topic_digest(anchor.topic), anchor.partition), anchor_offset,
            )
        return state

    def _set(
        self,
        producer_id: int,
        epoch: int,
        tid_digest: str | None,
        anchor: TopicAndPartition | None,
        anchor_offset: int,
        *,
        sent_nothing: bool = False,
    ) -> None:
        empty = producer_id == -1 and epoch == -1
        if sent_nothing and (anchor is not None or tid_digest is None):
            raise InvalidPreparedStateError("only an unanchored version-1 state can say it sent nothing")
        if not empty:
            if not 0 <= producer_id <= _INT64_MAX:
                raise InvalidPreparedStateError(f"producer id {producer_id} out of range")
            if not 0 <= epoch <= _INT16_MAX:
                raise InvalidPreparedStateError(f"producer epoch {epoch} out of range 0..{_INT16_MAX}")
        if anchor is None:
            anchor_offset = -1  # an offset without its partition names nothing; keep equality exact
        else:
            if not 0 <= anchor.partition <= _INT32_MAX:
                raise InvalidPreparedStateError(f"partition {anchor.partition} out of range")
            if not 0 <= anchor_offset <= _INT64_MAX:
                raise InvalidPreparedStateError(f"offset {anchor_offset} out of range")
        object.__setattr__(self, "_producer_id", producer_id)
        object.__setattr__(self, "_epoch", epoch)
        object.__setattr__(self, "_tid_digest", tid_digest)
        object.__setattr__(self, "_anchor_tp", anchor)
        object.__setattr__(self, "_anchor_offset", anchor_offset)
        object.__setattr__(self, "_sent_nothing", sent_nothing)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("PreparedTxnState is immutable")

    # -- accessors -----------------------------------------------------------
    @property
    def producer_id(self) -> int:
        """Producer id of the transaction (``-1`` for the empty state)."""
        return self._producer_id

    @property
    def epoch(self) -> int:
        """Producer epoch of the transaction (``-1`` for the empty state)."""
        return self._epoch

    @property
    def is_empty(self) -> bool:
        """True for ``PreparedTxnState()``: no prepared transaction."""
        return self._producer_id == -1

    @property
    def format_version(self) -> int:
        """``1`` for kafka2pc's anchored form, ``0`` for the Java ``producerId:epoch`` form."""
        return 0 if self._tid_digest is None else 1

    @property
    def anchor(self) -> tuple[TopicAndPartition, int] | None:
        """``(topic_partition, offset)`` of the transaction's first record on one partition, if any.

        A topic that was too long to store appears as its ``#``-digest.
        """
        if self._anchor_tp is None:
            return None
        return self._anchor_tp, self._anchor_offset

    @property
    def sent_nothing(self) -> bool:
        """True when the transaction sent nothing to Kafka (no record, no consumer offsets).

        Completing such a state commits nothing: any transaction open under the
        id is another one and is aborted.
        """
        return self._sent_nothing

    @property
    def names_one_transaction(self) -> bool:
        """True when the state names exactly one transaction: anchored, or one that sent nothing.

        False for the empty state, the Java ``producerId:epoch`` form and
        unanchored states written by older kafka2pc versions: recovery can only
        match those on ``producerId:epoch``, which consecutive librdkafka
        transactions share.
        """
        return self._anchor_tp is not None or self._sent_nothing

    def check_transactional_id(self, transactional_id: str) -> None:
        """Raise :class:`TransactionalIdMismatchError` if this state came from another id."""
        if self._tid_digest is not None and self._tid_digest != transactional_id_digest(transactional_id):
            raise TransactionalIdMismatchError(
                f"prepared state {self} was produced under another transactional.id than "
                f"{transactional_id!r} (digest {transactional_id_digest(transactional_id)} != {self._tid_digest})"
            )

    # -- value semantics -----------------------------------------------------
    def _key(self) -> tuple[object, ...]:
        return (
            self._producer_id, self._epoch, self._tid_digest, self._anchor_tp, self._anchor_offset, self._sent_nothing
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PreparedTxnState):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        if self._tid_digest is None:
            return f"{self._producer_id}:{self._epoch}"
        text = f"{_PREFIX}:{self._producer_id}:{self._epoch}:{self._tid_digest}"
        if self._anchor_tp is not None:
            text += f":{self._anchor_tp.partition}:{self._anchor_offset}:{self._anchor_tp.topic}"
        elif self._sent_nothing:
            text += _SENT_NOTHING
        return text

    def __repr__(self) -> str:
        return f"PreparedTxnState({str(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (PreparedTxnState, (str(self),))
