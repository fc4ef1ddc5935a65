"""The World's own id record, `world/id`: which World a client talks to.

A backend notices most replacements by itself (world/kv.py): a new etcd
cluster id, a revision lower than one seen, a new `world.sqlite` file. It
cannot notice an etcd replaced under the same cluster id whose revision is
already past what a client saw (a suspended host resumes into a World that
lost its deletions), nor a backup restored in place that others wrote past
before this client read it. So the World carries its own id:

    world/id   JSON {"id": random, "epoch": n, "created": seconds}

written by the first agent of a World (create-if-absent), read by every agent
when it joins and on every keep-alive after. A record other than the one
known (changed, or gone) means another World: the client counts a new epoch
(`KV.mark_replaced`), and its followers re-read everything, comparing by
content. A client whose backend found the World replaced while the record is
still the one it knew (a restored backup holds the same record) bumps the
record's `epoch`, so that every other client finds it changed too.

Anyone who can write the World can change the record, and so make agents
re-publish what they own: a resync, never a loss.
"""

from __future__ import annotations

import time

import msgspec

from evergraph.world.kv import KV, KeyValue

WORLD_ID = "world/id"


class WorldIdRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    id: str
    epoch: int = 1
    created: float = 0.0


_decoder = msgspec.json.Decoder(WorldIdRecord)


def describe(item: KeyValue | None) -> str:
    """The record as a short phrase for messages."""
    if item is None:
        return "none"
    try:
        rec = _decoder.decode(item.value)
    except msgspec.DecodeError:
        return "not a World id record"
    return f"{rec.id} epoch {rec.epoch}"


class WorldIdentity:
    """What one client knows of `world/id`; `check()` compares it with the World."""

    def __init__(self, kv: KV) -> None:
        self.kv = kv
        #: the record as last seen (None: never read)
        self.known: KeyValue | None = None
        self._epoch = kv.epoch

    async def check(self) -> str | None:
        """Read `world/id`: the reason the World is another than the one known (the
        client's epoch is then counted anew), or None. Creates the record in a
        World without one; bumps its epoch when this client's backend found the
        World replaced but the record is the one known (see the module doc)."""
        backend_noticed = self.kv.epoch != self._epoch
        self._epoch = self.kv.epoch
        why: str | None = None
        for _ in range(10):
            cur = await self.kv.get(WORLD_ID)
            if cur is None:
                new = WorldIdRecord(id=_new_id(), created=time.time())
                if not await self.kv.cas(WORLD_ID, msgspec.json.encode(new), expect=0):
                    continue  # another client made it first: read theirs
                cur = await self.kv.get(WORLD_ID)
                if cur is None:
                    continue
                if self.known is not None and not backend_noticed:
                    why = f"its {WORLD_ID} record ({describe(self.known)}) vanished"
            elif self.known is not None and cur.value != self.known.value:
                if not backend_noticed:
                    why = (
                        f"its {WORLD_ID} record changed from {describe(self.known)} "
                        f"to {describe(cur)}"
                    )
            elif self.known is not None and backend_noticed:
                # the record we knew, in a World the backend says is another: a copy
                # of this World (a restored backup); tell every other client
                try:
                    rec = _decoder.decode(cur.value)
                    bumped = msgspec.structs.replace(rec, epoch=rec.epoch + 1)
                except msgspec.DecodeError:
                    bumped = WorldIdRecord(id=_new_id(), created=time.time())
                if not await self.kv.cas(
                    WORLD_ID, msgspec.json.encode(bumped), expect=cur.mod_revision
                ):
                    continue  # changed meanwhile (another client bumped it): read again
                cur = await self.kv.get(WORLD_ID)
                if cur is None:
                    continue
            self.known = cur
            break
        if why is not None:
            self.kv.mark_replaced(why)
            self._epoch = self.kv.epoch
        return why


def _new_id() -> str:
    """A new World's id (`secrets` loads only here: a run joining its World never
    makes one, and `secrets` costs `hmac` and `hashlib` at import)."""
    import secrets

    return secrets.token_hex(8)
