"""A local broker node's files: its ``server.properties``, its log configuration, its cluster id."""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from pathlib import Path

_LOG4J2 = """Configuration:
  Appenders:
    File:
      name: FILE
      fileName: "{log}"
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
  Loggers:
    Root:
      level: INFO
      AppenderRef:
        - ref: FILE
"""

_LOG4J1 = """log4j.rootLogger=INFO, FILE
log4j.appender.FILE=org.apache.log4j.FileAppender
log4j.appender.FILE.File={log}
log4j.appender.FILE.layout=org.apache.log4j.PatternLayout
log4j.appender.FILE.layout.ConversionPattern=[%d] %p %m (%c)%n
"""


@dataclass
class _Node:
    node_id: int
    port: int
    controller_port: int
    pid: int = 0


def write_node_files(ndir: Path, props: dict[str, str]) -> None:
    """Write ``server.properties`` and both log configurations (Log4j 2 and 1, by Kafka line) into ``ndir``.

    The node logs to ``ndir/server.log``.
    """
    (ndir / "server.properties").write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    log = ndir / "server.log"
    (ndir / "log4j2.yaml").write_text(_LOG4J2.format(log=log))
    (ndir / "log4j.properties").write_text(_LOG4J1.format(log=log))


def random_cluster_id() -> str:
    """A KRaft cluster id: a base64url-encoded UUID (no JVM needed to make one).

    Like Kafka's ``Uuid.randomUuid()``, never one that starts with ``-``: the
    storage tool's argument parser would read it as an option (1 in 64 ids).
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id
