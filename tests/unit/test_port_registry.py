"""The test suite's port registry (``tests/harness/ports.py``): no two users of the block share a port."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from harness.ports import BROKER_PORTS, OTHER_RANGES, PRIVATE_BROKERS

from kafka2pc.testing._settings import CI_KAFKA_VERSIONS
from kafka2pc.testing.broker import BrokerError, LocalKafka, port_base, worker_port_base


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


def _assert_disjoint_below_32768(base: int, blocks: list[int]) -> None:
    """No two blocks overlap, none is the block right after ``base`` (CI's second run, the PySpark 3.5 line, takes
    it), all stay inside 1024-32767."""
    taken = [(first, first + 2000) for first in [*blocks, base + 2000]]
    assert all(a1 <= b0 or b1 <= a0 for (a0, a1), (b0, b1) in itertools.combinations(taken, 2)), (base, blocks)
    assert all(1024 <= first <= 32768 - 2000 for first in blocks), (base, blocks)


def test_parallel_workers_get_disjoint_blocks_that_leave_the_next_block_free() -> None:
    """pytest-xdist's workers (scripts/test.sh) each run their own brokers in a block of their own."""
    for base in (1024, 20000, 26000, 28768):
        blocks = [worker_port_base(base, n) for n in range(3)]
        assert blocks[0] == base
        _assert_disjoint_below_32768(base, blocks)


def test_workers_that_replace_crashed_ones_get_the_blocks_left_free() -> None:
    """pytest-xdist names a worker that replaces a crashed one ``gw<next>``: it gets a block of its own until none
    is left, then a typed error that says so."""
    for base in (1024, 20000, 22000, 28768):
        blocks: list[int] = []
        for n in itertools.count():
            try:
                blocks.append(worker_port_base(base, n))
            except BrokerError as exc:
                assert f"worker {n}" in str(exc) and str(base) in str(exc)
                break
        _assert_disjoint_below_32768(base, blocks)
        assert len(blocks) >= 7, (base, blocks)  # three workers and four replacements at least
    assert [worker_port_base(20000, n) for n in range(7)] == [20000, 24000, 28000, 8000, 4000, 16000, 12000]


def test_every_user_is_a_test_module_of_the_suite() -> None:
    """Keys name the module that binds the ports (``recipes/sync/test_dual_write_broker#2``: its second slot)."""
    tests = Path(__file__).resolve().parents[1]
    modules = {m[0] for user in [*PRIVATE_BROKERS, *OTHER_RANGES] if (m := re.match(r"\w+(/\w+)+", user))}
    assert len(modules) >= 10, modules
    missing = sorted(m for m in modules if not any(
        (tests / f"{path}.py").exists() for path in (m, m.replace("/", "/_")) if path.count("/_") <= 1))
    assert not missing, f"registry keys that name no module under tests/: {missing}"
