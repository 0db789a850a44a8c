"""The asyncio runtime's semaphore (the pipelined commits' places): a free place without a switch, a full one waits."""

from __future__ import annotations

import asyncio

from kafka2pc.recipes.dual_write.aio._bridge import in_greenlet
from kafka2pc.recipes.dual_write.aio._runtime import EVENT_LOOP


def test_a_free_place_is_taken_at_once_and_a_full_semaphore_waits_for_a_release() -> None:
    async def main() -> list[str]:
        places = EVENT_LOOP.semaphore(1)
        seen: list[str] = []

        def first() -> None:
            assert places.acquire()
            seen.append("first has it")

        def second() -> None:
            seen.append("second waits")
            assert places.acquire()
            seen.append("second has it")

        await in_greenlet(first)  # no place was taken: returns without letting the loop run
        waiting = asyncio.ensure_future(in_greenlet(second))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        seen.append("released")
        places.release()
        await asyncio.wait_for(waiting, 5)
        return seen

    assert asyncio.run(main()) == ["first has it", "second waits", "released", "second has it"]
