"""Deprecated 0.1 names: each still works for one minor release and warns, naming its replacement.

:data:`RENAMED_ARGUMENTS` lists every deprecated keyword argument that is still
in a public signature, as ``(qualified callable, old name, new name)``: the
conventions test (``tests/unit/test_api_conventions.py``) exempts exactly these
from its rules and checks that each one warns.  Renamed public names (classes,
functions) warn on access through the module's ``__getattr__``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = [
    "RENAMED_ARGUMENTS",
    "RENAMED_MEMBERS",
    "REMOVAL",
    "deprecated_alias",
    "deprecated_property",
    "renamed",
    "renamed_argument",
    "seconds_from_ms",
]

REMOVAL = "kafka2pc 2.0"
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
    ("kafka2pc.TwoPhaseCommitProducer.produce", "callback", "on_delivery"),
    ("kafka2pc.TransactionAdmin.complete_transaction", "raise_on_heuristic", "on_heuristic"),
    ("kafka2pc.TransactionAdmin.settle_many", "raise_on_heuristic", "on_heuristic"),
    ("kafka2pc.aio.AsyncTransactionAdmin.complete_transaction", "raise_on_heuristic", "on_heuristic"),
    ("kafka2pc.aio.AsyncTransactionAdmin.settle_many", "raise_on_heuristic", "on_heuristic"),
)


RENAMED_MEMBERS: tuple[tuple[str, str, str], ...] = (
    ("kafka2pc.TransactionInfo.open_for_ms", "open_for_s", "seconds; None when none is open"),
    ("kafka2pc.OpenTransaction.duration_ms", "duration_s", "seconds"),
    ("kafka2pc.TransactionAdmin.max_transaction_timeout_ms()", "max_transaction_timeout_s()", "seconds"),
    ("kafka2pc.TransactionAdmin.outcome_of()", "transaction_outcome(transactional_id, state, settled=True)",
     "one probe, as before"),
    ("kafka2pc.aio.AsyncTransactionAdmin.max_transaction_timeout_ms()", "max_transaction_timeout_s()", "seconds"),
    ("kafka2pc.aio.AsyncTransactionAdmin.outcome_of()", "transaction_outcome(transactional_id, state, settled=True)",
     "one probe, as before"),
    ("kafka2pc.aio.StallReport.elapsed", "elapsed_s", "same unit"),
    ("kafka2pc.aio.StallReport.lateness", "lateness_s", "same unit"),
    ("kafka2pc.aio.StallReport.noise", "noise_s", "same unit"),
    ("kafka2pc.aio.StallReport.max_stall", "max_stall_s", "same unit"),
    ("kafka2pc.aio.StallReport.percentile()", "percentile_s()", "same unit"),
    ("kafka2pc.recipes.dual_write.DualWriter.status", "state", "same value"),
    ("kafka2pc.recipes.dual_write.aio.AsyncDualWriter.status", "state", "same value"),
    ("kafka2pc.recipes.spark.SinkDecision.created_ms", "created_s", "seconds"),
)
"""Deprecated properties and methods of public classes: ``(old, replacement, note)``; each warns when used
(marked ``__deprecated__``: ``tests/unit/test_deprecated_names.py`` checks the two agree)."""


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


def deprecated_property(old: str, new: str, getter: Callable[[Any], _T]) -> property:
    """A read-only property ``old`` that warns and returns ``getter(self)`` (the value of ``new``, converted).

    Its getter carries ``__deprecated__`` (PEP 702's marker), which the API
    tests read to tell a deprecated alias from a public value.
    """

    def get(self: Any) -> _T:
        renamed(f"{type(self).__name__}.{old}", f"{type(self).__name__}.{new}")
        return getter(self)

    get.__name__ = old
    get.__doc__ = f"Deprecated: use :attr:`{new}` (removed in {REMOVAL})."
    get.__deprecated__ = f"use {new}"  # type: ignore[attr-defined]
    return property(get)


def deprecated_alias(old: str, new: str) -> Callable[[_F], _F]:
    """Mark the method ``old`` (which calls ``new``) as deprecated: it warns on each call."""

    def mark(fn: _F) -> _F:
        import functools

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            owner = type(args[0]).__name__ if args else ""
            renamed(f"{owner}.{old}()", f"{owner}.{new}()")
            return fn(*args, **kwargs)

        wrapper.__doc__ = f"Deprecated: use :meth:`{new}` (removed in {REMOVAL}).\n\n{fn.__doc__ or ''}"
        wrapper.__deprecated__ = f"use {new}"  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return mark
