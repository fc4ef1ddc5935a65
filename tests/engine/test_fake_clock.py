"""The test kit's FakeClock: time stands still until advanced, and timers and
sleepers fire in the order of their deadlines, at their own virtual time."""

from __future__ import annotations

import asyncio

import pytest

from evergraph._util.clock import Clock
from evergraph.testing.clock import FakeClock


def test_sleepers_wake_in_deadline_order_at_their_own_time() -> None:
    clock = FakeClock(start=10.0)
    _: Clock = clock  # a Clock (checked by mypy)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.monotonic()))

    async def main() -> None:
        tasks = [asyncio.create_task(sleeper(n, s)) for n, s in (("c", 3), ("a", 1), ("b", 2))]
        await asyncio.sleep(0)
        assert clock.waiting() == 3
        await clock.advance(0.5)
        assert woke == []  # nothing due yet
        await clock.advance(2.0)
        assert woke == [("a", 11.0), ("b", 12.0)]
        assert clock.monotonic() == 12.5
        await clock.advance(10)
        assert woke[-1] == ("c", 13.0)
        await asyncio.gather(*tasks)
        assert clock.waiting() == 0

    asyncio.run(main())


def test_a_timer_armed_by_a_woken_task_fires_within_the_same_advance() -> None:
    clock = FakeClock()
    seen: list[float] = []

    async def chain() -> None:
        for _ in range(3):
            await clock.sleep(1)
            seen.append(clock.monotonic())

    async def main() -> None:
        t = asyncio.create_task(chain())
        await asyncio.sleep(0)
        await clock.advance(5)
        await t
        assert seen == [1.0, 2.0, 3.0]
        assert clock.monotonic() == 5.0

    asyncio.run(main())


def test_call_later_cancel_and_due_at_once() -> None:
    clock = FakeClock()
    fired: list[str] = []

    async def main() -> None:
        clock.call_later(2, lambda: fired.append("two"))
        gone = clock.call_later(1, lambda: fired.append("cancelled"))
        gone.cancel()
        clock.call_later(0, lambda: fired.append("now"))  # the next loop turn, no advance
        await asyncio.sleep(0)
        assert fired == ["now"]
        assert clock.next_deadline() == 2.0
        assert await clock.advance_to_next() == 2.0
        assert fired == ["now", "two"]
        assert await clock.advance_to_next() == 0.0  # nothing armed

    asyncio.run(main())


def test_timeout_cancels_at_its_deadline_and_only_then() -> None:
    clock = FakeClock()

    async def main() -> None:
        never = asyncio.Event()

        async def bounded() -> None:
            async with clock.timeout(3):
                await never.wait()

        t = asyncio.create_task(bounded())
        await clock.advance(2.9)
        assert not t.done()
        await clock.advance(0.1)
        with pytest.raises(TimeoutError):
            await t
        # a block that ends in time is not cancelled later
        async with clock.timeout(1):
            await asyncio.sleep(0)
        await clock.advance(5)
        async with clock.timeout(None):
            await asyncio.sleep(0)

    asyncio.run(main())


def test_time_follows_monotonic_and_never_goes_back() -> None:
    clock = FakeClock(start=0.0, epoch=1000.0)

    async def main() -> None:
        await clock.advance(1.5)
        assert clock.time() == 1001.5
        with pytest.raises(ValueError, match="back"):
            await clock.advance(-1)

    asyncio.run(main())
