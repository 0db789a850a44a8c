"""A failed ``up`` leaves no JVM behind, and ``down`` is bounded when the quorum is gone.

Real three-node KRaft clusters in a corner of this checkout's port block
(``port_base() + 1200`` and ``+ 1220``; one-node ones at ``+ 1240`` and ``+ 1250``: see ``harness.ports``), wiped afterwards.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kafka2pc.testing import broker
from kafka2pc.testing.broker import BrokerError, LocalKafka, port_base


def _jvms_of(kafka: LocalKafka) -> list[int]:
    """Pids of every process whose command line names this cluster's directory."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(kafka.home).encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


@pytest.fixture
def held_port() -> Iterator[socket.socket]:
    """A listening socket on node 3's broker port of the cluster at ``port_base() + 1200``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port_base() + 1204))
    sock.listen()
    yield sock
    sock.close()


def test_up_refuses_a_taken_port_before_starting_anything(held_port: socket.socket) -> None:
    kafka = LocalKafka(brokers=3, base_port=port_base() + 1200, name=f"lifecycle-taken-{port_base()}")
    started = time.monotonic()
    with pytest.raises(BrokerError, match=rf"\[{port_base() + 1204}\] of node 3 are taken"):
        kafka.start()
    assert time.monotonic() - started < 5
    assert _jvms_of(kafka) == []


def test_a_failed_up_stops_every_node_it_started(
    held_port: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The port is taken between the check and the JVM's bind (as an outgoing
    # connection may take it at any moment): node 3 exits, nodes 1 and 2 are up.
    monkeypatch.setattr(broker, "_port_free", lambda port: True)
    kafka = LocalKafka(brokers=3, base_port=port_base() + 1200, name=f"lifecycle-race-{port_base()}")
    launched: list[int] = []
    start_node = LocalKafka.start_node

    def recording_start_node(self: LocalKafka, node_id: int, *, wait: bool = True) -> None:
        start_node(self, node_id, wait=wait)
        launched.append(self._node(node_id).pid)

    monkeypatch.setattr(LocalKafka, "start_node", recording_start_node)
    try:
        with pytest.raises(BrokerError, match=r"node\(s\) \[3\] exited during start-up"):
            kafka.start(timeout=120)
        assert len(launched) == 3 and all(launched)
        assert not [pid for pid in launched if broker._pid_alive(pid)]
        assert _jvms_of(kafka) == []
        assert all(n.pid == 0 for n in kafka.nodes)
        node3 = (kafka.home / "node3" / "server.log").read_text() + (kafka.home / "node3" / "stdout.log").read_text()
        assert "Address already in use" in node3
    finally:
        kafka.wipe()


def test_down_is_bounded_when_the_quorum_is_gone() -> None:
    kafka = LocalKafka(brokers=3, base_port=port_base() + 1220)
    try:
        kafka.start(timeout=180)
        survivor = kafka.nodes[2].pid
        log = kafka.home / "node3" / "server.log"
        seen = log.stat().st_size
        kafka.stop_node(1, kill=True)
        kafka.stop_node(2, kill=True)
        _wait_for_log(log, seen, [f"Connection to node {n} " for n in (1, 2)], 60)  # node 3 noticed: its peers are gone
        assert broker._pid_alive(survivor)

        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "kafka2pc.testing.broker", "down", "--brokers", "3", "--port", str(kafka.base_port)],
            capture_output=True, text=True, timeout=120,
        )
        elapsed = time.monotonic() - started
        assert proc.returncode == 0, proc.stderr
        assert f"stopped {kafka.name}" in proc.stdout
        assert elapsed < broker.QUORUMLESS_GRACE_S + 30, elapsed
        assert not broker._pid_alive(survivor)
        assert _jvms_of(kafka) == []
    finally:
        kafka.wipe()


def test_up_formats_again_a_node_whose_storage_is_gone() -> None:
    """cluster.json kept, the data directory lost (a wipe that raced the dying JVM): ``up`` still starts it."""
    import shutil

    kafka = LocalKafka(base_port=port_base() + 1240, name=f"lifecycle-reformat-{port_base()}")
    again: LocalKafka | None = None
    try:
        kafka.start(timeout=180)
        kafka.stop(kill=True)
        shutil.rmtree(kafka.home / "node1" / "data")
        # The killed JVM's closing connections can hold its ports for a moment (seen in CI).
        ports = [kafka.nodes[0].port, kafka.nodes[0].controller_port]
        deadline = time.monotonic() + 60
        while not all(broker._port_free(p) for p in ports) and time.monotonic() < deadline:
            time.sleep(0.2)
        again = LocalKafka.up(base_port=port_base() + 1240, name=f"lifecycle-reformat-{port_base()}")
        assert again.cluster_id == kafka.cluster_id and again.running()
        assert (again.home / "node1" / "data" / "meta.properties").exists()
    finally:
        (again or kafka).wipe()
        assert _jvms_of(kafka) == []


def test_down_all_only_touches_this_port_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Other checkouts share the cache directory (and its run/ states) but not the block.
    monkeypatch.setenv("KAFKA2PC_CACHE", str(tmp_path))
    mine = LocalKafka(base_port=port_base() + 92, name="mine")
    theirs = LocalKafka(base_port=port_base() + 2092 if port_base() + 4000 < 32768 else port_base() - 1908, name="theirs")
    for cluster in (mine, theirs):
        cluster._save()
    assert [c.name for c in broker._all_clusters()] == ["mine"]


def test_wipe_all_deletes_the_data_of_this_port_block_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``wipe --all`` (scripts/test.sh, before the suite and before its quiet tests): fresh brokers in this block."""
    monkeypatch.setenv("KAFKA2PC_CACHE", str(tmp_path))
    mine = LocalKafka(base_port=port_base() + 92, name="mine")
    theirs = LocalKafka(base_port=port_base() + 2092 if port_base() + 4000 < 32768 else port_base() - 1908, name="theirs")
    for cluster in (mine, theirs):
        cluster._save()
        (cluster.home / "node1" / "data").mkdir(parents=True)
        (cluster.home / "node1" / "data" / "segment.log").write_bytes(b"x" * 1024)
    assert broker.main(["wipe", "--all"]) == 0
    assert capsys.readouterr().out.splitlines() == ["wiped mine"]
    assert not mine.home.exists() and (theirs.home / "node1" / "data" / "segment.log").exists()
    assert [c.name for c in broker._all_clusters()] == []


def test_a_start_that_does_not_serve_in_time_is_killed_and_tried_once_more(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A start starved of CPU (here: a bound no JVM can meet) is killed, reported with its log's tail, and retried."""
    name = f"lifecycle-retry-{port_base()}"
    wait_ready = LocalKafka.wait_ready
    failures: list[BrokerError] = []
    launched: list[int] = []
    start_node = LocalKafka.start_node

    def recording_start_node(self: LocalKafka, node_id: int, *, wait: bool = True) -> None:
        start_node(self, node_id, wait=wait)
        launched.append(self._node(node_id).pid)

    def impatient_once(self: LocalKafka, *, timeout: float = 120.0) -> None:
        if not failures:
            try:
                wait_ready(self, timeout=0.3)  # no JVM serves within 0.3 s of its launch
            except BrokerError as exc:
                failures.append(exc)
                raise
        wait_ready(self, timeout=timeout)

    monkeypatch.setattr(LocalKafka, "start_node", recording_start_node)
    monkeypatch.setattr(LocalKafka, "wait_ready", impatient_once)
    kafka: LocalKafka | None = None
    try:
        with caplog.at_level("WARNING", logger="kafka2pc.testing.broker"):
            kafka = LocalKafka.up(base_port=port_base() + 1250, name=name)
        assert len(failures) == 1 and "not ready after" in str(failures[0])
        assert "do not answer an ApiVersions request" in str(failures[0]) and "which ends:" in str(failures[0])
        assert [r.getMessage() for r in caplog.records if "starting it once more" in r.getMessage()], caplog.text
        assert len(launched) == 2 and not broker._pid_alive(launched[0])
        assert kafka.running() and kafka.nodes[0].pid == launched[1]
    finally:
        (kafka or LocalKafka(base_port=port_base() + 1250, name=name)).wipe()
    assert _jvms_of(LocalKafka(base_port=port_base() + 1250, name=name)) == []


def _wait_for_log(log: Path, offset: int, needles: list[str], timeout: float) -> None:
    """Wait until every one of ``needles`` appears in ``log`` after byte ``offset`` (fail after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        missing = [needle for needle in needles if needle not in text]
        if not missing:
            return
        assert time.monotonic() < deadline, f"{log} did not say {missing} in {timeout} s:\n{text[-3000:]}"
        time.sleep(0.1)
