"""kv: a key in the World, shared with every host.

The World key is `kv/<key>`; with `mapped`, each host writes its own
`kv/<key>/<hostname>` (e.g. "which version does each host run"). Without a
`value` the key is deleted, as in mgmt; with `readonly` the resource only
reads: it sends the stored value to its children.

A `value` received from a sender that marks it secret (a `password`) is
stored sealed with this host's key, never in plain text: the World holds
`sealed:local:` followed by the token, so any reader knows it is sealed and
only this host opens it. Reading a sealed value back on this host gives the
secret (sent on as a secret); a sealed value this host cannot open is sent as
nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from evergraph.engine.contract import Handle, Resource, doc, register, watch_snapshots
from evergraph.errors import ResourceError
from evergraph.world.follow import watch_one

PREFIX = "kv/"
#: how a sealed value starts in the World (then the host-key token, base64)
SEALED = b"sealed:local:"


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
    value: Annotated[
        str | None, doc("the value to store; unset = delete the key (unless readonly)")
    ] = None
    mapped: Annotated[bool, doc("per host: the key is kv/<key>/<hostname>")] = False
    skiplessthan: Annotated[
        bool, doc("numbers: never lower the stored value (keep a larger one)")
    ] = False
    readonly: Annotated[
        bool, doc("only read the key and send its value; never write nor delete it")
    ] = False

    def validate(self) -> None:
        key = self.key or self.name
        if not key or key.startswith("/") or "\0" in key:
            raise self.bad("key", f"{key!r} must be a non-empty relative key without NUL")
        if self.skiplessthan and self.value is not None and _number(self.value) is None:
            raise self.bad("value", f"{self.value!r} is not a number (skiplessthan is set)")
        if self.readonly and self.value is not None:
            raise self.bad("value", "cannot be written by a readonly kv: drop one of them")

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        key = self.key or self.name
        self._key = f"{PREFIX}{key}/{handle.hostname}" if self.mapped else f"{PREFIX}{key}"
        self._stored: str | None = None
        #: the stored value was sealed (so what we send of it is a secret)
        self._sealed = False

    def sent(self) -> dict[str, object]:
        return {"value": self._stored} if self._stored is not None else {}

    def secret_sent(self) -> frozenset[str]:
        return frozenset({"value"}) if self._sealed else frozenset()

    def _open(self, raw: bytes) -> str | None:
        """The stored text (a sealed one opened); None when it cannot be read here."""
        self._sealed = raw.startswith(SEALED)
        if self._sealed:
            try:
                raw = self.handle.keys.open_local(raw[len(SEALED) :])
            except Exception:  # keys.KeyError_: sealed by another host
                return None
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return None

    async def watch(self) -> None:
        # watch_one: resumes a broken stream, re-reads after a compaction or a
        # replaced World; the first snapshot is the state as the watch starts
        await watch_snapshots(self.handle, watch_one(self.handle.world, self._key))

    async def check_apply(self, apply: bool) -> bool:
        kv = self.handle.world
        refresh = self.handle.refresh()
        item = await kv.get(self._key)
        self._sealed = False
        stored = self._open(item.value) if item is not None else None
        self._stored = stored
        secret = self.handle.is_secret("value")  # then it is stored only sealed
        if self.readonly or (item is None and self.value is None):
            return True
        if self.value is None:
            return await self._delete(apply)
        if stored == self.value and (self._sealed or not secret) and not refresh:
            return True
        if self.skiplessthan and stored is not None:
            have, want = _number(stored), _number(self.value)
            if have is not None and want is not None and have >= want and not refresh:
                return True
        # a sealed value is a secret: never shown (nor is `value` received as one)
        if item is None:
            old = None
        elif self._sealed:
            old = "(sealed)"
        else:
            old = "(not text)" if stored is None else stored
        self.handle.changed("value", old, self.value)
        if not apply:
            return False
        data = self.value.encode()
        if secret:
            data = SEALED + self.handle.keys.seal_local(data)
        try:
            await kv.put(self._key, data)
        except Exception as e:
            raise ResourceError(f"world: {e}") from None
        self._stored, self._sealed = self.value, secret
        return False

    async def _delete(self, apply: bool) -> bool:
        """No value: the key goes (mgmt's meaning of a kv without one)."""
        shown = "(not text)" if self._stored is None else self._stored
        self.handle.changed("value", "(sealed)" if self._sealed else shown, None)
        if not apply:
            return False
        try:
            await self.handle.world.delete(self._key)
        except Exception as e:
            raise ResourceError(f"world: {e}") from None
        self._stored, self._sealed = None, False
        return False
