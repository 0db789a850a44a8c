"""``stats`` and ``pending-offsets``: what open transactions hold back across the cluster, and whose they are.

:func:`collect_stats` builds one JSON document (schema ``stats`` in
``docs/cli.md``) from the coordinators' view (ListTransactions +
DescribeTransactions, with each open transaction's partitions' LSO and HW)
and the group coordinators' (``OffsetFetch`` with ``require_stable``):

* per coordinator: transactions by state, the oldest open one and its age;
* per partition held back (``HW > LSO``): the records and the time held back,
  and the open transactions on it, oldest (the one pinning the LSO) first;
* per transactional-id prefix (:func:`id_prefix`): open transactions, records
  held back, the oldest one's age;
* consumer groups whose offsets are pending in an open transaction, and which.

The same document feeds the table, ``-o json``, ``--watch`` and the
OpenTelemetry gauges (:mod:`kafka2pc.cli._otel`).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from ._group import cli
from ._options import Duration, connection_options, current_settings, open_admin, output_option, parse_listen_address
from ._render import (
    JSON_VERSION,
    STATS_JSON_VERSION,
    dump_json,
    format_duration,
    info_open_ms,
    render_table,
    repeat,
)

if TYPE_CHECKING:
    from kafka2pc import TransactionAdmin, TransactionInfo

__all__ = [
    "collect_stats", "holder_text", "id_prefix", "pending_offsets_json", "stats_text", "watch", "watch_options",
]

_NUMBERED = re.compile(r"[-_.]\d+$")


def id_prefix(transactional_id: str) -> str:
    """The group a transactional id belongs to: the id without its trailing ``-<n>`` (``_<n>``, ``.<n>``).

    A ``WriterPool``'s ``<prefix>-<n>`` and a Spark sink's ``<prefix><sink id>-<partition>``
    each roll up into one prefix; an id without a numbered suffix is its own group.

    >>> id_prefix("orders-12"), id_prefix("k2pc-spark-q1-3"), id_prefix("billing")
    ('orders', 'k2pc-spark-q1', 'billing')
    """
    return _NUMBERED.sub("", transactional_id) or transactional_id


def pending_offsets_json(admin: TransactionAdmin, infos: list[TransactionInfo]) -> list[dict[str, Any]]:
    """Groups with offsets pending in an open transaction; per group the transactions holding them.

    A transaction holds a group's offsets when its records in the group's
    ``__consumer_offsets`` partition carry them
    (:meth:`TransactionAdmin.pending_offset_holders`): another transaction
    writing to that partition for another group is not listed.
    """
    pending = admin.pending_offset_groups()
    if not pending:
        return []
    tids_by_pid: dict[int, list[str]] = {}
    for info in infos:
        if info.is_open:
            tids_by_pid.setdefault(info.description.producer_id, []).append(info.transactional_id)
    holders = admin.pending_offset_holders(list(pending))
    groups = []
    for group_id, partitions in sorted(pending.items()):
        offsets_tp = admin.consumer_offsets_partition(group_id)
        groups.append({
            "group_id": group_id,
            "partitions": [{"topic": tp.topic, "partition": tp.partition} for tp in partitions],
            "offsets_partition": offsets_tp.partition,
            "held_by": sorted(tid for pid in holders.get(group_id, []) for tid in tids_by_pid.get(pid, [])),
        })
    return groups


def _held_back(
    admin: TransactionAdmin, open_infos: list[TransactionInfo], now: int
) -> dict[tuple[str, int], dict[str, Any]]:
    """Every partition with LSO < HW: the coordinators' open transactions', then the leaders' scan.

    A partition the scan finds that no open transaction of a coordinator
    has is confirmed with DescribeProducers (a record appended between the
    scan's two readings is no transaction); its holder is the producer whose
    open transaction starts at the LSO; it is *hanging* unless a coordinator
    has that producer's transaction open with the partition in it (then the
    scan saw a transaction the coordinators' view missed by a moment).
    """
    partitions: dict[tuple[str, int], dict[str, Any]] = {}
    for info in open_infos:  # oldest first: the first holder of a partition is the one pinning its LSO
        for lag in info.partitions:
            if lag.held_back <= 0:
                continue
            entry = partitions.setdefault((lag.topic, lag.partition), {
                "topic": lag.topic, "partition": lag.partition, "last_stable_offset": lag.last_stable_offset,
                "high_watermark": lag.high_watermark, "held_back": lag.held_back,
                "held_back_for_ms": info_open_ms(info), "holding_transactional_id": info.transactional_id,
                "holding_producer_id": info.description.producer_id, "hanging": False, "transactional_ids": [],
            })
            entry["transactional_ids"].append(info.transactional_id)
    from kafka2pc import TopicAndPartition

    open_by_pid = {info.description.producer_id: info for info in open_infos}
    for lag in admin.held_back_partitions():
        if (lag.topic, lag.partition) in partitions:
            continue
        tp = TopicAndPartition(lag.topic, lag.partition)
        holders = sorted(
            (p for p in admin.describe_producers(tp) if p.current_txn_start_offset >= 0),
            key=lambda p: (p.current_txn_start_offset, p.producer_id),
        )
        if not holders:
            continue  # ended between the readings
        holder = holders[0]
        owner = open_by_pid.get(holder.producer_id)
        if owner is not None and tp not in owner.description.partitions:
            owner = None  # its producer id's open transaction is not on this partition: hanging
        partitions[(lag.topic, lag.partition)] = {
            "topic": lag.topic, "partition": lag.partition, "last_stable_offset": lag.last_stable_offset,
            "high_watermark": lag.high_watermark, "held_back": lag.held_back,
            "held_back_for_ms": info_open_ms(owner) if owner else max(0, now - holder.last_timestamp_ms),
            "holding_transactional_id": owner.transactional_id if owner else None,
            "holding_producer_id": holder.producer_id, "hanging": owner is None,
            "transactional_ids": [owner.transactional_id] if owner else [],
        }
    return partitions


def collect_stats(admin: TransactionAdmin, *, now_ms: int | None = None) -> dict[str, Any]:
    """The ``stats`` document: coordinators, partitions held back, prefixes, pending offset groups.

    Partitions come from two views: the partitions of every transaction a
    coordinator has open, and a scan of every partition's LSO and HW
    (:meth:`TransactionAdmin.held_back_partitions`: one Metadata and two
    ListOffsets requests per broker), which also finds a partition held
    back by a transaction no coordinator has open (``hanging``).  A prefix's
    ``held_back`` counts each of its partitions once, however many of its
    transactions share it.
    """
    infos = admin.list_transactions()
    now = int(time.time() * 1000) if now_ms is None else now_ms
    open_infos = sorted((i for i in infos if i.is_open), key=lambda i: (-info_open_ms(i), i.transactional_id))

    coordinators: dict[int, dict[str, Any]] = {}
    for info in infos:
        entry = coordinators.setdefault(
            info.description.coordinator_id,
            {"coordinator_id": info.description.coordinator_id, "transactions": 0, "states": Counter(),
             "open": 0, "oldest_open": None},
        )
        entry["transactions"] += 1
        entry["states"][info.state] += 1
        if info.is_open:
            entry["open"] += 1
            oldest = entry["oldest_open"]
            if oldest is None or info_open_ms(info) > oldest["open_for_ms"]:
                entry["oldest_open"] = {"transactional_id": info.transactional_id, "open_for_ms": info_open_ms(info)}

    partitions = _held_back(admin, open_infos, now)
    prefixes: dict[str, dict[str, Any]] = {}
    prefix_partitions: dict[str, set[tuple[str, int]]] = {}
    for info in open_infos:
        prefix = id_prefix(info.transactional_id)
        entry = prefixes.setdefault(prefix, {
            "prefix": prefix, "open": 0, "held_back": 0, "held_back_partitions": 0,
            "oldest_open_ms": info_open_ms(info), "oldest_transactional_id": info.transactional_id,
        })
        entry["open"] += 1
        prefix_partitions.setdefault(prefix, set()).update(
            (lag.topic, lag.partition) for lag in info.partitions if (lag.topic, lag.partition) in partitions
        )
    for prefix, keys in prefix_partitions.items():  # each partition once, however many of its ids share it
        prefixes[prefix]["held_back"] = sum(partitions[key]["held_back"] for key in keys)
        prefixes[prefix]["held_back_partitions"] = len(keys)

    return {
        "version": STATS_JSON_VERSION,
        "time_ms": now,
        "coordinators": [
            {**c, "states": dict(sorted(c["states"].items()))} for _, c in sorted(coordinators.items())
        ],
        "partitions": sorted(partitions.values(), key=lambda p: (-p["held_back_for_ms"], p["topic"], p["partition"])),
        "prefixes": sorted(prefixes.values(), key=lambda p: (-p["oldest_open_ms"], p["prefix"])),
        "pending_offsets": pending_offsets_json(admin, infos),
    }


def holder_text(partition: dict[str, Any]) -> str:
    """HELD BY for one partition: the transactional id, or what is known of a hanging transaction's producer."""
    if partition["holding_transactional_id"] is not None:
        return str(partition["holding_transactional_id"])
    return f"(hanging: no coordinator has it open; producer {partition['holding_producer_id']})"


def _pending_rows(groups: list[dict[str, Any]]) -> list[tuple[object, ...]]:
    return [
        (g["group_id"], ", ".join(f"{p['topic']}-{p['partition']}" for p in g["partitions"]) or "-",
         f"__consumer_offsets-{g['offsets_partition']}", ", ".join(g["held_by"]) or "(not found)")
        for g in groups
    ]


_PENDING_HEADERS = ("GROUP", "PENDING PARTITIONS", "STORED IN", "HELD BY")


def _section(title: str, headers: tuple[str, ...], rows: list[tuple[object, ...]], empty: str = "none") -> list[str]:
    return ["", title, render_table(headers, rows) if rows else empty]


def stats_text(doc: dict[str, Any]) -> str:
    """The ``stats`` document as four tables."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(doc["time_ms"] / 1000))
    lines = [f"kafka2pc stats at {stamp}"]
    lines += _section("COORDINATORS", ("COORDINATOR", "TRANSACTIONS", "OPEN", "BY STATE", "OLDEST OPEN", "OPEN FOR"), [
        (c["coordinator_id"], c["transactions"], c["open"], " ".join(f"{s}={n}" for s, n in c["states"].items()),
         (c["oldest_open"] or {}).get("transactional_id", "-"),
         format_duration((c["oldest_open"] or {}).get("open_for_ms")))
        for c in doc["coordinators"]
    ], empty="no transactions")
    lines += _section(
        "PARTITIONS HELD BACK (read_committed consumers wait here)",
        ("PARTITION", "LSO", "HW", "HELD BACK", "FOR", "HELD BY", "ALSO OPEN"),
        [(f"{p['topic']}-{p['partition']}", p["last_stable_offset"], p["high_watermark"], p["held_back"],
          format_duration(p["held_back_for_ms"]), holder_text(p),
          ", ".join(p["transactional_ids"][1:]) or "-") for p in doc["partitions"]],
    )
    lines += _section(
        "BY TRANSACTIONAL-ID PREFIX (open transactions; HELD BACK: records on the prefix's partitions, each once)",
        ("PREFIX", "OPEN", "PARTITIONS", "HELD BACK", "OLDEST OPEN", "OPEN FOR"),
        [(p["prefix"], p["open"], p["held_back_partitions"], p["held_back"], p["oldest_transactional_id"],
          format_duration(p["oldest_open_ms"]))
         for p in doc["prefixes"]],
    )
    lines += _section("CONSUMER GROUPS WITH OFFSETS PENDING IN AN OPEN TRANSACTION", _PENDING_HEADERS,
                      _pending_rows(doc["pending_offsets"]))
    return "\n".join(lines)


def watch(every_s: float | None, count: int | None, show: Callable[[], None]) -> None:
    """Call ``show()`` once, or (``every_s``) on a cleared screen every ``every_s`` seconds (:func:`repeat`)."""
    if every_s is None:
        show()
        return

    def refresh() -> None:
        click.clear()
        show()

    repeat(every_s, count, refresh)


def watch_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--watch DURATION`` and ``--count N``, for a refreshing terminal view."""
    func = click.option(
        "--count", type=click.IntRange(min=1), default=None, metavar="N",
        help="With --watch: stop after N refreshes [default: until Ctrl-C].",
    )(func)
    return click.option(
        "--watch", "watch_s", type=Duration(min_s=0.1), default=None, metavar="DURATION",
        help="Refresh every DURATION (10, 10s, 1m; with -o json: one document per line per refresh).",
    )(func)


def _emit(doc: dict[str, Any], output: str, text: Callable[[dict[str, Any]], str], watching: bool) -> None:
    if output == "json":
        click.echo(dump_json(doc) if not watching else dump_json_line(doc))
    else:
        click.echo(text(doc))


def dump_json_line(doc: dict[str, Any]) -> str:
    """One document on one line (``--watch -o json``: one line per refresh)."""
    import json

    return json.dumps(doc, ensure_ascii=False)


def _listen_address(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, int] | None:
    if value is None:
        return None
    try:
        return parse_listen_address(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


@cli.command("stats")
@watch_options
@click.option("--otel", "otel", is_flag=True,
              help="Run as an OpenTelemetry exporter: the same figures as gauges, every --watch (default 60s), "
                   "to the SDK's configured exporter (OTLP if installed, else the console).")
@click.option("--prometheus", "prometheus", metavar="[HOST]:PORT", callback=_listen_address,
              help="Serve the same figures on http://HOST:PORT/metrics for Prometheus (HOST default: every "
                   "interface), collected every --watch (default 30s).")
@output_option
@connection_options(group=False)
def stats_command(
    watch_s: float | None, count: int | None, otel: bool, prometheus: tuple[str, int] | None, output: str
) -> None:
    """Cluster-wide: transactions per coordinator, partitions held back and by whom, per id prefix, pending offsets.

    A partition is held back while a transaction pins its last stable
    offset (LSO) below its high watermark (HW): read_committed consumers stop
    there.  Every such partition is listed (each broker is asked for its
    partitions' LSO and HW), with HELD BY: the oldest open transaction on it
    (the one pinning the LSO), or, when no coordinator has it open, the
    producer id of the hanging transaction.  Ids roll up by prefix (the id
    without a trailing -<n>), so a WriterPool's or a Spark sink's transactions
    show as one group; a prefix's HELD BACK counts each of its partitions once.
    """
    if otel and prometheus is not None:
        raise click.UsageError("--otel and --prometheus are two ways to export: give one")
    timeout_s = current_settings().timeout_s
    if otel or prometheus is not None:
        with open_admin() as admin:
            def bounded_stats() -> dict[str, Any]:
                with admin.bounded(timeout_s):
                    return collect_stats(admin)

            if otel:
                from ._otel import run_exporter

                run_exporter(bounded_stats, every_s=watch_s or 60.0, count=count, timeout_s=timeout_s + 5.0)
            else:
                from ._prometheus import serve

                assert prometheus is not None
                serve(bounded_stats, prometheus, every_s=watch_s or 30.0, count=count)
        return
    with open_admin() as admin:
        def show() -> None:
            with admin.bounded(timeout_s):
                doc = collect_stats(admin)
            _emit(doc, output, stats_text, watch_s is not None)

        watch(watch_s, count, show)


@cli.command("pending-offsets")
@output_option
@connection_options(group=False)
def pending_offsets_command(output: str) -> None:
    """Consumer groups whose committed offsets are pending in an open transaction, and which transaction holds them.

    A consumer (re)starting in such a group waits (OffsetFetch answers
    UNSTABLE_OFFSET_COMMIT) until the transaction ends: commit or abort it
    (recover, complete, stuck --abort, force-terminate).  A brand-new group
    whose first offsets are pending is listed too.
    """
    with open_admin() as admin, admin.bounded(current_settings().timeout_s):
        infos = admin.list_transactions()
        groups = pending_offsets_json(admin, infos)
    if output == "json":
        click.echo(dump_json({"version": JSON_VERSION, "groups": groups}))
    elif groups:
        click.echo(render_table(_PENDING_HEADERS, _pending_rows(groups)))
    else:
        click.echo("no consumer group has offsets pending in an open transaction")
