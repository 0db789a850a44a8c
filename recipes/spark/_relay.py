"""Log records and batch metrics of ``format("kafka2pc")``'s driver-side calls, brought back to the driver's Python.

PySpark runs a Python data source's ``writer()``, ``commit`` and ``abort`` in
Python worker processes on the driver host, not in the driver's Python
process: what they log ends as a bare stderr line, outside the driver's
``logging``.  :func:`monitor` starts, once per driver process, a relay: a
daemon thread serving a UNIX socket in a private directory (mode 0700).
``register_data_source`` gives its address to the data source it registers;
those calls connect for their duration (:func:`relayed`), learn the level the
driver's ``kafka2pc`` logger is enabled for, and send each record of the
``kafka2pc`` loggers at that level or above, and each batch's
:class:`BatchMetrics`.  The driver handles each through its own ``logging``
(the record keeps its logger name, level and time) and answers, so a record
is in the driver's logs before ``save()`` returns.

The executors' tasks do not relay: their logs stay the executors'.  When the
relay cannot be reached, a record goes to stderr as before.

On Spark Connect the same relay serves the ``foreachBatch`` sink: a
:class:`~kafka2pc.recipes.spark.KafkaTwoPhaseSink` pickled by the client
carries the client's relay address and a token (:func:`receiver_address`);
its copy in the server's ``foreachBatch`` worker relays its records and each
batch's metrics, which the client hands to the sink object it kept.  A UNIX
socket reaches only processes on the client's host: with a Connect server
elsewhere the records stay in the server's logs.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, Final, cast

from ._values import BatchMetrics

logger = logging.getLogger("kafka2pc.recipes.spark_sink")

CONNECT_TIMEOUT_S: Final = 5.0
"""How long a driver-side worker waits to connect to the relay, and for each answer, before it gives up on it."""
ANSWER_TIMEOUT_S: Final = 10.0
_RELAYED_LOGGER: Final = "kafka2pc"


class DataSourceMonitor:
    """What ``format("kafka2pc")`` wrote in this driver process: each batch's :class:`BatchMetrics`.

    :func:`~kafka2pc.recipes.spark.register_data_source` returns it (one per
    driver process).  ``metrics`` holds the last 100 batches of every write
    (batch writes are batch 0 of their run; streaming queries one per
    micro-batch), ``last_batch_metrics`` the newest, ``sink_id`` the newest
    batch's sink id; :meth:`add_batch_listener` calls a function at the end
    of each batch (``kafka2pc.otel.instrument_spark_sink`` uses it).
    """

    def __init__(self, history: int = 100) -> None:
        self._metrics: deque[BatchMetrics] = deque(maxlen=history)
        self._listeners: list[Callable[[BatchMetrics], None]] = []
        self._lock = threading.Lock()

    def metrics(self) -> list[BatchMetrics]:
        """Metrics of the recent batches, oldest first (a copy, as ``writer.metrics()``)."""
        with self._lock:
            return list(self._metrics)

    @property
    def last_batch_metrics(self) -> BatchMetrics | None:
        """Metrics of the newest batch."""
        with self._lock:
            return self._metrics[-1] if self._metrics else None

    @property
    def sink_id(self) -> str | None:
        """The sink id of the newest batch (``None`` before the first)."""
        last = self.last_batch_metrics
        return last.sink_id if last is not None else None

    def add_batch_listener(self, callback: Callable[[BatchMetrics], None]) -> None:
        """Call ``callback(metrics)`` on the relay's thread at the end of each batch (exceptions are logged)."""
        with self._lock:
            self._listeners.append(callback)

    def _batch(self, metrics: BatchMetrics) -> None:
        with self._lock:
            self._metrics.append(metrics)
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback(metrics)
            except Exception:  # noqa: BLE001 - a listener's bug must not fail the batch
                logger.exception("a batch listener of format('kafka2pc') failed")


class _Relay:
    """The driver's end: accept the workers' connections, hand each record to ``logging``."""

    def __init__(self, monitor: DataSourceMonitor) -> None:
        self.monitor = monitor
        self._dir = tempfile.mkdtemp(prefix="kafka2pc-relay-")
        os.chmod(self._dir, 0o700)
        self.address = os.path.join(self._dir, "relay.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.address)
        self._server.listen(16)
        atexit.register(shutil.rmtree, self._dir, True)
        threading.Thread(target=self._serve, name="kafka2pc-spark-relay", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), name="kafka2pc-spark-relay-conn",
                             daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn, cast(BinaryIO, conn.makefile("rwb")) as stream:
            level = logging.getLogger(_RELAYED_LOGGER).getEffectiveLevel()
            _write(stream, {"level": level})
            for line in stream:
                try:
                    message = json.loads(line)
                    if "log" in message:
                        _handle_record(message["log"])
                    elif "batch" in message:
                        _deliver(self.monitor, message.get("to"), _metrics_from(message["batch"]))
                except Exception:  # noqa: BLE001 - a malformed message is dropped, the worker goes on
                    logger.debug("format('kafka2pc') relay: dropped a message", exc_info=True)
                try:
                    _write(stream, {"ok": True})
                except OSError:
                    return


def _write(stream: BinaryIO, message: dict[str, Any]) -> None:
    stream.write(json.dumps(message).encode() + b"\n")
    stream.flush()


def _handle_record(fields: dict[str, Any]) -> None:
    target = logging.getLogger(str(fields["name"]))
    if not target.isEnabledFor(int(fields["levelno"])):
        return
    target.handle(logging.makeLogRecord(fields))


def _metrics_from(fields: dict[str, Any]) -> BatchMetrics:
    fields = dict(fields)
    fields["repaired_partitions"] = tuple(fields["repaired_partitions"])
    fields["task_attempts"] = {int(k): int(v) for k, v in fields["task_attempts"].items()}
    return BatchMetrics(**fields)


_relay: _Relay | None = None
_relay_lock = threading.Lock()
_receivers: dict[str, weakref.WeakMethod[Callable[[BatchMetrics], None]]] = {}


def monitor() -> tuple[DataSourceMonitor, str]:
    """This driver process's monitor and its relay's address (started on the first call)."""
    global _relay
    with _relay_lock:
        if _relay is None:
            _relay = _Relay(DataSourceMonitor())
        return _relay.monitor, _relay.address


def receiver_address(receive: Callable[[BatchMetrics], None], token: str | None) -> tuple[str, str]:
    """The relay's address and a token under which batch metrics reach ``receive`` (a bound method, held weakly).

    Pass the token returned before to keep it (one per receiving object).
    """
    _, address = monitor()
    token = token or uuid.uuid4().hex
    with _relay_lock:
        _receivers[token] = weakref.WeakMethod(receive)
    return address, token


def _deliver(driver_monitor: DataSourceMonitor, to: str | None, metrics: BatchMetrics) -> None:
    """A batch's metrics to their receiver (``to``), or to the data source's monitor."""
    if to is None:
        driver_monitor._batch(metrics)
        return
    with _relay_lock:
        ref = _receivers.get(to)
    receive = ref() if ref is not None else None
    if receive is not None:
        receive(metrics)


class RelayClient:
    """A driver-side worker's end: one connection for the duration of one call."""

    def __init__(self, address: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(CONNECT_TIMEOUT_S)
        self._sock.connect(address)
        self._sock.settimeout(ANSWER_TIMEOUT_S)
        self._stream = cast(BinaryIO, self._sock.makefile("rwb"))
        self._lock = threading.Lock()
        self.level = int(json.loads(self._stream.readline())["level"])
        self.broken = False

    def send(self, kind: str, payload: dict[str, Any], to: str | None = None) -> bool:
        """Send one message (to the receiver ``to``) and wait until the driver handled it; ``False`` if gone."""
        message: dict[str, Any] = {kind: payload}
        if to is not None:
            message["to"] = to
        with self._lock:
            if self.broken:
                return False
            try:
                _write(self._stream, message)
                if not self._stream.readline():
                    raise OSError("the relay closed the connection")
                return True
            except (OSError, ValueError):
                self.broken = True
                return False

    def send_batch(self, metrics: BatchMetrics, to: str | None = None) -> None:
        """Report one batch's metrics to the driver's :class:`DataSourceMonitor` (or to the receiver ``to``)."""
        self.send("batch", dataclasses.asdict(metrics), to)

    def close(self) -> None:
        with self._lock:
            self.broken = True
            for part in (self._stream, self._sock):
                try:
                    part.close()
                except OSError:
                    pass


class _RelayHandler(logging.Handler):
    def __init__(self, client: RelayClient) -> None:
        super().__init__()
        self._client = client
        self._fallback = logging.StreamHandler(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        fields = {
            "name": record.name, "levelno": record.levelno, "levelname": record.levelname,
            "msg": record.getMessage(), "created": record.created, "msecs": record.msecs,
            "pathname": record.pathname, "filename": record.filename, "module": record.module,
            "lineno": record.lineno, "funcName": record.funcName,
            "exc_text": logging.Formatter().formatException(record.exc_info) if record.exc_info else None,
        }
        if not self._client.send("log", fields):
            self._fallback.emit(record)


@contextmanager
def relayed(address: str | None) -> Iterator[RelayClient | None]:
    """Within the block, the ``kafka2pc`` loggers' records go to the driver's relay at ``address``.

    Yields the client (to report batch metrics), or ``None`` without a relay
    or when it cannot be reached (records then go to stderr, as before).
    """
    client: RelayClient | None = None
    if address is not None:
        try:
            client = RelayClient(address)
        except (OSError, ValueError, KeyError) as exc:
            logger.debug("format('kafka2pc'): no relay to the driver's logging at %s: %s", address, exc)
    if client is None:
        yield None
        return
    target = logging.getLogger(_RELAYED_LOGGER)
    handler = _RelayHandler(client)
    saved = (target.level, target.propagate)
    target.setLevel(client.level)
    target.propagate = False  # relayed, not also printed by this worker
    target.addHandler(handler)
    try:
        yield client
    finally:
        target.removeHandler(handler)
        target.setLevel(saved[0])
        target.propagate = saved[1]
        client.close()
