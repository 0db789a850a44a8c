"""Deprecated: import from :mod:`kafka2pc.recipes.spark` (kafka2pc 2.0 removes this module).

It re-exports exactly the package's public names.
"""

from __future__ import annotations

import warnings

from . import spark as _spark
from .spark import *  # noqa: F403 - the package's public names, listed in its __all__

warnings.warn(
    "kafka2pc.recipes.spark_sink is deprecated: import from kafka2pc.recipes.spark (the same names)",
    DeprecationWarning, stacklevel=2,
)

__all__ = list(_spark.__all__)


def __getattr__(name: str) -> object:
    return getattr(_spark, name)  # the package's deprecated names (they warn there)
