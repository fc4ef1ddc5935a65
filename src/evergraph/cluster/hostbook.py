"""The keys this host may use for other hosts: `hostkeys/<host>` records in the
World, each checked against this host's pins (cluster/pins.py) by a `HostKeyBook`,
so a swapped key in the World is refused, never used to seal or to verify; the
book also defends this host's own record (a changed or deleted one is put back).
Exports (cluster/exports/) seal to and verify with the keys it trusts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from evergraph.cluster.hostkeys import HostKeys, fingerprint
from evergraph.cluster.pins import IdentityMismatch, Pins, PinsError, fingerprint_of
from evergraph.world.follow import Follower, follow
from evergraph.world.kv import KV, KeyValue, WorldError

log = logging.getLogger("evergraph.exports")

HOSTKEYS = "hostkeys/"


class HostKeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    public: str
    verify: str


_keys_decoder = msgspec.json.Decoder(HostKeyRecord)


def decode_hostkeys(kv: KeyValue) -> HostKeyRecord:
    """The record at `hostkeys/<host>`; ValueError (naming the key) for a bad one."""
    try:
        rec = _keys_decoder.decode(kv.value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{kv.key}: not a host key record: {e}") from None
    if f"{HOSTKEYS}{rec.host}" != kv.key:
        raise ValueError(f"{kv.key}: record names another host {rec.host!r}")
    return rec


class HostKeyBook(Follower[HostKeyRecord]):
    """The keys this host may use for others: `hostkeys/<host>` records as the World
    has them, each checked against the pins. The first key seen for a host is
    pinned; a different one is refused with one error naming the host and both
    fingerprints (once per change of the record), and the pinned key stays in use.

    `trusted(host)` is the (public, verify) pair to seal for and verify with, or
    None. Listeners are called when a host's trusted key may have changed.

    Given this host's `own` keys, the book also defends `hostkeys/<me>`: a record
    that names another key, is garbage or is deleted is put back at once, with one
    error naming what was found (so a host that joins later pins the real key
    while this one is up)."""

    def __init__(self, kv: KV, pins: Pins, me: str, own: HostKeys | None = None) -> None:
        self.kv = kv
        self.pins = pins
        self.me = me
        self.own = own
        #: set when our own record must be written again
        self._restore = asyncio.Event()
        #: how many times our own record was found changed or gone (tests)
        self.alarms = 0
        #: host -> the record the World has now
        self.seen: dict[str, HostKeyRecord] = {}
        self._listeners: list[Callable[[str], None]] = []
        self.ready = asyncio.Event()
        #: records of the batch being reported, pinned at its end
        self._batch: list[HostKeyRecord] = []
        # a pin trusted or forgotten by the operator: verify that host's records again
        pins.listen(self._pins_changed)

    def _pins_changed(self, hosts: frozenset[str], deployers: bool) -> None:
        for host in sorted(hosts):
            if host != self.me:
                self._tell(host)

    def listen(self, fn: Callable[[str], None]) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    async def run(self) -> None:
        if self.own is None:
            await follow(self.kv, HOSTKEYS, self)
            return
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow(self.kv, HOSTKEYS, self))
            tg.create_task(self._defend(self.own))

    async def _defend(self, own: HostKeys) -> None:
        delay = 0.05
        while True:
            await self._restore.wait()
            self._restore.clear()
            try:
                await publish_hostkeys(self.kv, own, self.me, alarm=False)
                delay = 0.05
            except WorldError as e:
                log.warning(
                    "hostkeys/%s: cannot restore (%s); retrying in %.2fs", self.me, e, delay
                )
                self._restore.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _alarm(self, found: HostKeyRecord | None) -> None:
        assert self.own is not None
        self.alarms += 1
        ours = fingerprint_of(f"{self.own.public}:{self.own.verify}")
        if found is None:
            log.error(
                "ALARM: hostkeys/%s was deleted or replaced by garbage behind this host's "
                "back; restoring this host's key %s",
                self.me,
                ours,
            )
        else:
            log.error(
                "ALARM: hostkeys/%s names key %s, not this host's %s: someone else wrote it; "
                "restoring this host's key",
                self.me,
                fingerprint_of(f"{found.public}:{found.verify}"),
                ours,
            )
        self._restore.set()

    def trusted(self, host: str) -> tuple[str, str] | None:
        """The pinned (public, verify) of `host`; pins the World's record on first use."""
        try:
            pin = self.pins.get(host)
            if pin is not None:
                return pin.public, pin.verify
            rec = self.seen.get(host)
            if rec is None:
                return None
            pin = self.pins.check(host, rec.public, rec.verify)
            log.info("pinned the key of host %s: %s", host, fingerprint(rec.verify))
            return pin.public, pin.verify
        except PinsError as e:
            log.error("%s", e)
            return None
        except IdentityMismatch:  # a pin appeared meanwhile (another process)
            return self.trusted(host)

    # follower callbacks: a batch's records are pinned together (one write of the
    # pins file for a first read of N hosts), then the listeners are told
    def decode(self, kv: KeyValue) -> HostKeyRecord:
        return decode_hostkeys(kv)

    async def new(self, obj: HostKeyRecord) -> None:
        own = self.own
        if obj.host == self.me and own is not None and (obj.public, obj.verify) != own.pair():
            self._alarm(obj)
        self.seen[obj.host] = obj
        self._batch.append(obj)

    async def updated(self, prev: HostKeyRecord, new: HostKeyRecord) -> None:
        await self.new(new)

    async def deleted(self, prev: HostKeyRecord) -> None:
        self.seen.pop(prev.host, None)
        if prev.host == self.me and self.own is not None:
            self._alarm(None)

    async def batch_done(self) -> None:
        batch, self._batch = self._batch, []
        others = [(r.host, r.public, r.verify) for r in batch if r.host != self.me]
        try:
            for e in self.pins.check_many(others):
                log.error("hostkeys/%s: %s", e.host, e)
        except PinsError as e:
            log.error("%s", e)
        for rec in batch:
            self._tell(rec.host)

    async def synced(self) -> None:
        self.ready.set()

    def _tell(self, host: str) -> None:
        for fn in list(self._listeners):
            fn(host)


async def publish_hostkeys(kv: KV, keys: HostKeys, host: str, alarm: bool = True) -> None:
    """Write `hostkeys/<host>` (no lease: a down host's exports stay verifiable).
    `alarm`: log an error if the World held another key for this host."""
    rec = HostKeyRecord(host=host, public=keys.public, verify=keys.verify)
    cur = await kv.get(f"{HOSTKEYS}{host}")
    value = msgspec.json.encode(rec)
    if cur is None or cur.value != value:
        if alarm and cur is not None:
            try:
                found = decode_hostkeys(cur)
                what = fingerprint_of(f"{found.public}:{found.verify}")
                same = (found.public, found.verify) == (keys.public, keys.verify)
            except ValueError:
                what, same = "(not a host key record)", False
            if not same:
                log.error(
                    "ALARM: hostkeys/%s named key %s, not this host's %s: someone else "
                    "wrote it; restoring this host's key",
                    host,
                    what,
                    fingerprint_of(f"{keys.public}:{keys.verify}"),
                )
        await kv.put(f"{HOSTKEYS}{host}", value)
