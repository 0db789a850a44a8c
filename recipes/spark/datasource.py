"""Deprecated: import from :mod:`kafka2pc.recipes.spark` (``register_data_source``, ``recover``).

kafka2pc 2.0 removes this module.  ``Kafka2pcDataSource`` stays importable
here until then; ``register_data_source`` registers it.
"""

from __future__ import annotations

import warnings

from ._datasource import Kafka2pcDataSource, register_data_source
from ._options import recover

warnings.warn(
    "kafka2pc.recipes.spark.datasource is deprecated: import register_data_source and recover from "
    "kafka2pc.recipes.spark",
    DeprecationWarning, stacklevel=2,
)

__all__ = ["Kafka2pcDataSource", "recover", "register_data_source"]
