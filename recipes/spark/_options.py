"""The data source's options, where its decisions live, and :func:`recover` (no PySpark 4 import here).

``format("kafka2pc")`` itself needs PySpark 4 (:mod:`._datasource`); what a
driver process needs to settle a stopped write does not, so ``recover`` is
importable on every supported line.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kafka2pc import BrokerUnavailableError, TransactionAdmin, UsageError, unreachable_reason

from ._protocol import SinkCoordinator
from ._session import local_path
from ._store import LocalDecisionStore
from ._values import SinkRecovery

DEFAULT_PREFIX: Final = "kafka2pc-spark-"
LOCAL_DECISION_PATH: Final = "~/.kafka2pc/spark"
"""The batch writes' decision directory on a ``local[*]`` session registered by ``register_data_source``."""
PROBE_TIMEOUT_S: Final = 10.0
"""The bound of the bootstrap check before a write or a recovery (DNS and TCP connects together)."""

_NAME_RE: Final = re.compile(r"[A-Za-z0-9._-]{0,60}")


def check_reachable(config: Mapping[str, Any]) -> None:
    """Raise :class:`~kafka2pc.BrokerUnavailableError` at once if no bootstrap address accepts a connection.

    Without it, a refused bootstrap costs the control plane's whole timeout
    (30 s) and ends with a vaguer error.  Blocks at most :data:`PROBE_TIMEOUT_S`;
    costs one TCP connection when a broker answers.
    """
    why = unreachable_reason(str(config.get("bootstrap.servers", "")), PROBE_TIMEOUT_S)
    if why is not None:
        raise BrokerUnavailableError(f"Kafka unreachable: {why} (check bootstrap.servers and the network)")


def is_local_master(master: str) -> bool:
    """``local``, ``local[4]``, ``local[*]``, ``local[2,4]``: the driver and every task on one machine."""
    return master == "local" or master.startswith("local[")


@dataclass(frozen=True)
class Options:
    """The data source's options, checked (the same in every process that builds a writer)."""

    config: Mapping[str, Any]
    topic: str | None
    run_id: str | None
    decision_path: str | None
    checkpoint: str | None
    prefix: str
    retain: int
    max_repairs: int

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> Options:
        config: dict[str, Any] = {}
        for key, value in options.items():
            if key.lower().startswith("kafka.") and key.lower() != "kafka.":
                config[key[len("kafka."):]] = value
        if "bootstrap.servers" not in config:
            raise UsageError("option 'kafka.bootstrap.servers' must be specified for the kafka2pc data source")
        if "transactional.id" in config:
            raise UsageError("the kafka2pc data source chooses transactional ids: do not set "
                             "'kafka.transactional.id'")
        prefix = options.get("kafka2pc.transactionalIdPrefix", DEFAULT_PREFIX)
        if not _NAME_RE.fullmatch(prefix):
            raise UsageError(f"invalid kafka2pc.transactionalIdPrefix {prefix!r}")
        return cls(
            config, options.get("topic"), options.get("kafka2pc.runId"), options.get("kafka2pc.decisionPath"),
            options.get("checkpointLocation"), prefix, _int_option(options, "kafka2pc.decisionsToRetain", 100),
            _int_option(options, "kafka2pc.maxRepairs", 3),
        )


def _int_option(options: Mapping[str, str], name: str, default: int) -> int:
    text = options.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"option {name} must be an integer, not {text!r}") from None
    if value < 0:
        raise UsageError(f"option {name} must not be negative, not {value}")
    return value


def location(opts: Options, *, streaming: bool, local_master: bool | None = True) -> tuple[str, str]:
    """The sink id and the decision directory of a write: ``<decision path>/<sink id>``.

    A batch write without ``kafka2pc.decisionPath`` keeps its decisions in
    :data:`LOCAL_DECISION_PATH` only when the session is known to run on one
    machine (``local_master``: registered by ``register_data_source`` on a
    ``local[*]`` master).  Anywhere else that is one driver host's disk, which
    a rerun on another host does not see: the write is refused.
    """
    if streaming:
        base = opts.decision_path or (f"{opts.checkpoint.rstrip('/')}/kafka2pc" if opts.checkpoint else None)
        if base is None:
            raise UsageError("set the query's checkpointLocation option (or kafka2pc.decisionPath): "
                             "the decisions live there")
        root = _directory(base)
        sink_id = "q" + hashlib.sha256(root.encode()).hexdigest()[:16]
    else:
        if opts.decision_path is None and not local_master:
            where = ("this session's master is not local[*]" if local_master is False else
                     "format('kafka2pc') was not registered by register_data_source on a local[*] session")
            raise UsageError(
                f"set the option kafka2pc.decisionPath for a batch write: {where}, and the default "
                f"({LOCAL_DECISION_PATH}) is one driver host's disk, which a rerun on another host would not "
                "see (its run would be written twice). Use a directory every driver that may rerun the job "
                "mounts (NFS, a mounted bucket)"
            )
        root = _directory(opts.decision_path or LOCAL_DECISION_PATH)
        run_id = opts.run_id or f"unnamed-{os.getpid()}-{time.time_ns()}"
        sink_id = "r" + hashlib.sha256(run_id.encode()).hexdigest()[:16]
    return sink_id, os.path.join(root, sink_id)


def _directory(path: str) -> str:
    """A local directory for decisions: a plain path or a ``file:`` URI (a mounted file system for clusters)."""
    if path.startswith("file:"):
        return local_path(path)
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", path):
        raise UsageError(
            f"decisions must live on a file system the driver mounts (a local path or file: URI), not {path!r}: "
            "set kafka2pc.decisionPath (or use the foreachBatch sink, which stores decisions through Hadoop)"
        )
    return os.path.abspath(os.path.expanduser(path))


def recover(options: Mapping[str, str]) -> SinkRecovery:
    """Settle what a stopped or failed ``format("kafka2pc")`` write left open, as its next run would.

    ``options`` are the write's own (``kafka.bootstrap.servers`` and the
    ``kafka.*`` settings, and ``checkpointLocation`` for a streaming query or
    ``kafka2pc.runId`` and its ``kafka2pc.decisionPath`` for a batch run; a
    run on a ``local[*]`` session may omit the path).  What
    the last decision names is committed, everything else under the write's
    transactional ids is aborted; the :class:`SinkRecovery` counts both, as
    :meth:`KafkaTwoPhaseSink.recover` does.  Call it from any process, e.g.
    after a query failed (PySpark is not needed)::

        recover({"kafka.bootstrap.servers": "b:9092", "checkpointLocation": "/chk/q1"})

    Fails at once with :class:`~kafka2pc.BrokerUnavailableError` when no
    bootstrap address accepts a connection; otherwise bounded by the admin
    client's timeout (30 s) per request.
    """
    opts = Options.parse(options)
    if opts.run_id is None and opts.checkpoint is None and opts.decision_path is None:
        raise UsageError("recover() needs the write's checkpointLocation (streaming) or kafka2pc.runId (batch)")
    sink_id, directory = location(opts, streaming=opts.run_id is None)
    check_reachable(opts.config)
    with TransactionAdmin(dict(opts.config)) as admin:
        coordinator = SinkCoordinator(lambda: admin, sink_id, f"{opts.prefix}{sink_id}", LocalDecisionStore(directory))
        return coordinator.settle_leftovers()
