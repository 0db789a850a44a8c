"""Optional dependencies live behind extras; a missing one is named in the error.

``pip install kafka2pc`` brings only what the core needs (confluent-kafka and
kafka-python).  The recipes and the CLI need more, each behind an extra:

- ``kafka2pc.cli`` (the ``kafka2pc`` command): click, ``kafka2pc[cli]``;
- ``kafka2pc.recipes.dual_write`` and the CLI's ``in-doubt``/``recover``:
  SQLAlchemy, ``kafka2pc[sql]``; PostgreSQL URLs also need psycopg,
  ``kafka2pc[postgres]``;
- ``kafka2pc.recipes.spark_sink``: PySpark with pyarrow, ``kafka2pc[spark]``;
- the OpenTelemetry integration: ``kafka2pc[otel]``.

At each such import point::

    try:
        import click
    except ImportError as exc:
        raise missing_extra(exc, extra="cli", feature="the kafka2pc command line") from exc
"""

from __future__ import annotations

__all__ = ["MissingExtraError", "missing_extra"]


class MissingExtraError(ImportError):
    """A kafka2pc feature needs an optional dependency that is not installed.

    The message names the extra that installs it, e.g.
    ``pip install 'kafka2pc[cli]'``.  An :class:`ImportError`, so code that
    probes for optional features with ``except ImportError`` keeps working.
    """


def missing_extra(exc: ImportError, *, extra: str, feature: str) -> ImportError:
    """The error to raise when importing a dependency of ``feature`` failed with ``exc``.

    Returns :class:`MissingExtraError` naming ``kafka2pc[extra]`` when the
    module that is missing is a third-party one, and ``exc`` itself otherwise
    (an ImportError from kafka2pc's own code is a bug, not a missing extra).
    """
    missing = exc.name or "?"
    if missing.split(".")[0] == "kafka2pc":
        return exc
    return MissingExtraError(
        f"{feature} needs the optional dependency {missing!r}, which is not installed: "
        f"pip install 'kafka2pc[{extra}]'",
        name=missing,
    )
