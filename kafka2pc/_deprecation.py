"""Deprecated 0.1 names: each still works for one minor release and warns, naming its replacement.

:data:`RENAMED_ARGUMENTS` lists every deprecated keyword argument that is still
in a public signature, as ``(qualified callable, old name, new name)``: the
conventions test (``tests/unit/test_api_conventions.py``) exempts exactly these
from its rules and checks that each one warns.  Renamed public names (classes,
functions) warn on access through the module's ``__getattr__``.
"""

from __future__ import annotations

import warnings
from typing import TypeVar

_T = TypeVar("_T")

__all__ = ["RENAMED_ARGUMENTS", "REMOVAL", "renamed", "renamed_argument", "seconds_from_ms"]

REMOVAL = "kafka2pc 1.1"
"""The release that removes the deprecated names."""

RENAMED_ARGUMENTS: tuple[tuple[str, str, str], ...] = (
    ("kafka2pc.TransactionAdmin.list_transactions", "min_open_ms", "min_open_s"),
    ("kafka2pc.TransactionAdmin.find_hanging_transactions", "max_transaction_timeout_ms", "max_transaction_timeout_s"),
    ("kafka2pc.aio.AsyncTransactionAdmin.list_transactions", "min_open_ms", "min_open_s"),
    ("kafka2pc.aio.AsyncTransactionAdmin.find_hanging_transactions", "max_transaction_timeout_ms",
     "max_transaction_timeout_s"),
    ("kafka2pc.aio.AsyncTwoPhaseCommitProducer.__init__", "delivery_poll_interval", "delivery_poll_interval_s"),
    ("kafka2pc.aio.LoopStallMonitor.__init__", "interval", "interval_s"),
    ("kafka2pc.aio.LoopStallMonitor.__init__", "threshold", "threshold_s"),
    ("kafka2pc.aio.AsyncTwoPhaseCommitProducer.__init__", "queue_full_timeout", "queue_full_timeout_s"),
    ("kafka2pc.recipes.dual_write.DualWriter.__init__", "lock_timeout_ms", "lock_timeout_s"),
    ("kafka2pc.recipes.dual_write.DualWriter.recover", "raise_on_heuristic", "on_heuristic"),
    ("kafka2pc.recipes.dual_write.DualWriter.recover", "acknowledge_heuristic", "on_heuristic"),
    ("kafka2pc.recipes.dual_write.WriterPool.__init__", "lock_timeout_ms", "lock_timeout_s"),
    ("kafka2pc.recipes.dual_write.aio.AsyncDualWriter.__init__", "lock_timeout_ms", "lock_timeout_s"),
    ("kafka2pc.recipes.dual_write.aio.AsyncDualWriter.recover", "raise_on_heuristic", "on_heuristic"),
    ("kafka2pc.recipes.dual_write.aio.AsyncDualWriter.recover", "acknowledge_heuristic", "on_heuristic"),
    ("kafka2pc.recipes.dual_write.aio.AsyncWriterPool.__init__", "lock_timeout_ms", "lock_timeout_s"),
)


def renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` was used: a :class:`DeprecationWarning` naming ``new`` and the release that removes it."""
    warnings.warn(
        f"{old} is deprecated and will be removed in {REMOVAL}: use {new}", DeprecationWarning, stacklevel=stacklevel
    )


def renamed_argument(where: str, old: str, old_value: _T | None, new: str, new_value: _T, *, stacklevel: int = 4) -> _T:
    """``new_value``, or the value given under the deprecated name ``old`` (which warns)."""
    if old_value is None:
        return new_value
    renamed(f"{where}({old}=...)", f"{new}=", stacklevel=stacklevel)
    return old_value


def seconds_from_ms(
    where: str, old: str, old_ms: float | None, new: str, new_s: float | None, *, stacklevel: int = 4
) -> float | None:
    """The value of a seconds argument ``new`` whose deprecated millisecond alias ``old`` may be given instead.

    Warns when ``old`` is given; giving both is a :class:`~kafka2pc.UsageError`.
    """
    if old_ms is None:
        return new_s
    from kafka2pc._exceptions import UsageError

    if new_s is not None:
        raise UsageError(f"{where}: give {new} or the deprecated {old}, not both")
    renamed(f"{where}({old}=...)", f"{new}= (in seconds)", stacklevel=stacklevel)
    return old_ms / 1000.0
