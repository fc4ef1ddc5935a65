"""What the in-process engine tests share: waiting on a condition while the
engine runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(cond: Callable[[], bool], timeout: float = 5) -> None:
    """Yield to the engine until `cond` holds (a condition, not a sleep)."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.001)
