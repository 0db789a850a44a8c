"""Durations, tables and the JSON documents the CLI prints, and the loop of its refreshing views.

The JSON shapes are a public, versioned interface (``docs/cli.md`` holds
their JSON Schema and a test validates real output against it): add fields
if needed, never rename or remove one without bumping ``version``.

Works on the core's value objects by attribute access only, so importing it
costs nothing: the heavy modules are imported by the commands, when they run.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from kafka2pc import OpenTransaction, PartitionLag, ProducerState, TransactionDescription, TransactionInfo

__all__ = [
    "JSON_VERSION",
    "STATS_JSON_VERSION",
    "dump_json",
    "format_duration",
    "info_open_ms",
    "open_transaction_json",
    "parse_duration_ms",
    "parse_duration_s",
    "producer_json",
    "render_table",
    "repeat",
    "transaction_json",
    "transaction_rows",
]

JSON_VERSION = 1
STATS_JSON_VERSION = 2
"""``stats``' document: version 2 since a hanging partition's ``holding_transactional_id`` is ``null`` (a string in
version 1; docs/cli.md's contract increments ``version`` when a field is retyped)."""

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration_ms(text: str) -> int:
    """``"90s"`` -> ``90000``; also ``15m``, ``1h30m``, ``500ms``, ``2d`` and plain ``0``.

    >>> parse_duration_ms("1h30m"), parse_duration_ms("0s"), parse_duration_ms("0")
    (5400000, 0, 0)
    """
    compact = text.strip().lower().replace(" ", "")
    if compact == "0":
        return 0
    position, total = 0, 0.0
    for match in _DURATION_PART.finditer(compact):
        if match.start() != position:
            break
        total += float(match[1]) * _UNITS_MS[match[2]]
        position = match.end()
    if not compact or position != len(compact):
        raise ValueError(f"{text!r} is not a duration (examples: 90, 90s, 15m, 2h, 1h30m, 500ms)")
    return int(total)


def parse_duration_s(text: str) -> float:
    """A duration in seconds: a plain number is seconds (``"90"``, ``"1.5"``); else as :func:`parse_duration_ms`.

    >>> parse_duration_s("90"), parse_duration_s("90s"), parse_duration_s("15m"), parse_duration_s("2h")
    (90.0, 90.0, 900.0, 7200.0)
    """
    compact = text.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", compact):
        return float(compact)
    return parse_duration_ms(compact) / 1000.0


def format_duration(ms: int | None) -> str:
    """``125000`` -> ``"2m05s"``; ``None``/negative (nothing open) -> ``"-"``."""
    if ms is None or ms < 0:
        return "-"
    seconds = ms // 1000
    if seconds < 60:
        return f"{seconds}s" if seconds else f"{ms}ms"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m{seconds:02d}s"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h{minutes:02d}m"


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces (numbers right-aligned)."""
    text_rows = [["" if cell is None else str(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    numeric = [True] * len(headers)
    for row in text_rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
            if cell and not re.fullmatch(r"-?\d+", cell):
                numeric[i] = False
    lines = ["  ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip()]
    for row in text_rows:
        cells = [cell.rjust(widths[i]) if numeric[i] else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def dump_json(document: dict[str, Any]) -> str:
    """The JSON text of a document (keys in documented order, 2-space indent)."""
    return json.dumps(document, indent=2, ensure_ascii=False)


def open_for_ms(desc: TransactionDescription | None, now_ms: int | None = None) -> int | None:
    """How long the coordinator's current transaction has been open (``None`` if none is)."""
    if desc is None or desc.start_time_ms <= 0 or desc.state not in _OPEN_STATES:
        return None
    now = int(time.time() * 1000) if now_ms is None else now_ms
    return max(0, now - desc.start_time_ms)


_OPEN_STATES = frozenset({"Ongoing", "PrepareCommit", "PrepareAbort", "PrepareEpochFence"})


def info_open_ms(info: TransactionInfo) -> int:
    """``info.open_for_s`` in whole milliseconds, as the JSON documents carry it (``-1`` when none is open)."""
    return -1 if info.open_for_s is None else round(info.open_for_s * 1000)


def _partition_json(topic: str, partition: int, lag: PartitionLag | None) -> dict[str, Any]:
    return {
        "topic": topic,
        "partition": partition,
        "last_stable_offset": None if lag is None else lag.last_stable_offset,
        "high_watermark": None if lag is None else lag.high_watermark,
        "held_back": None if lag is None else lag.held_back,
    }


def transaction_json(info: TransactionInfo) -> dict[str, Any]:
    """One transaction as a JSON object (schema ``transaction`` in ``docs/cli.md``)."""
    desc = info.description
    lags = {(lag.topic, lag.partition): lag for lag in info.partitions}
    keys = sorted({(tp.topic, tp.partition) for tp in desc.partitions} | set(lags))
    partitions = [_partition_json(topic, partition, lags.get((topic, partition))) for topic, partition in keys]
    return {
        "transactional_id": desc.transactional_id,
        "state": desc.state,
        "producer_id": desc.producer_id,
        "producer_epoch": desc.producer_epoch,
        "coordinator_id": desc.coordinator_id,
        "timeout_ms": desc.timeout_ms,
        "start_time_ms": desc.start_time_ms if desc.start_time_ms > 0 else None,
        "open_for_ms": info_open_ms(info) if info.open_for_s is not None else None,
        "held_back": sum(lag.held_back for lag in info.partitions),
        "partitions": partitions,
    }


TRANSACTION_HEADERS = (
    "TRANSACTIONAL ID", "STATE", "PRODUCER ID", "EPOCH", "OPEN FOR", "PARTITION", "LSO", "HW", "HELD BACK",
)


def transaction_rows(info: TransactionInfo) -> list[list[object]]:
    """Table rows for one transaction: one per partition, the transaction's columns on the first."""
    doc = transaction_json(info)
    head: list[object] = [
        doc["transactional_id"], doc["state"], doc["producer_id"], doc["producer_epoch"],
        format_duration(doc["open_for_ms"]),
    ]
    if not doc["partitions"]:
        return [[*head, "-", "", "", ""]]
    rows: list[list[object]] = []
    for i, part in enumerate(doc["partitions"]):
        prefix = head if i == 0 else ["", "", "", "", ""]
        rows.append([
            *prefix, f"{part['topic']}-{part['partition']}", part["last_stable_offset"],
            part["high_watermark"], part["held_back"],
        ])
    return rows


def producer_json(producer: ProducerState) -> dict[str, Any]:
    """One active producer of a partition (schema ``producer`` in ``docs/cli.md``)."""
    return {
        "producer_id": producer.producer_id,
        "producer_epoch": producer.producer_epoch,
        "coordinator_epoch": producer.coordinator_epoch,
        "last_sequence": producer.last_sequence,
        "last_timestamp_ms": producer.last_timestamp_ms,
        "current_transaction_start_offset": (
            producer.current_txn_start_offset if producer.current_txn_start_offset >= 0 else None
        ),
    }


def open_transaction_json(found: OpenTransaction) -> dict[str, Any]:
    """One open (possibly hanging) transaction of a partition (schema ``open_transaction`` in ``docs/cli.md``)."""
    return {
        "topic": found.partition.topic,
        "partition": found.partition.partition,
        **producer_json(found.producer),
        "duration_ms": round(found.duration_s * 1000),
        "transactional_id": found.transactional_id,
        "coordinator_state": found.coordinator_state,
        "hanging": found.hanging,
        "reason": found.reason,
    }


def repeat(every_s: float, count: int | None, step: Callable[[], None]) -> None:
    """Call ``step()`` now, then every ``every_s`` seconds, ``count`` times in all (``None``: until Ctrl-C)."""
    done = 0
    try:
        while count is None or done < count:
            if done:
                time.sleep(every_s)
            step()
            done += 1
    except KeyboardInterrupt:
        click.echo()
