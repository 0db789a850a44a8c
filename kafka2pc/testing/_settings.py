"""Broker settings shared by the local broker and ``docker-compose.yml``.

One source of truth: :mod:`kafka2pc.testing.broker` writes these into
``server.properties`` and ``tests/testing/test_compose.py`` checks that
``docker-compose.yml`` sets the same values.
"""

from __future__ import annotations

DEFAULT_KAFKA_VERSION = "4.4.0"
"""The Apache Kafka release the local broker and docker-compose run by default (the newest).

Only the broker (``org.apache.kafka:kafka_2.13``) and its dependencies are
fetched: nothing in kafka2pc needs Kafka's command-line tools (``kafka-tools``,
which Maven Central lacks for 4.4.0).
"""

#: Every broker line CI runs the crash tests on: the default, the previous 4.x, the 3.9 line.
CI_KAFKA_VERSIONS: tuple[str, ...] = (DEFAULT_KAFKA_VERSION, "4.3.1", "3.9.2")

#: Settings that matter to 2PC, identical for the local broker and docker-compose.
TRANSACTION_SETTINGS: dict[str, str] = {
    "transaction.two.phase.commit.enable": "true",
    "transaction.max.timeout.ms": "3600000",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "offsets.topic.replication.factor": "1",
    "group.initial.rebalance.delay.ms": "0",
    "auto.create.topics.enable": "false",
    "num.partitions": "1",
}

#: Settings of the local test broker only (not docker-compose's, which users run as it is): the coordinator
#: looks for timed-out transactions every second instead of every 10 s, so tests of the broker aborting
#: a transaction past ``transaction.timeout.ms`` (a heuristic outcome) wait seconds, not tens of seconds.
#: The internal topics have 6 partitions instead of 50: a fresh broker's first ``init_transactions``
#: waits 1.1 s instead of 1.6 s, and a three-node cluster still spreads its coordinators.
TEST_BROKER_SETTINGS: dict[str, str] = {
    "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
    "transaction.state.log.num.partitions": "6",
    "offsets.topic.num.partitions": "6",
}

#: Settings only brokers of the 4.x line understand.
SETTINGS_SINCE_4 = frozenset({"transaction.two.phase.commit.enable"})


def broker_settings(version: str, brokers: int = 1) -> dict[str, str]:
    """Return the 2PC-relevant settings for a broker of ``version`` in a cluster of ``brokers``."""
    settings = dict(TRANSACTION_SETTINGS)
    if int(version.split(".")[0]) < 4:
        for name in SETTINGS_SINCE_4:
            settings.pop(name, None)
    if brokers > 1:
        replication = str(min(3, brokers))
        settings["transaction.state.log.replication.factor"] = replication
        settings["offsets.topic.replication.factor"] = replication
        settings["transaction.state.log.min.isr"] = "2"
    return settings


#: The JVM options of the local broker's ``java`` processes (the broker and ``kafka-storage format``).
#: A test broker serves little traffic and is started often, so its JIT stops at C1 and it collects
#: with the serial collector: measured on a 2-core machine against C2 and G1, a start takes 35 % less
#: CPU (4.3 s instead of 6.7 s), 200 transactions 40 % less (4.5 s instead of 7.6 s), and an idle
#: broker 1.0 s instead of 1.5 s per 30 s. A broker built for peak throughput is a production one.
BROKER_JAVA_OPTIONS: tuple[str, ...] = ("-Xms256m", "-Xmx768m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")

#: The JVM options of ``kafka-storage format`` (a short-lived tool run before a node's first start).
FORMAT_JAVA_OPTIONS: tuple[str, ...] = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
