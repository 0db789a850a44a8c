"""The test suite's port registry (``tests/harness/ports.py``): no two users of the block share a port."""

from __future__ import annotations

import itertools

from harness.ports import BROKER_PORTS, OTHER_RANGES, PRIVATE_BROKERS

from kafka2pc.testing._settings import CI_KAFKA_VERSIONS
from kafka2pc.testing.broker import LocalKafka, port_base


def _ranges() -> dict[str, tuple[int, int]]:
    ranges = {user: (offset, offset + BROKER_PORTS) for user, offset in PRIVATE_BROKERS.items()}
    ranges.update(OTHER_RANGES)
    for version, brokers in itertools.product(CI_KAFKA_VERSIONS, (1, 3)):  # the shared brokers of every line
        first = LocalKafka(version=version, brokers=brokers).base_port - port_base()
        ranges[f"shared {version} x{brokers}"] = (first, first + 2 * brokers)
    return ranges


def test_no_two_users_share_a_port() -> None:
    ranges = _ranges()
    clashes = [
        (a, b) for (a, (a0, a1)), (b, (b0, b1)) in itertools.combinations(ranges.items(), 2) if a0 < b1 and b0 < a1
    ]
    assert not clashes, clashes


def test_every_range_lies_inside_the_block() -> None:
    assert all(0 <= first < end <= 2000 for first, end in _ranges().values()), _ranges()
