"""Time, injected: the engine, TTLs, deadlines and timers ask a Clock, so tests can
run them on virtual time instead of sleeping (`evergraph.testing.clock.FakeClock`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol


class Timer(Protocol):
    """A callback armed by `Clock.call_later`."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (intervals, deadlines)."""
        ...

    def time(self) -> float:
        """Seconds since the epoch (records, RFC 3339 times)."""
        ...

    async def sleep(self, seconds: float) -> None: ...

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Timer:
        """Call `callback` (in the running loop) once `seconds` have passed."""
        ...

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[Any]:
        """Like `asyncio.timeout`: the block is cancelled after `seconds` and
        TimeoutError raised (None: no bound)."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(seconds, callback)

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[Any]:
        return asyncio.timeout(seconds)


SYSTEM = SystemClock()
