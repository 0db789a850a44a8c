"""A real Apache Kafka broker (KRaft) on loopback, without Docker.

Run it from a shell::

    python -m kafka2pc.testing.broker up        # prints the bootstrap servers last
    python -m kafka2pc.testing.broker status
    python -m kafka2pc.testing.broker down
    python -m kafka2pc.testing.broker wipe --all # every cluster of this port block, stopped, its data deleted

``up`` fetches ``org.apache.kafka:kafka_2.13:<version>`` and its dependencies
from Maven Central with Maven into a cache directory (``$KAFKA2PC_CACHE``,
default ``~/.cache/kafka2pc``), formats KRaft storage, starts a combined
broker+controller with ``transaction.two.phase.commit.enable=true`` and waits
until it serves requests.  A broker already running under the same name is
reused.  ``--brokers 3`` starts a three-node KRaft cluster (for coordinator
fail-over tests).  The version defaults to :data:`DEFAULT_KAFKA_VERSION` and
can be overridden with ``$KAFKA_VERSION`` or ``--version``.

The same operations are available from Python as :class:`LocalKafka`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kafka2pc.testing._common import BrokerError, cache_dir
from kafka2pc.testing._fetch import KAFKA_TOOLS_VERSION, _major, _minor, fetch_kafka, fetch_kafka_tools
from kafka2pc.testing._node import _Node, random_cluster_id, write_node_files
from kafka2pc.testing._ports import (
    _answers_kafka,
    _port_free,
    port_base,
    worker_port_base,
)
from kafka2pc.testing._process import _java, _pid_alive, _signal, _wait_dead, log_tail
from kafka2pc.testing._settings import (
    BROKER_JAVA_OPTIONS,
    DEFAULT_KAFKA_VERSION,
    FORMAT_JAVA_OPTIONS,
    TEST_BROKER_SETTINGS,
    broker_settings,
)

__all__ = [
    "DEFAULT_KAFKA_VERSION",
    "KAFKA_TOOLS_VERSION",
    "BrokerError",
    "LocalKafka",
    "cache_dir",
    "fetch_kafka",
    "fetch_kafka_tools",
    "port_base",
    "worker_port_base",
]

logger = logging.getLogger(__name__)

def _default_base_port(version: str, brokers: int) -> int:
    """First listener port of a cluster of ``version``: one fixed slot per line, inside the block.

    The default version takes ``+92`` (one node) / ``+192`` (three), the 3.x line
    ``+1092`` / ``+1192`` and other 4.x+ releases ``+1300 + 20 * minor`` (``+10``
    for three nodes), so the lines CI runs side by side never share a port.
    """
    if _major(version) < 4:
        offset = 1092 if brokers == 1 else 1192
    elif version == DEFAULT_KAFKA_VERSION:
        offset = 92 if brokers == 1 else 192
    else:
        offset = 1300 + 20 * (_minor(version) % 10) + (0 if brokers == 1 else 10)
    return port_base() + offset


QUORUMLESS_GRACE_S = 5.0
"""How long ``stop`` lets a node without a controller quorum shut down cleanly before SIGKILL.

A KRaft node asked to stop (SIGTERM) first asks the active controller for a
controlled shutdown.  With a majority of the voters gone there is no controller
to answer, and the JVM waits indefinitely, so a short grace replaces the normal one.
"""


class _NotReadyError(BrokerError):
    """Every node's JVM runs, but the cluster did not serve requests within the start's bound."""


@dataclass
class LocalKafka:
    """A local KRaft cluster of ``brokers`` combined broker/controller nodes on loopback.

    Example::

        kafka = LocalKafka.up()          # or LocalKafka(version="3.9.2", brokers=3).start()
        print(kafka.bootstrap_servers)
        kafka.stop()
    """

    version: str = field(default_factory=lambda: os.environ.get("KAFKA_VERSION", DEFAULT_KAFKA_VERSION))
    brokers: int = 1
    base_port: int = 0
    name: str = ""
    nodes: list[_Node] = field(default_factory=list)
    cluster_id: str = ""
    extra_settings: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_port:
            self.base_port = _default_base_port(self.version, self.brokers)
        if not self.name:
            self.name = f"kafka-{self.version}-{self.brokers}n-{self.base_port}"
        if not self.nodes:
            self.nodes = [
                _Node(i + 1, self.base_port + 2 * i, self.base_port + 2 * i + 1)
                for i in range(self.brokers)
            ]

    # -- paths -------------------------------------------------------------
    @property
    def home(self) -> Path:
        """Directory holding this cluster's data, configs and logs."""
        return cache_dir() / "run" / self.name

    def log_file(self, node_id: int = 1) -> Path:
        """The broker log of node ``node_id``."""
        return self.home / f"node{node_id}" / "server.log"

    @property
    def bootstrap_servers(self) -> str:
        """``host:port,...`` of every node."""
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    # -- lifecycle ---------------------------------------------------------
    @classmethod
    def up(cls, **kwargs: object) -> LocalKafka:
        """Start (or reuse) a cluster and return it once it serves requests.

        A start whose nodes run but do not serve requests within its bound (120 s) is killed and tried once
        more, from the same storage; :class:`BrokerError` if that fails too.
        """
        kafka = cls(**kwargs)  # type: ignore[arg-type]
        existing = kafka._load()
        if existing is not None and existing.running():
            existing.wait_ready(timeout=60)
            return existing
        # A stopped cluster keeps its data and cluster id: restart it as it was.
        try:
            return (existing or kafka).start()
        except _NotReadyError as exc:  # a start starved of CPU on a loaded machine: its nodes were killed
            logger.warning("%s: %s; starting it once more", kafka.name, str(exc).splitlines()[0])
            again = kafka._load() or kafka
            deadline = time.monotonic() + 30  # the killed JVMs' closing connections can hold their ports a moment
            while time.monotonic() < deadline and not all(
                _port_free(p) for n in again.nodes for p in (n.port, n.controller_port)
            ):
                time.sleep(0.2)
            return again.start()

    def start(self, *, timeout: float = 120.0) -> LocalKafka:
        """Fetch jars if needed, format storage on first use, start every node, wait until ready.

        All or nothing: if any node cannot start (a port taken, a JVM that exits,
        not ready within ``timeout``), every node of the cluster is killed before
        :class:`BrokerError` is raised, so a failed start leaves no JVM behind.
        """
        libs = fetch_kafka(self.version)
        stopped = [n for n in self.nodes if not (n.pid and _pid_alive(n.pid))]
        for node in stopped:
            taken = [p for p in (node.port, node.controller_port) if not _port_free(p)]
            if taken:
                raise BrokerError(
                    f"port(s) {taken} of node {node.node_id} are taken by another process; "
                    "move the block with $KAFKA2PC_PORT_BASE or choose --port"
                )
        fresh = not self.cluster_id
        if fresh:
            self.cluster_id = random_cluster_id()
            if self.home.exists():
                shutil.rmtree(self.home)
        try:
            for node in self.nodes:
                self._write_config(node)
                # A node whose storage is gone (a wipe that raced the dying JVM, a deleted data
                # directory) is formatted again: Kafka refuses to start without meta.properties.
                if fresh or not (self.home / f"node{node.node_id}" / "data" / "meta.properties").exists():
                    self._format(libs, node)
            for node in stopped:
                self.start_node(node.node_id, wait=False)
            self.wait_ready(timeout=timeout)
        except BaseException:
            started = [n.pid for n in self.nodes if n.pid]
            logger.warning("Kafka %s did not start: killing its nodes (pids %s)", self.name, started)
            self.stop(kill=True)
            raise
        return self

    def start_node(self, node_id: int, *, wait: bool = True) -> None:
        """(Re)start one node of an already formatted cluster."""
        node = self._node(node_id)
        if node.pid and _pid_alive(node.pid):
            return
        libs = fetch_kafka(self.version)
        ndir = self.home / f"node{node.node_id}"
        log_opt = (
            f"-Dlog4j2.configurationFile={ndir / 'log4j2.yaml'}"
            if _major(self.version) >= 4
            else f"-Dlog4j.configuration=file:{ndir / 'log4j.properties'}"
        )
        cmd = [
            _java(),
            *BROKER_JAVA_OPTIONS,
            "-Djava.awt.headless=true",
            log_opt,
            "-cp",
            f"{libs}/*",
            "kafka.Kafka",
            str(ndir / "server.properties"),
        ]
        with open(ndir / "stdout.log", "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        node.pid = proc.pid
        self._save()
        logger.info("started Kafka %s node %d (pid %d)", self.version, node_id, proc.pid)
        if wait:
            self.wait_ready(timeout=120)

    def stop_node(self, node_id: int, *, kill: bool = False, timeout: float = 60.0) -> None:
        """Stop one node: SIGTERM (clean shutdown, SIGKILL after ``timeout``) or, with ``kill=True``, SIGKILL.

        A node left without a controller quorum gets :data:`QUORUMLESS_GRACE_S`
        instead of ``timeout`` (its clean shutdown cannot finish).
        """
        self._terminate([self._node(node_id)], kill=kill, timeout=timeout)

    def stop(self, *, kill: bool = False, timeout: float = 60.0) -> None:
        """Stop every node (data is kept; ``up`` reuses it); bounded even when the quorum is gone.

        All nodes get SIGTERM at once, so a multi-node cluster does not lose its
        controller quorum half-way through a clean shutdown.  Nodes still alive
        after ``timeout`` (or after :data:`QUORUMLESS_GRACE_S` when a majority of
        the nodes is already down) get SIGKILL.  ``kill=True`` sends SIGKILL at once.
        """
        self._terminate(self.nodes, kill=kill, timeout=timeout)

    def _terminate(self, nodes: Sequence[_Node], *, kill: bool, timeout: float) -> None:
        alive = [n for n in nodes if n.pid and _pid_alive(n.pid)]
        if not kill and alive and self._quorum_gone():
            logger.info("%s: no controller quorum left; %.0fs for a clean shutdown", self.name, QUORUMLESS_GRACE_S)
            timeout = min(timeout, QUORUMLESS_GRACE_S)
        for node in alive:
            _signal(node.pid, signal.SIGKILL if kill else signal.SIGTERM)
        if not kill and not _wait_dead([n.pid for n in alive], timeout):
            stragglers = [n for n in alive if _pid_alive(n.pid)]
            logger.warning(
                "%s: node(s) %s still running %.0fs after SIGTERM: SIGKILL",
                self.name, [n.node_id for n in stragglers], timeout,
            )
            for node in stragglers:
                _signal(node.pid, signal.SIGKILL)
        if not _wait_dead([n.pid for n in alive], 30.0):
            raise BrokerError(f"{self.name}: pids {[n.pid for n in alive if _pid_alive(n.pid)]} survive SIGKILL")
        for node in nodes:
            node.pid = 0
        self._save()

    def _quorum_gone(self) -> bool:
        """True when a clean shutdown cannot reach an active controller.

        Every node is a voter; a quorum needs a strict majority of them alive
        (nodes stopped together still count: they shut down in parallel).
        """
        if len(self.nodes) == 1:
            return False
        voters_alive = sum(1 for n in self.nodes if n.pid and _pid_alive(n.pid))
        return voters_alive <= len(self.nodes) // 2

    def wipe(self) -> None:
        """Stop every node and delete the cluster's data."""
        self.stop(kill=True)
        shutil.rmtree(self.home, ignore_errors=True)

    def running(self) -> bool:
        """True when every node's process is alive."""
        return all(n.pid and _pid_alive(n.pid) for n in self.nodes)

    def wait_ready(self, *, timeout: float = 120.0) -> None:
        """Block until every node answers metadata requests and reports all brokers."""
        from confluent_kafka.admin import AdminClient

        from kafka2pc._logging import with_librdkafka_logger

        deadline = time.monotonic() + timeout
        last_error: object = None
        while time.monotonic() < deadline:
            dead = [n.node_id for n in self.nodes if not (n.pid and _pid_alive(n.pid))]
            if dead:
                raise BrokerError(
                    f"Kafka node(s) {dead} exited during start-up; see {self.log_file(dead[0])} "
                    f"and {self.home / f'node{dead[0]}' / 'stdout.log'}"
                )
            silent = [n.port for n in self.nodes if not _answers_kafka(n.port, timeout=2.0)]
            if silent:
                last_error = f"port(s) {silent} do not answer an ApiVersions request"
            else:
                try:
                    admin = AdminClient(with_librdkafka_logger({"bootstrap.servers": self.bootstrap_servers}))
                    md = admin.list_topics(timeout=5)
                    if len(md.brokers) == len(self.nodes) and md.controller_id >= 0:
                        return
                    last_error = f"{len(md.brokers)} of {len(self.nodes)} brokers registered"
                except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
                    last_error = exc
            time.sleep(0.3)
        tail = log_tail(self.log_file()).replace("\n", "\n  ")
        raise _NotReadyError(
            f"Kafka at {self.bootstrap_servers} not ready after {timeout:.0f}s ({last_error}); "
            f"see {self.log_file()}, which ends:\n  {tail}"
        )

    def status(self) -> dict[str, object]:
        """A JSON-able summary: version, bootstrap servers, per-node pid and liveness."""
        return {
            "name": self.name,
            "version": self.version,
            "bootstrap_servers": self.bootstrap_servers,
            "nodes": [
                {"node_id": n.node_id, "port": n.port, "pid": n.pid,
                 "alive": bool(n.pid and _pid_alive(n.pid)), "log": str(self.log_file(n.node_id))}
                for n in self.nodes
            ],
        }

    # -- internals ---------------------------------------------------------
    def _node(self, node_id: int) -> _Node:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise BrokerError(f"no node {node_id} in {self.name}")

    def _state_file(self) -> Path:
        return self.home / "cluster.json"

    def _save(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self._state_file().write_text(json.dumps(asdict(self), indent=2))

    def _load(self) -> LocalKafka | None:
        return _read_state(self._state_file())

    def _write_config(self, node: _Node) -> None:
        ndir = self.home / f"node{node.node_id}"
        ndir.mkdir(parents=True, exist_ok=True)
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{node.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(ndir / "data"),
            "log.flush.interval.messages": "9223372036854775807",
            **broker_settings(self.version, len(self.nodes)),
            **TEST_BROKER_SETTINGS,
            **self.extra_settings,
        }
        write_node_files(ndir, props)

    def _format(self, libs: Path, node: _Node) -> None:
        ndir = self.home / f"node{node.node_id}"
        proc = subprocess.run(
            [_java(), *FORMAT_JAVA_OPTIONS, "-cp", f"{libs}/*", "kafka.tools.StorageTool", "format",
             f"--cluster-id={self.cluster_id}", "-c", str(ndir / "server.properties"), "--ignore-formatted"],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise BrokerError(f"formatting KRaft storage failed:\n{proc.stdout}{proc.stderr}")
        self._save()


def _read_state(path: Path) -> LocalKafka | None:
    """The cluster a ``cluster.json`` describes; ``None`` when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    data["nodes"] = [_Node(**n) for n in data["nodes"]]
    return LocalKafka(**data)


def _all_clusters() -> list[LocalKafka]:
    """Every local cluster whose ports lie in this process's block (see :func:`port_base`).

    Checkouts with another ``$KAFKA2PC_PORT_BASE`` share the cache directory but
    not the block: their clusters are left alone.
    """
    low = port_base()
    clusters = []
    for state in sorted((cache_dir() / "run").glob("*/cluster.json")):
        cluster = _read_state(state)
        ports = [] if cluster is None else [p for n in cluster.nodes for p in (n.port, n.controller_port)]
        if cluster is not None and all(low <= port < low + 2000 for port in ports):
            clusters.append(cluster)
    return clusters


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m kafka2pc.testing.broker``."""
    parser = argparse.ArgumentParser(prog="python -m kafka2pc.testing.broker", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "wipe"])
    parser.add_argument("--version", default=os.environ.get("KAFKA_VERSION", DEFAULT_KAFKA_VERSION))
    parser.add_argument("--brokers", type=int, default=1, help="number of KRaft nodes (1 or 3)")
    parser.add_argument("--port", type=int, default=0, help="first listener port")
    parser.add_argument(
        "--all",
        action="store_true",
        help="with down or wipe: every local cluster in this port block ($KAFKA2PC_PORT_BASE)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    kafka = LocalKafka(version=args.version, brokers=args.brokers, base_port=args.port)
    loaded = kafka._load() or kafka
    try:
        if args.command == "up":
            started = time.monotonic()
            kafka = LocalKafka.up(version=args.version, brokers=args.brokers, base_port=args.port)
            print(f"Kafka {kafka.version} ready in {time.monotonic() - started:.1f}s; "
                  f"logs: {kafka.log_file()}", file=sys.stderr)
            print(kafka.bootstrap_servers)
        elif args.command == "down":
            for cluster in _all_clusters() if args.all else [loaded]:
                cluster.stop()
                print(f"stopped {cluster.name}")
        elif args.command == "wipe":
            for cluster in _all_clusters() if args.all else [loaded]:
                cluster.wipe()
                print(f"wiped {cluster.name}")
        else:
            print(json.dumps(loaded.status(), indent=2))
            return 0 if loaded.running() else 3
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
