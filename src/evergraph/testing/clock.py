"""A fake clock, advanced by hand: time stands still until a test moves it.

`FakeClock` implements `evergraph._util.clock.Clock`, so the engine (retry
delays, repair backoff, polls, timeouts, the converger), the World leases and
the farm can run on it: a test arms a timer, checks that nothing happened yet,
then `await clock.advance(seconds)` fires every timer and sleeper that falls
due, in the order of their deadlines, at their own virtual time.

Timers due at once (`call_later(0, ...)`, `sleep(0)`) do not wait for an
advance: they take the loop's next turn, as on the real clock, so code that only
yields never needs one.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from evergraph._util.clock import Timer

__all__ = ["FakeClock"]

#: loop turns given to the tasks a fired timer woke, before the next one fires
_TURNS = 8
#: a deadline this close past an advance's end is due in it: `advance(0.09)` then
#: `advance(0.01)` reaches a 0.1 s timer, whatever the float sums say
_EPSILON = 1e-9


class _Timer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Virtual time. `monotonic()` starts at `start`; `time()` is `epoch` plus the
    virtual seconds passed."""

    def __init__(self, start: float = 0.0, epoch: float = 1_700_000_000.0) -> None:
        self._now = start
        self._epoch = epoch - start
        self._heap: list[tuple[float, int, _Timer]] = []
        self._seq = itertools.count()

    # -- Clock ----------------------------------------------------------------
    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._epoch + self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        timer = self.call_later(seconds, wake)
        try:
            await fut
        finally:
            timer.cancel()

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Timer:
        if seconds <= 0:  # due now: the loop's next turn, no advance needed
            return asyncio.get_running_loop().call_soon(callback)
        timer = _Timer(self._now + seconds, callback)
        heapq.heappush(self._heap, (timer.when, next(self._seq), timer))
        return timer

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[Any]:
        return self._timeout(seconds)

    @contextlib.asynccontextmanager
    async def _timeout(self, seconds: float | None) -> AsyncIterator[None]:
        if seconds is None:
            yield
            return
        task = asyncio.current_task()
        assert task is not None, "timeout() outside a task"
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = self.call_later(seconds, expire)
        try:
            yield
        except asyncio.CancelledError:
            if expired and task.uncancel() == 0:
                raise TimeoutError from None
            raise
        finally:
            timer.cancel()

    # -- driving it -------------------------------------------------------------
    def waiting(self) -> int:
        """How many timers and sleepers are armed (not yet due, not cancelled)."""
        return sum(1 for _, _, t in self._heap if not t.cancelled)

    def next_deadline(self) -> float | None:
        """The virtual time of the next armed timer (None: none is)."""
        self._drop_cancelled()
        return self._heap[0][0] if self._heap else None

    async def advance(self, seconds: float) -> None:
        """Move time on by `seconds`: every timer due meanwhile fires at its own
        deadline, earliest first, and the tasks it woke get a few loop turns
        before the next one fires (so a timer armed by one of them in the window
        fires in it too)."""
        if seconds < 0:
            raise ValueError("time does not go back")
        target = self._now + seconds
        await self._turns()
        while True:
            self._drop_cancelled()
            if not self._heap or self._heap[0][0] > target + _EPSILON:
                break
            when, _, timer = heapq.heappop(self._heap)
            self._now = max(self._now, when)
            timer.callback()
            await self._turns()
        self._now = max(self._now, target)
        await self._turns()

    async def advance_to_next(self) -> float:
        """Advance to the next armed timer's deadline and fire it; returns the
        seconds advanced (0.0 if nothing was armed)."""
        deadline = self.next_deadline()
        if deadline is None:
            return 0.0
        step = max(0.0, deadline - self._now)
        await self.advance(step)
        return step

    def _drop_cancelled(self) -> None:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)

    @staticmethod
    async def _turns() -> None:
        for _ in range(_TURNS):
            await asyncio.sleep(0)
