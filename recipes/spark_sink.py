"""Exactly-once Kafka sink for Spark Structured Streaming (the names of :mod:`kafka2pc.recipes.spark`).

Kept so that ``from kafka2pc.recipes.spark_sink import KafkaTwoPhaseSink`` works;
the implementation lives in the :mod:`kafka2pc.recipes.spark` package, and this
module re-exports exactly its public names.
"""

from __future__ import annotations

from . import spark as _spark
from .spark import *  # noqa: F403 - the package's public names, listed in its __all__
from .spark._executor import WriterSpec as _WriterSpec  # noqa: F401 - its name before the package

__all__ = list(_spark.__all__)
