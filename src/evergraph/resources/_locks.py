"""Named locks the resources of one agent share: a file that several resources
edit (ssh_authorized_key), tools that must run one at a time (shadow-utils).

`Locks` is a service (`handle.services.get(Locks)`): one per agent, so a lock is
never shared with another run's event loop. A lock nobody holds or waits for is
forgotten (weak values): the next asker makes a fresh one."""

from __future__ import annotations

import asyncio
import weakref


class Locks:
    """asyncio locks by name, made on first use."""

    def __init__(self) -> None:
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def lock(self, name: str) -> asyncio.Lock:
        found = self._locks.get(name)
        if found is None:
            found = self._locks[name] = asyncio.Lock()
        return found
