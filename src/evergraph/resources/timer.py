"""timer: changes once every `interval` seconds, so notify edges fire on a schedule.

Pair it with `notify: true` to an exec with `refresh_only: true` for "run this
every N seconds" that still obeys the graph's order. A refresh of the timer
itself restarts its interval.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from evergraph.engine.contract import Handle, Resource, doc, register, seconds_problem


@register("timer")
class Timer(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Ticks every `interval` seconds; each tick counts as a change (notifies children)."""

    interval: Annotated[float, doc("seconds between ticks (0.001 to a year)")] = 0

    def validate(self) -> None:
        if why := seconds_problem(self.interval):
            raise self.bad("interval", why)

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._ticked = False
        self._restart = asyncio.Event()

    async def watch(self) -> None:
        self.handle.ready()
        while True:
            try:
                async with asyncio.timeout(self.interval):
                    await self._restart.wait()  # a refresh restarts the interval
                self._restart.clear()
            except TimeoutError:
                self._ticked = True
                self.handle.event()

    async def check_apply(self, apply: bool) -> bool:
        if self.handle.refresh():
            self._restart.set()
        if not self._ticked:
            return True
        self.handle.changed("tick", None, f"{self.interval:g} s elapsed")
        if apply:
            self._ticked = False
        return False
