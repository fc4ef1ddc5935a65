"""_util/tasks: first_of (a race whose losers are cancelled and awaited) and fan_in
(a bounded map whose answers keep their order); neither leaves a task behind."""

from __future__ import annotations

import asyncio

import pytest

from evergraph._util.tasks import fan_in, first_of


class Probe:
    """An awaitable's life, observed: started, cancelled, ended (each an Event)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.ended = asyncio.Event()

    async def forever(self) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.ended.set()


def test_first_of_returns_the_first_result_and_ends_the_others() -> None:
    async def body() -> None:
        go = asyncio.Event()
        loser = Probe()

        async def winner() -> str:
            await go.wait()
            return "won"

        async def slow() -> str:
            await loser.forever()
            return "never"

        race = asyncio.ensure_future(first_of(slow(), winner()))
        await loser.started.wait()
        go.set()
        assert await race == "won"
        assert loser.cancelled.is_set()
        assert loser.ended.is_set()

    asyncio.run(body())


def test_first_of_raises_the_first_failure_and_ends_the_others() -> None:
    async def body() -> None:
        loser = Probe()

        async def fails() -> None:
            await loser.started.wait()
            raise KeyError("boom")

        with pytest.raises(KeyError, match="boom"):
            await first_of(loser.forever(), fails())
        assert loser.ended.is_set()

    asyncio.run(body())


def test_first_of_prefers_a_failure_finished_in_the_same_turn() -> None:
    async def ok() -> int:
        return 1

    async def fails() -> int:
        raise ValueError("also done")

    async def body() -> None:
        with pytest.raises(ValueError, match="also done"):
            await first_of(ok(), fails())
        assert await first_of(ok(), ok()) == 1

    asyncio.run(body())


def test_first_of_takes_futures_and_events() -> None:
    async def body() -> None:
        closed, changed = asyncio.Event(), asyncio.Event()
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        fut.set_result("ready")
        assert await first_of(fut, closed.wait()) == "ready"
        changed.set()
        assert await first_of(closed.wait(), changed.wait()) is True

    asyncio.run(body())


def test_cancelling_first_of_cancels_and_awaits_every_racer() -> None:
    async def body() -> None:
        a, b = Probe(), Probe()
        race = asyncio.ensure_future(first_of(a.forever(), b.forever()))
        await a.started.wait()
        await b.started.wait()
        race.cancel()
        with pytest.raises(asyncio.CancelledError):
            await race
        assert a.ended.is_set()
        assert b.ended.is_set()

    asyncio.run(body())


def test_a_loser_that_is_slow_to_stop_is_still_awaited() -> None:
    async def body() -> None:
        release = asyncio.Event()
        stopping, stopped = asyncio.Event(), asyncio.Event()

        async def stubborn() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                stopping.set()
                await release.wait()  # its cleanup takes a while
                stopped.set()

        async def quick() -> str:
            return "quick"

        race = asyncio.ensure_future(first_of(stubborn(), quick()))
        await stopping.wait()
        assert not race.done()  # held until the loser has ended
        release.set()
        assert await race == "quick"
        assert stopped.is_set()

    asyncio.run(body())


def test_first_of_needs_something_to_race() -> None:
    with pytest.raises(ValueError, match="at least one"):
        asyncio.run(first_of())


def test_fan_in_keeps_order_and_the_bound() -> None:
    async def body() -> None:
        started: list[int] = []
        running = peak = 0
        moved = asyncio.Condition()
        gates = {i: asyncio.Event() for i in range(7)}

        async def work(i: int) -> int:
            nonlocal running, peak
            async with moved:
                started.append(i)
                running += 1
                peak = max(peak, running)
                moved.notify_all()
            await gates[i].wait()
            running -= 1
            return i * i

        job = asyncio.ensure_future(fan_in(iter(range(7)), 3, work))
        async with moved:
            await moved.wait_for(lambda: len(started) == 3)
        assert started == [0, 1, 2]  # the bound: the fourth waits for a free slot
        gates[2].set()
        async with moved:
            await moved.wait_for(lambda: len(started) == 4)
        assert started[3] == 3
        for i in reversed(range(7)):  # they finish out of order
            gates[i].set()
        assert await job == [i * i for i in range(7)]  # the answers in the items' order
        assert peak == 3

    asyncio.run(body())


def test_fan_in_raises_the_first_failure_itself_and_ends_the_rest() -> None:
    async def body() -> None:
        others = [Probe(), Probe()]

        async def work(i: int) -> None:
            if i < 2:
                await others[i].forever()
            await asyncio.gather(*(p.started.wait() for p in others))
            raise OSError(f"item {i} failed")

        with pytest.raises(OSError, match="item 2 failed"):
            await fan_in(range(10), 3, work)
        assert all(p.cancelled.is_set() and p.ended.is_set() for p in others)

    asyncio.run(body())


def test_fan_in_of_nothing_and_a_bad_limit() -> None:
    async def double(i: int) -> int:
        return 2 * i

    assert asyncio.run(fan_in([], 4, double)) == []
    assert asyncio.run(fan_in([1, 2], 8, double)) == [2, 4]  # more slots than items
    with pytest.raises(ValueError, match="at least 1"):
        asyncio.run(fan_in([1], 0, double))
