"""Services: the process-wide state of kinds, given an owner.

Some kinds share something between their resources: one D-Bus connection per
bus (svc, cron), one lock per file that several resources edit (ssh:key,
users), the thread that makes file writes durable (file), the package backend
chosen once (pkg). Kept in module globals, such state outlives the run that
made it, and a cache keyed by event loop is a guess at whose it is. Here it
belongs to a `Services` registry that the agent creates and closes (an engine
built without one makes its own and closes it when its run ends); a resource
reaches it through `handle.services`:

    bus = handle.services.get(SystemdBuses)          # made on first use
    lock = handle.services.get(FileLocks).lock(path)

A service is any class whose constructor takes the key's parts (none for a
singleton). `aclose()` closes the services in the reverse order of their
creation, each by its `aclose()` coroutine or its `close()` method if it has
one; a service made after that is refused.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Hashable
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


class Services:
    """Get-or-create registry of per-agent services, closed in reverse order."""

    def __init__(self) -> None:
        self._made: dict[tuple[type[Any], tuple[Hashable, ...]], object] = {}
        self._closed = False

    def get(self, cls: type[T], *key: Hashable) -> T:
        """The `cls` service for `key` (`cls(*key)`, made on first use)."""
        k = (cls, key)
        found = self._made.get(k)
        if found is None:
            if self._closed:
                raise RuntimeError(f"services are closed: cannot start {cls.__name__}")
            found = self._made[k] = cls(*key)
        return found  # type: ignore[return-value]

    def find(self, cls: type[T], *key: Hashable) -> T | None:
        """The `cls` service for `key` if one was made, else None."""
        return self._made.get((cls, key))  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._made)

    async def aclose(self) -> None:
        """Close every service, the last made first; one failing to close is logged
        and the others are closed still."""
        self._closed = True
        while self._made:
            _k, service = self._made.popitem()  # (dicts pop the last inserted)
            try:
                aclose = getattr(service, "aclose", None)
                if aclose is not None:
                    result = aclose()
                    if inspect.isawaitable(result):
                        await result
                    continue
                close = getattr(service, "close", None)
                if close is not None:
                    close()
            except Exception:
                log.exception("closing the %s service failed", type(service).__name__)
