"""The sink's fast path: an Arrow batch's keys and values handed to librdkafka without a Python object per row.

confluent-kafka needs a Python ``bytes`` (or ``str``) per key and value and,
for ``Producer.produce_batch``, a dict per record; that per-row work, and the
delivery report confluent-kafka serves per record even when only failures
reach Python, was most of a task's CPU (``benchmarks/bench_spark_task.py``).
Here the ``rd_kafka_message_t`` array that ``rd_kafka_produce_batch`` takes is
built with numpy straight from the Arrow buffers (pointers into the value and
key data, lengths from the offsets), and handed to the very librdkafka
instance the task's confluent-kafka producer runs on (``RD_KAFKA_MSG_F_COPY``:
librdkafka copies each record before the call returns).

What this costs in guarantees, and how the sink makes up for it:

- The records carry no confluent-kafka delivery state, so a failed delivery
  reaches no Python callback.  librdkafka itself puts a transactional
  producer in its *abortable error* state when the broker refuses a record
  or a record times out (epoch bump), and :func:`check_transaction` asks for
  that state after the prepare's flush; a transaction whose records all
  failed has no open transaction on any partition, which the prepare's anchor
  lookup already reports.  Records librdkafka refuses at once (too large, a
  full queue) are reported by ``rd_kafka_produce_batch`` itself.
- The producer handle is read from confluent-kafka's ``Handle`` object (its
  first field after the Python object header, unchanged since
  confluent-kafka 0.9) and checked against librdkafka before use: the handle
  must point into mapped memory and ``rd_kafka_opaque`` must name this very
  Python object (confluent-kafka sets it so).  If anything does not match
  (another layout, another librdkafka loaded, not Linux) the fast path is
  off for the process and the sink uses ``produce_batch``, logged once.
  CPython only (elsewhere an object's id is not its address).

Only used for the shape it can serve: one topic (the sink's ``topic``
option), keys and values as Arrow string/binary, no ``partition`` or
``headers`` column, and ``message.timeout.ms`` left to follow the transaction
timeout (a shorter one could fail records locally, without the abortable
state, while the transaction stays open).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import platform
import threading
import time
from typing import TYPE_CHECKING, Any, Final

from kafka2pc import AbortableError, FatalError, QueueFullError, UsageError

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa  # type: ignore[import-untyped]

logger = logging.getLogger("kafka2pc.recipes.spark_sink")

_RD_KAFKA_MSG_F_COPY: Final = 0x2
_RD_KAFKA_PARTITION_UA: Final = -1
_ERR_QUEUE_FULL: Final = -184
_ERR_STATE: Final = -172

_lock = threading.Lock()
_loaded = False
_lib: ctypes.CDLL | None = None
_message_dtype: Any = None


def _load() -> ctypes.CDLL | None:
    """librdkafka's entry points, or ``None`` when the fast path is unavailable (logged once)."""
    global _loaded, _lib, _message_dtype
    with _lock:
        if _loaded:
            return _lib
        _loaded = True
        try:
            import confluent_kafka
            import numpy as np

            if platform.python_implementation() != "CPython":
                raise OSError("not CPython (object ids are not addresses)")
            import confluent_kafka.cimpl

            # Symbols looked up through confluent-kafka's own extension module resolve to
            # the librdkafka it was linked with (dlsym searches the object's dependencies):
            # the very instance the producers run on, whatever else is loaded.
            lib = ctypes.CDLL(confluent_kafka.cimpl.__file__)
            lib.rd_kafka_version.restype = ctypes.c_int
            lib.rd_kafka_version.argtypes = []
            if lib.rd_kafka_version() != confluent_kafka.libversion()[1]:
                raise OSError("the librdkafka found is not the one confluent-kafka reports")
            lib.rd_kafka_opaque.restype = ctypes.c_void_p
            lib.rd_kafka_opaque.argtypes = [ctypes.c_void_p]
            lib.rd_kafka_topic_new.restype = ctypes.c_void_p
            lib.rd_kafka_topic_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
            lib.rd_kafka_topic_destroy.restype = None
            lib.rd_kafka_topic_destroy.argtypes = [ctypes.c_void_p]
            lib.rd_kafka_produce_batch.restype = ctypes.c_int
            lib.rd_kafka_produce_batch.argtypes = [
                ctypes.c_void_p, ctypes.c_int32, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
            ]
            # rd_kafka_message_t (rdkafka.h, a public struct): err, rkt, partition, payload,
            # len, key, key_len, offset, _private; C alignment.
            _message_dtype = np.dtype([
                ("err", np.int32), ("rkt", np.uintp), ("partition", np.int32), ("payload", np.uintp),
                ("len", np.uintp), ("key", np.uintp), ("key_len", np.uintp), ("offset", np.int64),
                ("private", np.uintp),
            ], align=True)
            if _message_dtype.itemsize != 9 * 8:
                raise OSError(f"unexpected rd_kafka_message_t layout ({_message_dtype.itemsize} bytes)")
            _lib = lib
        except (OSError, AttributeError, ImportError) as exc:
            logger.info("direct Arrow produce unavailable (%s): the sink uses produce_batch", exc)
            _lib = None
        return _lib


def _readable(address: int, size: int) -> bool:
    """Whether ``[address, address + size)`` is readable memory of this process (``/proc/self/maps``)."""
    spans: list[tuple[int, int]] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, perms = line.split(None, 2)[:2]
                if perms.startswith("r"):
                    first, last = span.split("-")
                    spans.append((int(first, 16), int(last, 16)))
    except OSError:
        return False
    spans.sort()
    merged: list[list[int]] = []
    for start, end in spans:  # adjacent mappings (e.g. the heap and an arena next to it) form one range
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    i = bisect.bisect_right([start for start, _ in merged], address) - 1
    return i >= 0 and address + size <= merged[i][1]


def handle_of(raw: Any) -> int | None:
    """The ``rd_kafka_t *`` of confluent-kafka producer ``raw``, checked; ``None`` if it cannot be trusted."""
    lib = _load()
    if lib is None:
        return None
    header = object.__basicsize__
    pointer = ctypes.sizeof(ctypes.c_void_p)
    if type(raw).__basicsize__ < header + pointer:
        return None
    rk = ctypes.c_void_p.from_address(id(raw) + header).value
    # rd_kafka_opaque reads the handle's configuration, a few KB into rd_kafka_t.
    if not rk or rk % pointer or not _readable(rk, 4096):
        logger.info("direct Arrow produce unavailable (unexpected producer layout): the sink uses produce_batch")
        return None
    if lib.rd_kafka_opaque(rk) != id(raw):
        logger.info("direct Arrow produce unavailable (producer handle mismatch): the sink uses produce_batch")
        return None
    return int(rk)


def _pointers(column: pa.Array, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the address of its bytes and their length (0, 0 for a null), from an Arrow (large) string/binary."""
    import numpy as np
    import pyarrow as pa

    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_binary(kind):
        offset_type: Any = np.int32
    elif pa.types.is_large_string(kind) or pa.types.is_large_binary(kind):
        offset_type = np.int64
    else:
        raise UsageError(f"direct produce takes string or binary columns, not {kind}")
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offset_type, count=n + 1,
                            offset=column.offset * np.dtype(offset_type).itemsize)
    base = data_buf.address if data_buf is not None else 0
    addresses = offsets[:-1].astype(np.uintp) + np.uintp(base)
    lengths = np.diff(offsets).astype(np.uintp)
    if column.null_count:
        invalid = ~column.is_valid().to_numpy(zero_copy_only=False)
        addresses[invalid] = 0
        lengths[invalid] = 0
    return addresses, lengths


def produce_arrow(
    raw: Any, rk: int, topic: str, values: pa.Array, keys: pa.Array | None, *, timeout: float
) -> int:
    """Queue one record per row (value ``values[i]``, key ``keys[i]``) to ``topic``, in order; return how many.

    ``raw`` is the confluent-kafka producer whose handle :func:`handle_of`
    returned as ``rk``, inside a transaction.  The configured partitioner
    places each record, as for ``produce``.  While librdkafka's queue is full,
    delivery events are served and the rest is queued again, in order, for up
    to ``timeout`` seconds (then :class:`~kafka2pc.QueueFullError`).  A record
    librdkafka refuses for another reason raises
    :class:`~kafka2pc.AbortableError` naming it: abort the transaction.
    """
    import numpy as np

    lib = _lib
    assert lib is not None, "produce_arrow before handle_of"
    n = len(values)
    if n == 0:
        return 0
    messages = np.zeros(n, dtype=_message_dtype)
    messages["payload"], messages["len"] = _pointers(values, n)
    if keys is not None:
        messages["key"], messages["key_len"] = _pointers(keys, n)
    messages["partition"] = _RD_KAFKA_PARTITION_UA
    deadline = time.monotonic() + timeout
    rkt = lib.rd_kafka_topic_new(rk, topic.encode(), None)
    if not rkt:
        raise UsageError(f"librdkafka refused topic {topic!r}")
    start = 0
    try:
        while start < n:
            chunk = messages[start:]
            good = lib.rd_kafka_produce_batch(rkt, _RD_KAFKA_PARTITION_UA, _RD_KAFKA_MSG_F_COPY,
                                              chunk.ctypes.data, n - start)
            if good == n - start:
                return n
            errors = chunk["err"]
            failed = np.flatnonzero(errors)
            refused = failed[errors[failed] != _ERR_QUEUE_FULL]
            if len(refused):
                from confluent_kafka import KafkaError

                code = int(errors[refused[0]])
                error = KafkaError(code)
                raise AbortableError(
                    f"librdkafka refused record {start + int(refused[0])} of the batch for {topic!r}: "
                    f"{error.str()}", error_name=error.name(), error_code=code,
                )
            first = int(failed[0])  # after a full queue every later record fails too: a suffix
            # Queue the suffix again once deliveries made room.
            start += first
            if time.monotonic() >= deadline:
                raise QueueFullError(
                    f"produce to {topic!r}: the local queue stayed full; {start} of {n} records were queued",
                    queued=start,
                )
            raw.poll(0.01)
        return n
    finally:
        lib.rd_kafka_topic_destroy(rkt)


def check_transaction(raw: Any, transactional_id: str) -> None:
    """Raise if librdkafka has put the producer's transaction in an error state (a record failed delivery).

    Asks ``begin_transaction``, which inside a transaction cannot succeed: it
    fails with a state error while the transaction is fine, and with the
    transaction's error when a refused or timed-out record made it abortable
    or fatal.  Call after the prepare's flush.
    """
    from confluent_kafka import KafkaException

    try:
        raw.begin_transaction()
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if error is None or error.code() == _ERR_STATE and not error.txn_requires_abort() and not error.fatal():
            return
        cls = FatalError if error.fatal() else AbortableError
        raise cls(
            f"{transactional_id}: a record of the transaction failed delivery: {error.str()}",
            error_name=error.name(), error_code=error.code(),
        ) from exc
    raise FatalError(f"{transactional_id}: librdkafka had no transaction open after the prepare")
