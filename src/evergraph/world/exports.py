"""Exported resources: records `exported/<to>/<from>/<kind>/<name>` in the World.

A record holds the resource's parameters as JSON. Directed exports (to one
host) are sealed to the target's public key, so no other host can read them;
every record is signed by the exporter over its routing fields and payload,
so nobody can forge or alter one. A record that fails any check is rejected
with a warning naming its key, never applied.

`to` is a hostname or `*` (every host; signed, not encrypted).

Identities come from `hostkeys/<host>` only through a `HostKeyBook`, which
checks them against this host's pins (world/pins.py): a swapped key in the
World is refused, never used to seal or to verify.

`Publisher` keeps this host's records level-triggered: it holds the set the
graph wants and reconciles the World to it until the World acknowledges (a
change made during an outage is published when the World returns), every
record under the agent's lease. `Collector` follows `exported/<host>/` and
`exported/*/` with `follow()`: one change costs one record verified, and no
record is missed between the first read and the watch.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, unquote

import msgspec

from evergraph.world.follow import Follower, follow
from evergraph.world.hostkeys import HostKeys, KeyError_, fingerprint
from evergraph.world.kv import KV, KeyValue, WorldError
from evergraph.world.pins import IdentityMismatch, Pins, PinsError

log = logging.getLogger("evergraph.exports")

EXPORTED = "exported/"
EVERYONE = "*"
HOSTKEYS = "hostkeys/"
#: seconds between full checks of this host's records in the World (anti-entropy:
#: a record deleted or altered by someone else is put back)
RECHECK = 30.0


class ExportRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    v: int = 1
    src: str
    to: str
    kind: str
    name: str
    sealed: bool
    #: base64: the JSON parameters, sealed to `to` when `sealed`
    payload: str
    #: base64 Ed25519 signature by `src` over `signed_bytes(...)`
    sig: str


class Exported(msgspec.Struct, frozen=True):
    """A checked, readable export. (A Struct: a dataclass's generated methods are
    compiled at import.)"""

    src: str
    to: str
    kind: str
    name: str
    params: dict[str, Any]


_decoder = msgspec.json.Decoder(ExportRecord)


def export_key(to: str, src: str, kind: str, name: str) -> str:
    return f"{EXPORTED}{to}/{src}/{kind}/{quote(name, safe='')}"


def _signed_bytes(src: str, to: str, kind: str, name: str, payload: bytes) -> bytes:
    head = msgspec.json.encode([src, to, kind, name])
    return head + b"\n" + payload


def make_record(
    keys: HostKeys,
    src: str,
    to: str,
    kind: str,
    name: str,
    params: dict[str, Any],
    target_public: str | None,
) -> bytes:
    """The record's bytes; `target_public` is required for a directed export."""
    body = msgspec.json.encode(params)
    if to != EVERYONE:
        if not target_public:
            raise KeyError_(f"no public key known for host {to!r}")
        body = keys.seal_to(target_public, body)
    rec = ExportRecord(
        src=src,
        to=to,
        kind=kind,
        name=name,
        sealed=to != EVERYONE,
        payload=base64.b64encode(body).decode(),
        sig=base64.b64encode(keys.sign(_signed_bytes(src, to, kind, name, body))).decode(),
    )
    return msgspec.json.encode(rec)


def parse_key(key: str) -> tuple[str, str, str, str] | None:
    """(to, src, kind, name) of a record key, or None if it is not one."""
    parts = key[len(EXPORTED) :].split("/") if key.startswith(EXPORTED) else []
    if len(parts) != 4 or not all(parts):
        return None
    return parts[0], parts[1], parts[2], unquote(parts[3])


def open_record(keys: HostKeys, me: str, item: KeyValue, verify_key: str | None) -> Exported:
    """Check and read an export meant for `me`; ValueError with the reason otherwise.

    `verify_key` is the exporter's signature key (from its host key record).
    """
    where = parse_key(item.key)
    if where is None:
        raise ValueError(f"{item.key}: not an export key")
    try:
        rec = _decoder.decode(item.value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{item.key}: not an export record: {e}") from None
    if (rec.to, rec.src, rec.kind, rec.name) != where:
        raise ValueError(f"{item.key}: record does not match its key (moved or forged)")
    if rec.to not in (me, EVERYONE):
        raise ValueError(f"{item.key}: meant for {rec.to!r}, not this host")
    if rec.sealed != (rec.to != EVERYONE):
        raise ValueError(f"{item.key}: a directed export must be sealed")
    if not verify_key:
        raise ValueError(f"{item.key}: no key known for exporter {rec.src!r}")
    try:
        body = base64.b64decode(rec.payload, validate=True)
        sig = base64.b64decode(rec.sig, validate=True)
    except ValueError:
        raise ValueError(f"{item.key}: payload or signature is not base64") from None
    signed = _signed_bytes(rec.src, rec.to, rec.kind, rec.name, body)
    if not HostKeys.check_signature(verify_key, signed, sig):
        raise ValueError(f"{item.key}: bad signature: not signed by {rec.src!r}")
    if rec.sealed:
        try:
            body = keys.unseal(body)
        except KeyError_ as e:
            raise ValueError(f"{item.key}: {e}") from None
    try:
        params = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise ValueError(f"{item.key}: parameters are not JSON: {e}") from None
    if not isinstance(params, dict):
        raise ValueError(f"{item.key}: parameters are not an object")
    return Exported(rec.src, rec.to, rec.kind, rec.name, params)


# -- identities ------------------------------------------------------------------------


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
    None. Listeners are called when a host's trusted key may have changed."""

    def __init__(self, kv: KV, pins: Pins, me: str) -> None:
        self.kv = kv
        self.pins = pins
        self.me = me
        #: host -> the record the World has now
        self.seen: dict[str, HostKeyRecord] = {}
        self._listeners: list[Callable[[str], None]] = []
        self.ready = asyncio.Event()
        #: records of the batch being reported, pinned at its end
        self._batch: list[HostKeyRecord] = []

    def listen(self, fn: Callable[[str], None]) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    async def run(self) -> None:
        await follow(self.kv, HOSTKEYS, self)

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
        self.seen[obj.host] = obj
        self._batch.append(obj)

    async def updated(self, prev: HostKeyRecord, new: HostKeyRecord) -> None:
        await self.new(new)

    async def deleted(self, prev: HostKeyRecord) -> None:
        self.seen.pop(prev.host, None)

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


async def publish_hostkeys(kv: KV, keys: HostKeys, host: str) -> None:
    """Write `hostkeys/<host>` (no lease: a down host's exports stay verifiable)."""
    rec = HostKeyRecord(host=host, public=keys.public, verify=keys.verify)
    cur = await kv.get(f"{HOSTKEYS}{host}")
    value = msgspec.json.encode(rec)
    if cur is None or cur.value != value:
        await kv.put(f"{HOSTKEYS}{host}", value)


# -- publishing ------------------------------------------------------------------------

#: (to, kind, name, params) of one export
ExportItem = tuple[str, str, str, dict[str, Any]]


class Publisher:
    """Keeps this host's export records in the World equal to the set it is given.

    Level-triggered: `set()` records what is wanted and wakes `run()`, which
    reconciles until the World acknowledged every put and delete; a World error
    is retried with backoff, so a change made during an outage is published when
    the World returns. Records are put under `lease()` (the agent's member
    lease): an agent that dies has its exports withdrawn within the TTL. After a
    restart every wanted record is put again under the new lease (collectors see
    equal parameters: no flap) and stale ones of the previous run are deleted.
    """

    def __init__(
        self,
        kv: KV,
        keys: HostKeys,
        host: str,
        book: HostKeyBook,
        lease: Callable[[], int],
    ) -> None:
        self.kv = kv
        self.keys = keys
        self.host = host
        self.book = book
        self.lease = lease
        self._want: dict[str, ExportItem] = {}
        self._sources: dict[str, list[ExportItem]] = {}
        #: key -> (params, lease, mod revision) as written by us
        self._written: dict[str, tuple[dict[str, Any], int, int]] = {}
        self._full = True  # the next pass reads the World (start, errors, regrant)
        #: the next pass reads our own records back by key (the periodic check: a
        #: read of all of exported/ every 30 s by every agent does not scale)
        self._recheck = False
        self._wake = asyncio.Event()
        #: set when the World holds exactly what is wanted (tests, --converged)
        self.acknowledged = asyncio.Event()
        #: targets whose key is missing or refused: waiting for the book
        self._waiting: set[str] = set()
        book.listen(self._key_changed)

    def set(self, exports: list[ExportItem], source: str = "graph") -> None:
        """What `source` (the graph; the farm's job keys) wants exported now."""
        self._sources[source] = exports
        want: dict[str, ExportItem] = {}
        for items in self._sources.values():
            for item in items:
                to, kind, name, _params = item
                want[export_key(to, self.host, kind, name)] = item
        self._want = want
        self.acknowledged.clear()
        self._wake.set()

    def resync(self) -> None:
        """Read the World again on the next pass (after a lease was re-granted)."""
        self._full = True
        self.acknowledged.clear()
        self._wake.set()

    def _key_changed(self, host: str) -> None:
        if host in self._waiting:
            self._wake.set()

    async def run(self) -> None:
        delay = 0.05
        while True:
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for swallows a
                # cancellation that comes as the event is set (the agent's stop
                # right after its graph's exports were set), and this loop then
                # waited 30 s more, holding the agent's exit
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(RECHECK):
                        await self._wake.wait()
                if not self._wake.is_set():
                    self._recheck = True  # periodic anti-entropy pass: our own keys
                self._wake.clear()
                await self._reconcile()
                delay = 0.05
            except WorldError as e:
                log.warning("world: cannot publish exports (%s); retrying in %.2fs", e, delay)
                self._full = True
                self._wake.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _mine_in_world(self) -> dict[str, KeyValue]:
        items, _ = await self.kv.range(EXPORTED)
        return {
            i.key: i for i in items if (w := parse_key(i.key)) is not None and w[1] == self.host
        }

    async def _mine_by_key(self, keys: list[str]) -> dict[str, KeyValue]:
        out: dict[str, KeyValue] = {}
        for key in keys:
            item = await self.kv.get(key)
            if item is not None:
                out[key] = item
        return out

    async def _reconcile(self) -> None:
        want = self._want
        lease = self.lease()
        if self._full or self._recheck:
            if self._full:  # everything of ours, also what an earlier run left
                world = await self._mine_in_world()
                stale = set(world) - want.keys()
            else:
                world = await self._mine_by_key(sorted(want.keys() | self._written.keys()))
                stale = set(self._written) - want.keys()
            written = self._written
            self._written = {
                k: v
                for k, v in written.items()
                if k in world and world[k].mod_revision == v[2] and world[k].lease == lease
            }
            self._full = self._recheck = False
        else:
            stale = set(self._written) - want.keys()
        for key in sorted(stale):
            await self.kv.delete(key)
            self._written.pop(key, None)
            log.info("export withdrawn: %s", key)
        waiting: set[str] = set()
        for key, (to, kind, name, params) in sorted(want.items()):
            done = self._written.get(key)
            if done is not None and done[0] == params and done[1] == lease:
                continue
            public = None
            if to != EVERYONE:
                pair = self.book.trusted(to)
                if pair is None:
                    if to not in self._waiting:
                        log.warning("export %s[%s] to %s waits for that host's key", kind, name, to)
                    waiting.add(to)
                    continue
                public = pair[0]
            try:
                value = make_record(self.keys, self.host, to, kind, name, params, public)
            except KeyError_ as e:
                log.error("export %s[%s] to %s: %s", kind, name, to, e)
                continue
            rev = await self.kv.put(key, value, lease=lease)
            self._written[key] = (params, lease, rev)
            log.info("exported %s[%s] to %s", kind, name, to)  # never the parameters
        self._waiting = waiting
        if not waiting and want is self._want and not self._wake.is_set():
            self.acknowledged.set()


# -- collecting ------------------------------------------------------------------------


class Collector(Follower[KeyValue]):
    """What other hosts export to this one, checked: follows `exported/<me>/` and
    `exported/*/`. Each changed record is verified (signature by the exporter's
    pinned key, sealed to us) once; a record that cannot be verified yet (its
    exporter's key unknown) is kept aside and verified when the key arrives.

    `current()` is the checked set, by World key; listeners are called after each
    batch that changed it."""

    def __init__(self, kv: KV, keys: HostKeys, host: str, book: HostKeyBook) -> None:
        self.kv = kv
        self.keys = keys
        self.host = host
        self.book = book
        self._items: dict[str, Exported] = {}
        #: records waiting for their exporter's key (by exporter)
        self._pending: dict[str, dict[str, KeyValue]] = {}
        self._raw: dict[str, KeyValue] = {}
        #: World keys of the records in `_raw`, by exporter (a key that arrives
        #: re-verifies its exporter's records: O(theirs), not O(all))
        self._by_src: dict[str, set[str]] = {}
        self._listeners: list[Callable[[], None]] = []
        self._synced = 0
        self.ready = asyncio.Event()
        self._dirty = False
        #: records verified (benchmarks: one change must cost one)
        self.verified = 0
        book.listen(self._key_changed)

    def current(self) -> list[Exported]:
        """The collected exports, in (kind, name, exporter) order."""
        return sorted(self._items.values(), key=lambda e: (e.kind, e.name, e.src))

    def listen(self, fn: Callable[[], None]) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow(self.kv, f"{EXPORTED}{self.host}/", self))
            tg.create_task(follow(self.kv, f"{EXPORTED}{EVERYONE}/", self))

    def _open(self, kv: KeyValue) -> None:
        where = parse_key(kv.key)
        if where is None or where[1] == self.host:
            return
        src = where[1]
        pair = self.book.trusted(src)
        if pair is None:
            self._pending.setdefault(src, {})[kv.key] = kv
            self._items.pop(kv.key, None)
            log.warning("export %s waits for the key of its exporter %s", kv.key, src)
            return
        self.verified += 1
        try:
            exp = open_record(self.keys, self.host, kv, pair[1])
        except ValueError as e:
            log.error("rejected export: %s", e)
            if self._items.pop(kv.key, None) is not None:
                self._dirty = True
            return
        if self._items.get(kv.key) != exp:
            self._items[kv.key] = exp
            self._dirty = True

    def _keep(self, kv: KeyValue) -> None:
        self._raw[kv.key] = kv
        if (where := parse_key(kv.key)) is not None:
            self._by_src.setdefault(where[1], set()).add(kv.key)

    def _forget(self, key: str) -> None:
        self._raw.pop(key, None)
        if (where := parse_key(key)) is not None:
            src = where[1]
            mine = self._by_src.get(src)
            if mine is not None:
                mine.discard(key)
                if not mine:
                    del self._by_src[src]
            waiting = self._pending.get(src)
            if waiting is not None:
                waiting.pop(key, None)
                if not waiting:
                    del self._pending[src]
        if self._items.pop(key, None) is not None:
            self._dirty = True

    def _key_changed(self, host: str) -> None:
        # a key that arrived (or a pin that changed): verify that exporter's records
        again = dict(self._pending.pop(host, {}))
        for k in self._by_src.get(host, ()):
            again[k] = self._raw[k]
        for kv in again.values():
            self._open(kv)
        self._notify()

    def _notify(self) -> None:
        if self._dirty and self.ready.is_set():
            self._dirty = False
            for fn in list(self._listeners):
                fn()

    # follower callbacks: the raw record; checks happen here, once per change
    async def new(self, obj: KeyValue) -> None:
        self._keep(obj)
        self._open(obj)

    async def updated(self, prev: KeyValue, new: KeyValue) -> None:
        self._keep(new)
        self._open(new)

    def equals(self, a: KeyValue, b: KeyValue) -> bool:
        return a.value == b.value

    async def deleted(self, prev: KeyValue) -> None:
        self._forget(prev.key)

    async def batch_done(self) -> None:
        self._notify()

    async def synced(self) -> None:
        self._synced += 1
        if self._synced == 2:  # both prefixes read
            self.ready.set()
            self._dirty = False
