"""Import kafka-python without its import-time DeprecationWarning.

kafka-python 3.0 builds its protocol classes at import time from JSON schemas
read with ``importlib.resources.read_text``, deprecated since Python 3.11.  An
application whose tests run with ``-W error::DeprecationWarning`` (or pytest's
``filterwarnings = error``) would see ``import kafka2pc``'s control plane fail
on a warning it cannot act on.  Every kafka2pc module that imports kafka-python
imports it from here: this module imports kafka-python and every protocol module
under the warning filter once, so later imports are cached and silent.  Only
that one deprecation is silenced, only during these imports.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*(read_text|open_text) is deprecated")
    import kafka
    import kafka.admin
    import kafka.errors as kafka_errors
    import kafka.protocol

    for _module in pkgutil.walk_packages(kafka.protocol.__path__, "kafka.protocol."):
        importlib.import_module(_module.name)

__all__ = ["kafka", "kafka_errors"]
