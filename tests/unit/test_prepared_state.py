"""``PreparedTxnState``: parse/format round trip, bounds, value semantics (no broker)."""

from __future__ import annotations

import os
import pickle
import string

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kafka2pc import InvalidPreparedStateError, PreparedTxnState, TopicAndPartition, TransactionalIdMismatchError
from kafka2pc._state import MAX_STATE_LENGTH, topic_digest, transactional_id_digest

INT64_MAX = 2**63 - 1
TOPIC_CHARS = string.ascii_letters + string.digits + "._-"


def examples(default: int) -> int:
    """``default`` examples, scaled by ``$KAFKA2PC_PROPERTY_EXAMPLES_SCALE`` (the Python matrix runs a tenth)."""
    return max(50, int(default * float(os.environ.get("KAFKA2PC_PROPERTY_EXAMPLES_SCALE", "1"))))


def build(pid: int, epoch: int, tid: str, topic: str | None = None, partition: int = 0, offset: int = -1) -> PreparedTxnState:
    anchor = None if topic is None else TopicAndPartition(topic, partition)
    return PreparedTxnState._build(pid, epoch, tid, anchor, offset)


# -- fixed forms ---------------------------------------------------------------


def test_empty_state() -> None:
    empty = PreparedTxnState()
    assert empty.is_empty and empty.producer_id == -1 and empty.epoch == -1
    assert str(empty) == "-1:-1"
    assert PreparedTxnState("-1:-1") == empty
    assert empty.anchor is None and empty.format_version == 0
    empty.check_transactional_id("anything")  # no digest: matches any id


def test_java_form_round_trips() -> None:
    state = PreparedTxnState("12345:7")
    assert (state.producer_id, state.epoch) == (12345, 7)
    assert state.format_version == 0 and state.anchor is None and not state.is_empty
    assert str(state) == "12345:7"
    assert PreparedTxnState(str(state)) == state
    assert PreparedTxnState(f"{INT64_MAX}:32767").producer_id == INT64_MAX


def test_version_1_with_anchor_round_trips() -> None:
    state = build(42, 3, "orders-1", "orders", 5, 1000)
    text = str(state)
    assert text == f"k2pc1:42:3:{transactional_id_digest('orders-1')}:5:1000:orders"
    parsed = PreparedTxnState(text)
    assert parsed == state and hash(parsed) == hash(state)
    assert parsed.anchor == (TopicAndPartition("orders", 5), 1000)
    assert parsed.format_version == 1
    assert repr(parsed) == f"PreparedTxnState({text!r})"


def test_version_1_without_anchor_round_trips() -> None:
    state = build(42, 3, "orders-1")
    assert str(state) == f"k2pc1:42:3:{transactional_id_digest('orders-1')}"
    assert PreparedTxnState(str(state)) == state
    assert state.anchor is None and state.format_version == 1


def test_anchor_names_one_transaction_where_producer_id_and_epoch_do_not() -> None:
    """librdkafka (TV1): consecutive transactions share producerId:epoch; the anchor differs."""
    n = build(42, 3, "tx", "t", 0, 10)
    n_plus_1 = build(42, 3, "tx", "t", 0, 14)
    assert (n.producer_id, n.epoch) == (n_plus_1.producer_id, n_plus_1.epoch)
    assert n != n_plus_1
    assert PreparedTxnState("42:3") != n  # the Java form is a different (weaker) identity


def test_longest_topic_is_stored_as_digest_and_stays_within_255() -> None:
    topic = "t" * 249  # Kafka's maximum topic name length
    state = build(INT64_MAX, 32767, "x" * 1000, topic, 2**31 - 1, INT64_MAX)
    text = str(state)
    assert len(text) <= MAX_STATE_LENGTH
    assert text.endswith(":" + topic_digest(topic))
    assert PreparedTxnState(text) == state
    assert state.anchor == (TopicAndPartition(topic_digest(topic), 2**31 - 1), INT64_MAX)


def test_topic_that_fits_is_stored_verbatim() -> None:
    topic = "t" * 200
    state = build(1, 0, "tx", topic, 0, 0)
    assert str(state).endswith(":" + topic)
    assert len(str(state)) <= MAX_STATE_LENGTH


def test_transactional_id_check() -> None:
    state = build(1, 0, "orders-1", "t", 0, 0)
    state.check_transactional_id("orders-1")
    with pytest.raises(TransactionalIdMismatchError, match="orders-2"):
        state.check_transactional_id("orders-2")
    PreparedTxnState("1:0").check_transactional_id("orders-2")  # the Java form carries no id


def test_value_object_is_immutable_and_picklable() -> None:
    state = build(1, 0, "tx", "t", 0, 0)
    with pytest.raises(AttributeError):
        state._producer_id = 2
    with pytest.raises(AttributeError):
        state.foo = 1
    assert pickle.loads(pickle.dumps(state)) == state
    assert state != str(state)  # no equality with the text
    assert len({state, PreparedTxnState(str(state))}) == 1


def test_surrounding_whitespace_is_ignored() -> None:
    assert PreparedTxnState("  12:3\n") == PreparedTxnState("12:3")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "-1",
        "1",
        "1:",
        ":1",
        "-1:0",
        "0:-1",
        "-2:-2",
        "01:1",  # leading zeros would break the round trip
        "1:01",
        "1:2:3",
        "1:32768",  # epoch is an int16
        f"{INT64_MAX + 1}:0",  # producer id is an int64
        "99999999999999999999:0",
        "k2pc1:1:0",
        "k2pc1:1:0:ABCDEF12",  # digest is lowercase hex
        "k2pc1:1:0:abcdef1",
        "k2pc1:1:0:abcdef12:0:0",
        "k2pc1:1:0:abcdef12:0:0:",
        "k2pc1:1:0:abcdef12:0:0:bad/topic",
        "k2pc1:1:0:abcdef12:2147483648:0:t",  # partition is an int32
        "k2pc1:1:0:abcdef12:0:-1:t",
        "k2pc1:1:0:abcdef12:0:0:#abc",
        "k2pc2:1:0:abcdef12",
        "K2PC1:1:0:abcdef12",
        "k2pc1:-1:-1:abcdef12",
        "1:0\x00",
        "١:٠",  # non-ASCII digits
        "k2pc1:1:0:abcdef12:0:0:" + "t" * 250,
        "1:" + "0" * 300,
    ],
)
def test_malformed_strings_are_refused(text: str) -> None:
    with pytest.raises(InvalidPreparedStateError) as raised:
        PreparedTxnState(text)
    assert isinstance(raised.value, ValueError)
    assert len(str(raised.value)) < 400  # a huge input is not echoed back whole


@pytest.mark.parametrize("value", [b"1:0", 1, 1.5, ["1:0"], object()])
def test_non_strings_are_refused(value: object) -> None:
    with pytest.raises(InvalidPreparedStateError, match="is a str"):
        PreparedTxnState(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pid", "epoch", "partition", "offset"),
    [(-2, 0, 0, 0), (0, -2, 0, 0), (0, 32768, 0, 0), (INT64_MAX + 1, 0, 0, 0), (0, 0, -1, 0), (0, 0, 2**31, 0), (0, 0, 0, -1)],
)
def test_build_refuses_out_of_range_numbers(pid: int, epoch: int, partition: int, offset: int) -> None:
    with pytest.raises(InvalidPreparedStateError):
        build(pid, epoch, "tx", "t", partition, offset)


# -- properties ----------------------------------------------------------------

topics = st.text(TOPIC_CHARS, min_size=1, max_size=249)
built_states = st.builds(
    build,
    pid=st.integers(0, INT64_MAX),
    epoch=st.integers(0, 32767),
    tid=st.text(min_size=1, max_size=300),
    topic=st.one_of(st.none(), topics),
    partition=st.integers(0, 2**31 - 1),
    offset=st.integers(0, INT64_MAX),
).filter(lambda s: s is not None)


@settings(max_examples=examples(2000), deadline=None)
@given(built_states)
def test_every_built_state_round_trips_within_255_chars(state: PreparedTxnState) -> None:
    text = str(state)
    assert len(text) <= MAX_STATE_LENGTH
    assert PreparedTxnState(text) == state
    assert str(PreparedTxnState(text)) == text


def _near_valid() -> st.SearchStrategy[str]:
    """Strings built from the grammar's pieces, so that both outcomes are well explored."""
    good_number = st.integers(0, 2**31 - 1).map(str)
    bad_number = st.one_of(
        st.integers(-3, 2**64).map(str),
        st.sampled_from(["", "-1", "00", "01", "9" * 19, "9" * 20, " 1"]),
    )
    number = st.one_of(good_number, good_number, good_number, bad_number)
    good_digest = st.text("0123456789abcdef", min_size=8, max_size=8)
    digest = st.one_of(good_digest, good_digest, st.text(max_size=10))
    topic = st.one_of(topics, topics, st.text(max_size=20), st.just("#" + "a" * 24))
    prefix = st.sampled_from(["k2pc1", "k2pc1", "k2pc1", "k2pc0", "k2pc2", "K2PC1", "", "k2pc1 "])
    pieces = st.tuples(prefix, number, number, digest, number, number, topic)
    return st.one_of(
        st.tuples(number, number).map(":".join),
        pieces.map(lambda p: ":".join(p[:4])),
        pieces.map(":".join),
        pieces.flatmap(lambda p: st.integers(0, 7).map(lambda n: ":".join(p[:n]))),
    )


@settings(max_examples=examples(10_000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=300), _near_valid(), st.text(":-0123456789k2pc#abcdef", max_size=80)))
@example("-1:-1")
@example("0:0")
@example(f"k2pc1:{INT64_MAX}:32767:00000000:{2**31 - 1}:{INT64_MAX}:" + "t" * 190)
def test_any_string_parses_to_a_round_tripping_state_or_is_refused(text: str) -> None:
    try:
        state = PreparedTxnState(text)
    except InvalidPreparedStateError:
        event("refused")
        return
    event(f"valid, format version {state.format_version}, anchored: {state.anchor is not None}")
    formatted = str(state)
    assert len(formatted) <= MAX_STATE_LENGTH
    assert PreparedTxnState(formatted) == state
    assert str(PreparedTxnState(formatted)) == formatted
    assert formatted == text.strip()  # one text per state: nothing is normalised silently


# -- every transaction shape gets an exact name ----------------------------------


def test_state_of_a_transaction_that_sent_nothing_round_trips() -> None:
    state = PreparedTxnState._build(42, 3, "orders-1", sent_nothing=True)
    assert str(state) == f"k2pc1:42:3:{transactional_id_digest('orders-1')}:-"
    parsed = PreparedTxnState(str(state))
    assert parsed == state and hash(parsed) == hash(state)
    assert parsed.sent_nothing and parsed.anchor is None and parsed.format_version == 1
    assert parsed.names_one_transaction and not parsed.is_empty


def test_sent_nothing_differs_from_the_legacy_unanchored_form() -> None:
    """Old ``k2pc1:<pid>:<epoch>:<tid>`` strings still parse, keep their meaning and stay ambiguous."""
    legacy = PreparedTxnState(f"k2pc1:42:3:{transactional_id_digest('tx')}")
    nothing = PreparedTxnState._build(42, 3, "tx", sent_nothing=True)
    assert legacy != nothing
    assert not legacy.sent_nothing and not legacy.names_one_transaction
    assert str(legacy) == f"k2pc1:42:3:{transactional_id_digest('tx')}"


def test_which_states_name_one_transaction() -> None:
    assert build(1, 0, "tx", "kafka2pc-anchors", 3, 7).names_one_transaction
    assert not PreparedTxnState().names_one_transaction
    assert not PreparedTxnState("1:0").names_one_transaction
    assert not PreparedTxnState().sent_nothing and not PreparedTxnState("1:0").sent_nothing


def test_sent_nothing_cannot_carry_an_anchor() -> None:
    with pytest.raises(InvalidPreparedStateError, match="sent nothing"):
        PreparedTxnState._build(1, 0, "tx", TopicAndPartition("t", 0), 5, sent_nothing=True)


@pytest.mark.parametrize(
    "text",
    [
        "k2pc1:1:0:abcdef12:-:",
        "k2pc1:1:0:abcdef12:--",
        "k2pc1:1:0:abcdef12:0:0:t:-",
        "k2pc1:1:0:abcdef12-",
        "k2pc1:1:0:-",
        "1:0:-",
        "-1:-1:-",
    ],
)
def test_malformed_sent_nothing_strings_are_refused(text: str) -> None:
    with pytest.raises(InvalidPreparedStateError):
        PreparedTxnState(text)


@settings(max_examples=examples(500), deadline=None)
@given(st.integers(0, INT64_MAX), st.integers(0, 32767), st.text(min_size=1, max_size=300))
def test_every_sent_nothing_state_round_trips(pid: int, epoch: int, tid: str) -> None:
    state = PreparedTxnState._build(pid, epoch, tid, sent_nothing=True)
    assert PreparedTxnState(str(state)) == state and PreparedTxnState(str(state)).sent_nothing
    assert state != PreparedTxnState._build(pid, epoch, tid)
