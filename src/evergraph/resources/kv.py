"""kv: a key in the World, shared with every host.

The World key is `kv/<key>`; with `mapped`, each host writes its own
`kv/<key>/<hostname>` (e.g. "which version does each host run"). Without a
`value`, the resource only reads: it sends the stored value to its children.
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Any, ClassVar

from evergraph.engine.contract import Handle, Resource, doc, register
from evergraph.errors import ResourceError
from evergraph.world.follow import watch_one

PREFIX = "kv/"


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


@register("kv")
class KeyValue(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A World key (`kv/<key>`): writes `value`, sends the stored value; watched live."""

    sends: ClassVar[dict[str, Any]] = {"value": str}

    key: Annotated[str, doc("the key under kv/; default the name")] = ""
    value: Annotated[str | None, doc("the value to store; unset = read only (sends it)")] = None
    mapped: Annotated[bool, doc("per host: the key is kv/<key>/<hostname>")] = False
    skiplessthan: Annotated[
        bool, doc("numbers: never lower the stored value (keep a larger one)")
    ] = False

    def validate(self) -> None:
        key = self.key or self.name
        if not key or key.startswith("/") or "\0" in key:
            raise self.bad("key", f"{key!r} must be a non-empty relative key without NUL")
        if self.skiplessthan and self.value is not None and _number(self.value) is None:
            raise self.bad("value", f"{self.value!r} is not a number (skiplessthan is set)")

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        key = self.key or self.name
        self._key = f"{PREFIX}{key}/{handle.hostname}" if self.mapped else f"{PREFIX}{key}"
        self._stored: str | None = None

    def sent(self) -> dict[str, object]:
        return {"value": self._stored} if self._stored is not None else {}

    async def watch(self) -> None:
        # watch_one: resumes a broken stream, re-reads after a compaction or a
        # replaced World; the first snapshot is the state as the watch starts
        first = True
        async with contextlib.aclosing(watch_one(self.handle.world, self._key)) as snaps:
            async for _snap in snaps:
                if first:
                    first = False
                    self.handle.ready()
                else:
                    self.handle.event()

    async def check_apply(self, apply: bool) -> bool:
        kv = self.handle.world
        refresh = self.handle.refresh()
        item = await kv.get(self._key)
        stored = None
        if item is not None:
            with contextlib.suppress(UnicodeDecodeError):
                stored = item.value.decode()
        self._stored = stored
        if self.value is None or (stored == self.value and not refresh):
            return True
        if self.skiplessthan and stored is not None:
            have, want = _number(stored), _number(self.value)
            if have is not None and want is not None and have >= want and not refresh:
                return True
        if not apply:
            return False
        try:
            await kv.put(self._key, self.value.encode())
        except Exception as e:
            raise ResourceError(f"world: {e}") from None
        self._stored = self.value
        return False
