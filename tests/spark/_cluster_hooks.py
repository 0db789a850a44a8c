"""Task hooks for the standalone-cluster tests (pickled to the executors, imported there by module name).

The executors find this module through ``spark.executorEnv.PYTHONPATH``
(tests/spark), set by ``_spark_driver.py``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from kafka2pc.recipes.spark._executor import TaskPoint


@dataclass(frozen=True)
class BlockAt:
    """The first attempt of ``partition`` in ``batch`` to reach ``step`` writes ``"<pid> <attempt>"`` to
    ``marker`` and blocks (to be killed); later attempts pass.

    The first to arrive, not attempt 0: on a loaded machine Spark may speculate the task, and the copy
    that wins has attempt 0 killed before it gets there.  An exclusive create of ``<marker>.claim``
    decides (the Workers share this machine's file system).
    """

    step: str
    batch: int
    partition: int
    marker: str

    def __call__(self, point: TaskPoint) -> None:
        if (point.step.value, point.spec.batch_id, point.partition) != (self.step, self.batch, self.partition):
            return
        try:
            os.close(os.open(self.marker + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another attempt blocked here; this one is its retry or a copy
        parent = os.getppid()
        tmp = Path(self.marker + ".tmp")
        tmp.write_text(f"{os.getpid()} {point.attempt}")
        tmp.rename(self.marker)
        deadline = time.monotonic() + 600
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.2)  # until the test kills the executor (the PySpark daemon goes with it)
        os._exit(1)


@dataclass(frozen=True)
class SlowAt:
    """Attempt 0 of ``partition`` in ``batch`` sleeps ``seconds`` right after opening its transaction."""

    batch: int
    partition: int
    seconds: float

    def __call__(self, point: TaskPoint) -> None:
        if point.step.value == "opened" and (point.spec.batch_id, point.partition, point.attempt) == (
            self.batch, self.partition, 0
        ):
            time.sleep(self.seconds)


@dataclass(frozen=True)
class Chain:
    """Every hook of ``hooks``, in order, at each point."""

    hooks: tuple[object, ...]

    def __call__(self, point: TaskPoint) -> None:
        for hook in self.hooks:
            hook(point)  # type: ignore[operator]
