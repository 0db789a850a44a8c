"""The control plane's retry routine for requests any broker can answer (no broker needed)."""

from __future__ import annotations

import asyncio

import pytest

from kafka2pc import BrokerUnavailableError
from kafka2pc._control._retry import Deadline, Route, call_with_retries


class Refused(Exception):
    """What a connection to a dead broker raises."""


def _run(dead: set[int], brokers: list[int], *, timeout_s: float = 5.0) -> tuple[str, list[int]]:
    tried: list[int] = []
    current = {"node": brokers[0]}

    async def resolve(refresh: bool) -> int:
        if refresh:
            current["node"] = brokers[(brokers.index(current["node"]) + 1) % len(brokers)]
        return current["node"]

    async def attempt(node: int) -> str:
        tried.append(node)
        if node in dead:
            raise Refused(node)
        return f"answer of {node}"

    async def no_sleep(_: float) -> None:
        return None

    answer = asyncio.run(call_with_retries(
        Route.ANY_BROKER, "DescribeConfigs", resolve, attempt, max_retries=5,
        deadline=Deadline.after(timeout_s), sleep=no_sleep, connection_errors=(Refused,),
    ))
    return answer, tried


def test_a_dead_broker_is_left_for_the_next_one() -> None:
    assert _run({1}, [1, 2, 3]) == ("answer of 2", [1, 2])
    assert _run({1, 2}, [1, 2, 3]) == ("answer of 3", [1, 2, 3])


def test_every_broker_dead_ends_with_a_typed_error_after_the_retries() -> None:
    with pytest.raises(BrokerUnavailableError, match="DescribeConfigs: gave up after 6 attempts"):
        _run({1, 2, 3}, [1, 2, 3])
