"""Sweeping the leftovers of interrupted writes beside a managed file, once per
path in a run, with the directory listings of one turn of the event loop shared.

Leftovers come from a process killed mid-write, not from this run (a failed write
removes its own), so a vertex started again for the same path (a swap: a
collector's changed export) does not list its directory again (10k collected files
share one: ~5 ms a change). And the inits of a swap (a thousand between two yields)
share one listing of each directory, with no stat of it per file; nothing of ours
runs between them that could leave a leftover (only a kill does).

`Sweeps` is a service (`handle.services.get(Sweeps)`): one per agent, so "once in
a run" means once in that agent's life.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from evergraph._util.atomic import sweep_leftovers_of

if TYPE_CHECKING:
    from asyncio import AbstractEventLoop


class Sweeps:
    """The paths swept in this run, and this loop turn's directory listings."""

    def __init__(self) -> None:
        self._swept: set[str] = set()
        self._listed: dict[str, dict[str, list[str]]] = {}
        self._turn = False
        #: asyncio's `get_running_loop`, looked up at the first sweep (10k inits)
        self._loop: Callable[[], AbstractEventLoop] | None = None

    def _end_turn(self) -> None:
        self._listed.clear()
        self._turn = False

    def sweep(self, path: str) -> list[str]:
        """`sweep_leftovers_of(path)` with this turn's listings (outside a loop: its
        own), once per path in the run; the leftovers removed."""
        running_loop = self._loop
        if running_loop is None:
            import asyncio  # (loaded by then: inits run in its loop)

            running_loop = self._loop = asyncio.get_running_loop
        try:
            loop = running_loop()
        except RuntimeError:
            return sweep_leftovers_of(path)  # (no turn to end: nothing kept)
        swept = self._swept
        if path in swept:
            return []
        swept.add(path)
        if not self._turn:
            self._turn = True
            loop.call_soon(self._end_turn)
        return sweep_leftovers_of(path, self._listed)
