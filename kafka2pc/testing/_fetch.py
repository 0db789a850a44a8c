"""Kafka's jars from Maven Central, fetched once into the cache (one Maven at a time)."""

from __future__ import annotations

import fcntl
import logging
import shutil
import subprocess
import time
from pathlib import Path

from kafka2pc.testing._common import BrokerError, cache_dir

logger = logging.getLogger("kafka2pc.testing.broker")

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>kafka2pc</groupId><artifactId>kafka-classpath</artifactId><version>1</version>
  <dependencies>
{deps}
  </dependencies>
</project>
"""
_DEP = (
    "    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
    "<version>{v}</version></dependency>"
)

def _major(version: str) -> int:
    return int(version.split(".")[0])


def _minor(version: str) -> int:
    return int(version.split(".")[1])


KAFKA_TOOLS_VERSION = "4.3.1"
"""Newest release of Apache Kafka's command-line tools (``kafka-tools``) on Maven Central.

Maven Central has no ``kafka-tools`` for 4.4.0.  The tools are clients, so this
release talks to brokers of every line; kafka2pc itself never needs them (its
tests cross-check the CLI against ``TransactionsCommand``).
"""


def fetch_kafka(version: str) -> Path:
    """Download the Kafka ``version`` broker and its dependencies from Maven Central; return the libs dir.

    Only the broker (``kafka_2.13``) is fetched: the local broker needs no
    command-line tools (see :func:`fetch_kafka_tools`).  Idempotent: a complete
    download (marked by a ``.complete`` file) is reused.
    """
    deps = [("org.apache.kafka", "kafka_2.13", version)]
    if _major(version) >= 4:
        # 4.x logs through log4j2 but ships only the slf4j 1.x API: add its binding.
        deps.append(("org.apache.logging.log4j", "log4j-slf4j-impl", "2.25.4"))
    return _maven_fetch(cache_dir() / "maven" / version / "libs", deps, f"Kafka {version}")


def fetch_kafka_tools(version: str = KAFKA_TOOLS_VERSION) -> Path:
    """Download Apache Kafka's command-line tools (``kafka-tools``) ``version``; return the libs dir.

    For cross-checking against Kafka's own ``TransactionsCommand``; nothing in
    kafka2pc (the broker included) depends on it.
    """
    deps = [("org.apache.kafka", "kafka-tools", version)]
    return _maven_fetch(cache_dir() / "maven" / f"tools-{version}" / "libs", deps, f"kafka-tools {version}")


FETCH_LOCK_TIMEOUT_S = 900.0
"""How long a fetch waits for another process's Maven fetch before it gives up."""


def _maven_fetch(libs: Path, deps: list[tuple[str, str, str]], what: str) -> Path:
    if (libs / ".complete").exists():
        return libs
    if shutil.which("mvn") is None:
        raise BrokerError("Maven ('mvn') is needed to fetch Kafka jars: apt-get install maven")
    project = libs.parent
    project.mkdir(parents=True, exist_ok=True)
    # Two processes (two test runs, two checkouts sharing the cache) may fetch at once: one
    # Maven at a time (they share ~/.m2), and a second fetch of the same jars reuses the first's.
    lock_path = cache_dir() / "maven" / ".fetch.lock"
    with open(lock_path, "w") as lock:
        deadline = time.monotonic() + FETCH_LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BrokerError(
                        f"waited {FETCH_LOCK_TIMEOUT_S:.0f}s for another process's Maven fetch "
                        f"(it holds {lock_path}) before fetching {what}"
                    ) from None
                time.sleep(0.5)
        if (libs / ".complete").exists():
            return libs
        return _maven_fetch_locked(libs, deps, what)


def _maven_fetch_locked(libs: Path, deps: list[tuple[str, str, str]], what: str) -> Path:
    project = libs.parent
    (project / "pom.xml").write_text(
        _POM.format(deps="\n".join(_DEP.format(g=g, a=a, v=v) for g, a, v in deps))
    )
    logger.info("fetching %s from Maven Central into %s", what, libs)
    started = time.monotonic()
    proc = subprocess.run(
        ["mvn", "-q", "-B", "dependency:copy-dependencies", f"-DoutputDirectory={libs}"],
        cwd=project,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise BrokerError(
            f"Maven could not fetch {what}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    (libs / ".complete").write_text(f"{time.monotonic() - started:.1f}s\n")
    return libs
