"""The engine's one stop signal: a level that only rises.

0: running. 1 (`GRACEFUL`): a first stop request, a resource's `exit`, a
one-shot run converged: the engine's shutdown begins at its next turn (a run that
became due in this one still starts); from then no run starts, and in-flight
applies may finish for the stop grace. 2 (`HARD`): a second request or `--max-runtime`: in-flight
applies are cancelled too. Everything else about stopping (the run's wait, the
shutdown, whether a failure is retried) derives from this level; the engine's
tasks themselves end by cancellation of their TaskGroup.
"""

from __future__ import annotations

import asyncio

RUNNING = 0
GRACEFUL = 1
HARD = 2


class StopSignal:
    def __init__(self) -> None:
        self.level = RUNNING
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def raise_to(self, level: int) -> None:
        """Raise the level to `level` (never lowers it) and wake who waits for it."""
        if level <= self.level:
            return
        self.level = level
        keep: list[tuple[int, asyncio.Future[None]]] = []
        for want, fut in self._waiters:
            if want <= level:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((want, fut))
        self._waiters = keep

    async def wait(self, level: int = GRACEFUL) -> None:
        """Return once the level is at least `level`."""
        if self.level >= level:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((level, fut))
        try:
            await fut
        finally:
            if not fut.done():
                fut.cancel()
                self._waiters = [(w, f) for w, f in self._waiters if f is not fut]
