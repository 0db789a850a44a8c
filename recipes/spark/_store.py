"""Durable, append-only storage of the sink's decisions (the commit point of each micro-batch).

Only the driver reads and writes decisions.  They live with the query's
checkpoint: local files (:class:`LocalDecisionStore`) or any Hadoop-compatible
file system through Spark's JVM (:class:`HadoopDecisionStore`); see
``docs/spark.md`` for what each storage must guarantee.
"""

from __future__ import annotations

import os
import re
import uuid
from abc import abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

from ._session import jvm
from ._values import SinkDecision

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_DECISION_FILE_RE: Final = re.compile(r"(\d{1,19})\.(\d{1,6})\.json")


@runtime_checkable
class DecisionStore(Protocol):
    """Durable, append-only storage of :class:`SinkDecision` objects, one file per batch revision.

    ``put`` must be atomic (a reader sees the whole decision or none of it),
    durable before it returns, and must never replace an existing decision.

    The extension point for other storage, as a protocol with default
    methods: a store subclasses it (as :class:`LocalDecisionStore` and
    :class:`HadoopDecisionStore` do), gives the four file operations and
    :attr:`location`, and inherits ``put``, ``get``, ``latest`` and ``purge``.
    """

    @classmethod
    def __subclasshook__(cls, other: type) -> Any:
        # issubclass() answers by inheritance (as for 1.0's ABC): a protocol with a
        # property cannot be checked structurally, and would raise TypeError.
        return NotImplemented

    @abstractmethod
    def _names(self) -> list[str]:
        """File names in the store directory (empty if it does not exist)."""

    @abstractmethod
    def _read(self, name: str) -> bytes:
        """Content of one file."""

    @abstractmethod
    def _create(self, name: str, data: bytes) -> None:
        """Atomically create ``name`` with ``data``; raise ``FileExistsError`` if it exists."""

    @abstractmethod
    def _delete(self, name: str) -> None:
        """Delete one file (no error if missing)."""

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the decisions live (for messages)."""

    def _index(self) -> dict[int, int]:
        latest: dict[int, int] = {}
        for name in self._names():
            match = _DECISION_FILE_RE.fullmatch(name)
            if match:
                batch, rev = int(match.group(1)), int(match.group(2))
                latest[batch] = max(rev, latest.get(batch, -1))
        return latest

    @staticmethod
    def _name(batch_id: int, revision: int) -> str:
        return f"{batch_id:019d}.{revision:06d}.json"

    def put(self, decision: SinkDecision) -> None:
        """Write ``decision`` durably; ``FileExistsError`` if that batch revision exists."""
        self._create(self._name(decision.batch_id, decision.revision), decision.to_json())

    def get(self, batch_id: int) -> SinkDecision | None:
        """The decision (highest revision) for ``batch_id``, or ``None``."""
        revision = self._index().get(batch_id)
        if revision is None:
            return None
        return SinkDecision.from_json(self._read(self._name(batch_id, revision)))

    def latest(self) -> SinkDecision | None:
        """The decision of the highest batch id, or ``None``."""
        index = self._index()
        if not index:
            return None
        batch_id = max(index)
        return SinkDecision.from_json(self._read(self._name(batch_id, index[batch_id])))

    def purge(self, keep_from_batch: int) -> int:
        """Delete decisions of batches below ``keep_from_batch``; return how many files went."""
        gone = 0
        for name in self._names():
            match = _DECISION_FILE_RE.fullmatch(name)
            if match and int(match.group(1)) < keep_from_batch:
                self._delete(name)
                gone += 1
        return gone


class LocalDecisionStore(DecisionStore):
    """Decisions as files in a local directory: write a temp file, fsync, hard-link into place, fsync the directory.

    ``os.link`` fails if the target exists, so a decision is never replaced,
    and the file appears whole or not at all.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._dir = Path(directory)

    @property
    def location(self) -> str:
        return str(self._dir)

    def _names(self) -> list[str]:
        try:
            return os.listdir(self._dir)
        except FileNotFoundError:
            return []

    def _read(self, name: str) -> bytes:
        return (self._dir / name).read_bytes()

    def _create(self, name: str, data: bytes) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        tmp = self._dir / f".{name}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, self._dir / name)
        finally:
            os.unlink(tmp)
        dir_fd = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _delete(self, name: str) -> None:
        try:
            os.unlink(self._dir / name)
        except FileNotFoundError:
            pass


class HadoopDecisionStore(DecisionStore):
    """Decisions on any Hadoop-compatible file system (HDFS, S3A, ABFS, GCS), through Spark's JVM.

    Writes a temp file with ``hsync`` then renames it into place; a rename
    onto an existing name fails, so a decision is never replaced.  Use a file
    system whose rename is atomic (HDFS, ABFS) or whose new objects appear
    whole (S3 since 2020, GCS): see ``docs/spark.md``.
    """

    def __init__(self, spark: SparkSession, uri: str) -> None:
        gateway = jvm(spark)
        self._jvm = gateway
        self._dir = gateway.org.apache.hadoop.fs.Path(uri)
        self._fs = self._dir.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        self._uri = str(self._fs.makeQualified(self._dir).toString())

    @property
    def location(self) -> str:
        return self._uri

    def _path(self, name: str) -> Any:
        return self._jvm.org.apache.hadoop.fs.Path(self._dir, name)

    def _names(self) -> list[str]:
        if not self._fs.exists(self._dir):
            return []
        return [str(status.getPath().getName()) for status in self._fs.listStatus(self._dir)]

    def _read(self, name: str) -> bytes:
        stream = self._fs.open(self._path(name))
        try:
            return bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
        finally:
            stream.close()

    def _create(self, name: str, data: bytes) -> None:
        self._fs.mkdirs(self._dir)
        target = self._path(name)
        if self._fs.exists(target):
            raise FileExistsError(f"{self._uri}/{name}")
        tmp = self._path(f".{name}.{uuid.uuid4().hex}.tmp")
        out = self._fs.create(tmp, False)
        try:
            out.write(bytearray(data))
            out.hsync()
        finally:
            out.close()
        if not self._fs.rename(tmp, target):
            self._fs.delete(tmp, False)
            raise FileExistsError(f"{self._uri}/{name} (rename refused)")

    def _delete(self, name: str) -> None:
        self._fs.delete(self._path(name), False)
