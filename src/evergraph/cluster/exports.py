"""Exported resources: records `exported/<to>/<from>/<kind>/<name>` in the World.

A record holds the resource's parameters as JSON. Directed exports (to one
host) are sealed to the target's public key, so no other host can read them;
every record is signed by the exporter over its routing fields and payload,
so nobody can forge or alter one. A record that fails any check is rejected
with a warning naming its key, never applied.

`to` is a hostname or `*` (every host; signed, not encrypted).

Identities come from `hostkeys/<host>` only through a `HostKeyBook`, which
checks them against this host's pins (cluster/pins.py): a swapped key in the
World is refused, never used to seal or to verify.

`Publisher` keeps this host's records level-triggered: it holds the set the
graph wants and reconciles the World to it until the World acknowledges (a
change made during an outage is published when the World returns), every
record under the agent's lease. `Collector` follows `exported/<host>/` and
`exported/*/` with `follow()`: one change costs one record verified, and no
record is missed between the first read and the watch.

No replay: every record carries its exporter's sequence number (`seq`, from a
counter that only grows, kept in the state dir), covered by its signature, and
each exporter keeps a signed index per target, `exported/<to>/<from>/index`,
naming the sequence and digest of every record it exports there now (written in
the same transaction as the records, under the same lease; a record whose bytes
have the digest a verified index names needs no signature check of its own).
A collector applies a record only when its sequence is the one the newest index
it verified names: an older record put back, a withdrawn one put back without a
lease, or an older index put back is refused (logged once); a record an attacker
deletes while the index still lists it keeps its last verified value until its
exporter withdraws it (a new index without it, or the lease ending, which takes
the index and the records).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, MutableSet
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import msgspec

from evergraph._util.atomic import atomic_write
from evergraph.cluster.hostkeys import HostKeys, KeyError_, fingerprint
from evergraph.cluster.pins import IdentityMismatch, Pins, PinsError, fingerprint_of
from evergraph.world.follow import Follower, follow
from evergraph.world.kv import KV, Delete, KeyValue, Put, WorldError

log = logging.getLogger("evergraph.exports")

EXPORTED = "exported/"
EVERYONE = "*"
HOSTKEYS = "hostkeys/"
#: the last segment of an exporter's index key: `exported/<to>/<from>/index`
INDEX = "index"
#: the file in the state dir holding the export sequence reserved so far
SEQ_FILE = "export-seq"
#: a txn's ops at most (etcd's default limit is 128)
TXN_OPS = 100
#: seconds between full checks of this host's records in the World (anti-entropy:
#: a record deleted or altered by someone else is put back)
RECHECK = 30.0


class ExportRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    v: int = 2
    src: str
    to: str
    kind: str
    name: str
    #: the exporter's sequence number when it wrote this record (0: a v1 record,
    #: which no index names: never applied)
    seq: int = 0
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


def _signed_bytes(src: str, to: str, kind: str, name: str, seq: int, payload: bytes) -> bytes:
    head = msgspec.json.encode([src, to, kind, name, seq])
    return head + b"\n" + payload


def make_record(
    keys: HostKeys,
    src: str,
    to: str,
    kind: str,
    name: str,
    params: dict[str, Any],
    target_public: str | None,
    seq: int,
) -> bytes:
    """The record's bytes; `target_public` is required for a directed export. `seq`:
    the exporter's sequence number (see `SeqCounter`)."""
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
        seq=seq,
        sealed=to != EVERYONE,
        payload=base64.b64encode(body).decode(),
        sig=base64.b64encode(keys.sign(_signed_bytes(src, to, kind, name, seq, body))).decode(),
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
    return open_record_seq(keys, me, item, verify_key)[0]


def open_record_seq(
    keys: HostKeys | None,
    me: str | None,
    item: KeyValue,
    verify_key: str | None,
    vouched: bool = False,
) -> tuple[Exported, int]:
    """`open_record` and the record's sequence number. Without `keys` (a listing
    that cannot unseal) a sealed record is checked but its parameters are empty;
    without `me` a record for any target is accepted. `vouched`: the record's
    bytes have the digest a verified index of its exporter names (its signature
    is not checked again)."""
    where = parse_key(item.key)
    if where is None:
        raise ValueError(f"{item.key}: not an export key")
    try:
        rec = _decoder.decode(item.value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{item.key}: not an export record: {e}") from None
    if (rec.to, rec.src, rec.kind, rec.name) != where:
        raise ValueError(f"{item.key}: record does not match its key (moved or forged)")
    if me is not None and rec.to not in (me, EVERYONE):
        raise ValueError(f"{item.key}: meant for {rec.to!r}, not this host")
    if rec.sealed != (rec.to != EVERYONE):
        raise ValueError(f"{item.key}: a directed export must be sealed")
    if not verify_key and not vouched:
        raise ValueError(f"{item.key}: no key known for exporter {rec.src!r}")
    try:
        body = base64.b64decode(rec.payload, validate=True)
        sig = base64.b64decode(rec.sig, validate=True)
    except ValueError:
        raise ValueError(f"{item.key}: payload or signature is not base64") from None
    if not vouched:
        assert verify_key is not None
        signed = _signed_bytes(rec.src, rec.to, rec.kind, rec.name, rec.seq, body)
        if not HostKeys.check_signature(verify_key, signed, sig):
            raise ValueError(f"{item.key}: bad signature: not signed by {rec.src!r}")
    if rec.sealed and keys is None:
        return Exported(rec.src, rec.to, rec.kind, rec.name, {}), rec.seq
    if rec.sealed:
        assert keys is not None
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
    return Exported(rec.src, rec.to, rec.kind, rec.name, params), rec.seq


# -- the exporter's index: which records, at which sequence ------------------------------


class ExportIndex(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`exported/<to>/<src>/index`: the records `src` exports to `to` now, each
    `<kind>/<quoted name>` with the sequence and digest of its current record
    (`entries`, a JSON object kept as its exporter wrote it: the signature covers
    those bytes, so checking it needs no re-encoding). A record whose bytes have
    the digest a verified index names is the exporter's: its own signature need
    not be checked again (one signature check per change, as before indexes)."""

    v: int = 1
    src: str
    to: str
    seq: int
    entries: msgspec.Raw
    #: base64 Ed25519 signature by `src` over `_index_bytes(...)`
    sig: str


#: an index entry: (the record's sequence, `record_digest` of its bytes)
Entry = tuple[int, str]


def record_digest(value: bytes) -> str:
    """What an index names a record's bytes by (BLAKE2b, 128 bits, base64)."""
    return base64.b64encode(hashlib.blake2b(value, digest_size=16).digest()).decode()


class Index(msgspec.Struct, frozen=True):
    """A verified index."""

    src: str
    to: str
    seq: int
    #: entry -> (sequence, digest of the record's bytes)
    entries: dict[str, Entry]


_index_decoder = msgspec.json.Decoder(ExportIndex)
_entries_decoder = msgspec.json.Decoder(dict[str, tuple[int, str]])


def index_key(to: str, src: str) -> str:
    return f"{EXPORTED}{to}/{src}/{INDEX}"


def parse_index_key(key: str) -> tuple[str, str] | None:
    """(to, src) of an index key, or None if it is not one."""
    parts = key[len(EXPORTED) :].split("/") if key.startswith(EXPORTED) else []
    if len(parts) != 3 or parts[2] != INDEX or not parts[0] or not parts[1]:
        return None
    return parts[0], parts[1]


def entry_name(key: str) -> str:
    """The index entry of a record key: `<kind>/<quoted name>`."""
    return key.split("/", 3)[3]


def _index_bytes(src: str, to: str, seq: int, entries: bytes) -> bytes:
    return msgspec.json.encode(["index", src, to, seq]) + b"\n" + entries


def make_index(keys: HostKeys, src: str, to: str, seq: int, entries: dict[str, Entry]) -> bytes:
    raw = msgspec.json.encode(entries)
    sig = keys.sign(_index_bytes(src, to, seq, raw))
    rec = ExportIndex(
        src=src, to=to, seq=seq, entries=msgspec.Raw(raw), sig=base64.b64encode(sig).decode()
    )
    return msgspec.json.encode(rec)


def open_index(item: KeyValue, verify_key: str) -> Index:
    """Check an index record against its exporter's key; ValueError otherwise."""
    where = parse_index_key(item.key)
    if where is None:
        raise ValueError(f"{item.key}: not an export index key")
    try:
        rec = _index_decoder.decode(item.value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{item.key}: not an export index: {e}") from None
    if (rec.to, rec.src) != where:
        raise ValueError(f"{item.key}: index does not match its key (moved or forged)")
    try:
        sig = base64.b64decode(rec.sig, validate=True)
    except ValueError:
        raise ValueError(f"{item.key}: signature is not base64") from None
    raw = bytes(rec.entries)
    if not HostKeys.check_signature(verify_key, _index_bytes(rec.src, rec.to, rec.seq, raw), sig):
        raise ValueError(f"{item.key}: bad signature: not signed by {rec.src!r}")
    try:
        entries = _entries_decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"{item.key}: entries are not [sequence, digest] by record: {e}") from None
    return Index(rec.src, rec.to, rec.seq, entries)


class SeqCounter:
    """This host's export sequence: grows with every record and index written, across
    restarts too. It starts at the larger of the time in microseconds and what the
    state dir's `export-seq` reserved; a block is reserved (one small write) each
    time the counter passes the reservation, so a clock stepped back does not make
    an exporter's new records look older than its old ones."""

    BLOCK = 1 << 16

    def __init__(self, state_dir: Path | None = None) -> None:
        self.path = state_dir / SEQ_FILE if state_dir is not None else None
        start = time.time_ns() // 1000
        if self.path is not None:
            with contextlib.suppress(OSError, ValueError):
                start = max(start, int(self.path.read_text().strip() or 0))
        self._next = start
        self._reserved = start

    def next(self) -> int:
        n = self._next
        self._next += 1
        if self.path is not None and n >= self._reserved:
            self._reserved = n + self.BLOCK
            atomic_write(self.path, f"{self._reserved}\n".encode(), mode=0o600)
        return n


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
        seq: SeqCounter | None = None,
    ) -> None:
        self.kv = kv
        self.keys = keys
        self.host = host
        self.book = book
        self.lease = lease
        self.seq = seq if seq is not None else SeqCounter()
        self._want: dict[str, ExportItem] = {}
        self._sources: dict[str, list[ExportItem]] = {}
        #: key -> (params, lease, mod revision, index entry) as written by us
        self._written: dict[str, tuple[dict[str, Any], int, int, Entry]] = {}
        #: target -> (entries, lease, mod revision) of the index written by us
        self._indexes: dict[str, tuple[dict[str, Entry], int, int]] = {}
        self._full = True  # the next pass reads the World (start, errors, regrant)
        #: the next pass reads our own records back by key (the periodic check: a
        #: read of all of exported/ every 30 s by every agent does not scale)
        self._recheck = False
        self._wake = asyncio.Event()
        #: set when the World holds exactly what is wanted (tests, --converged)
        self.acknowledged = asyncio.Event()
        #: targets whose key is missing or refused: waiting for the book
        self._waiting: set[str] = set()
        #: our keys someone else may have changed: read back on the next pass
        self._suspects: set[str] = set()
        book.listen(self._key_changed)

    def noticed(self, key: str, kv: KeyValue | None) -> None:
        """A record or index of ours changed in the World (seen by this host's
        collector): unless it is our own write, read it back on the next pass and put
        it right at once, not at the next periodic check."""
        if kv is not None:
            where = parse_key(key)
            if where is not None:
                mine = self._written.get(key)
                if mine is not None and mine[2] == kv.mod_revision:
                    return
            elif (pair := parse_index_key(key)) is not None:
                idx = self._indexes.get(pair[0])
                if idx is not None and idx[2] == kv.mod_revision:
                    return
        self._suspects.add(key)
        self._wake.set()

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
        """Our records and indexes in the World."""
        items, _ = await self.kv.range(EXPORTED)
        out: dict[str, KeyValue] = {}
        for i in items:
            w = parse_key(i.key)
            if w is not None:
                if w[1] == self.host:
                    out[i.key] = i
            elif (x := parse_index_key(i.key)) is not None and x[1] == self.host:
                out[i.key] = i
        return out

    async def _mine_by_key(self, keys: list[str]) -> dict[str, KeyValue]:
        out: dict[str, KeyValue] = {}
        for key in keys:
            item = await self.kv.get(key)
            if item is not None:
                out[key] = item
        return out

    async def _check_suspect(
        self,
        key: str,
        want: dict[str, ExportItem],
        lease: int,
        stale: MutableSet[str],
        in_world: MutableSet[str],
    ) -> None:
        """Read one of our keys back: what someone else changed is written again this
        pass (a record or index of ours that is not ours any more: deleted)."""
        item = await self.kv.get(key)
        where = parse_key(key)
        if where is not None:
            mine = self._written.get(key)
            if mine is not None and (
                item is None or item.mod_revision != mine[2] or item.lease != lease
            ):
                del self._written[key]
            elif mine is None and item is not None and key not in want:
                stale.add(key)
            else:
                return
        elif (pair := parse_index_key(key)) is not None:
            idx = self._indexes.get(pair[0])
            if idx is not None and (
                item is None or item.mod_revision != idx[2] or item.lease != lease
            ):
                del self._indexes[pair[0]]
            elif idx is None and item is not None:
                in_world.add(pair[0])
            else:
                return
        else:
            return
        log.error(
            "ALARM: %s, this host's export %s, was %s by someone else: putting it right",
            key,
            "record" if where is not None else "index",
            "deleted" if item is None else "changed",
        )

    async def _reconcile(self) -> None:
        want = self._want
        lease = self.lease()
        host = self.host
        if self._full or self._recheck:
            if self._full:  # everything of ours, also what an earlier run left
                world = await self._mine_in_world()
                stale = {k for k in world if parse_key(k) is not None} - want.keys()
            else:
                idx = {index_key(t, host) for t in self._indexes}
                world = await self._mine_by_key(sorted(want.keys() | self._written.keys() | idx))
                stale = set(self._written) - want.keys()
            written = self._written
            self._written = {
                k: v
                for k, v in written.items()
                if k in world and world[k].mod_revision == v[2] and world[k].lease == lease
            }
            self._indexes = {
                t: v
                for t, v in self._indexes.items()
                if (i := world.get(index_key(t, host))) is not None
                and i.mod_revision == v[2]
                and i.lease == lease
            }
            in_world = {x[0] for k in world if (x := parse_index_key(k)) is not None}
            self._full = self._recheck = False
        else:
            stale = set(self._written) - want.keys()
            in_world = set(self._indexes)
        suspects, self._suspects = self._suspects, set()
        for key in sorted(suspects):
            await self._check_suspect(key, want, lease, stale, in_world)
        ops: dict[str, list[Put | Delete]] = {}
        for key in sorted(stale):
            where = parse_key(key)
            assert where is not None
            ops.setdefault(where[0], []).append(Delete(key))
        #: what this pass writes: key -> (params, seq)
        puts: dict[str, tuple[dict[str, Any], Entry]] = {}
        waiting: set[str] = set()
        #: target -> {entry: seq}: the index each target should have
        entries: dict[str, dict[str, Entry]] = {}
        for key, (to, kind, name, params) in sorted(want.items()):
            done = self._written.get(key)
            if done is not None and done[0] == params and done[1] == lease:
                entries.setdefault(to, {})[entry_name(key)] = done[3]
                continue
            public = None
            if to != EVERYONE:
                pair = self.book.trusted(to)
                if pair is None:
                    if to not in self._waiting:
                        log.warning("export %s[%s] to %s waits for that host's key", kind, name, to)
                    waiting.add(to)
                    if done is not None:  # the record of before stays, and so its entry
                        entries.setdefault(to, {})[entry_name(key)] = done[3]
                    continue
                public = pair[0]
            seq = self.seq.next()
            try:
                value = make_record(self.keys, host, to, kind, name, params, public, seq)
            except KeyError_ as e:
                log.error("export %s[%s] to %s: %s", kind, name, to, e)
                if done is not None:
                    entries.setdefault(to, {})[entry_name(key)] = done[3]
                continue
            ops.setdefault(to, []).append(Put(key, value, lease))
            entry = (seq, record_digest(value))
            puts[key] = (params, entry)
            entries.setdefault(to, {})[entry_name(key)] = entry
        # each target whose records changed, or whose index is missing or stale,
        # gets a new index (or loses it: nothing exported there any more), in the
        # same txn as its records (the first of a pass's txns, if it takes several)
        for to in sorted(set(ops) | set(entries) | in_world | set(self._indexes)):
            mine = entries.get(to, {})
            had = self._indexes.get(to)
            if to not in ops and had is not None and had[0] == mine and had[1] == lease:
                continue
            if not mine and had is None and to not in in_world and to not in ops:
                continue
            ikey = index_key(to, host)
            # a new index goes first (a collector applies each record as it arrives
            # at the sequence the index names, whatever the txns a pass takes); a
            # deleted one last (its records are gone by then: a withdrawal, not an
            # index deleted under remaining records)
            if mine:
                index = make_index(self.keys, host, to, self.seq.next(), mine)
                ops.setdefault(to, []).insert(0, Put(ikey, index, lease))
            else:
                ops.setdefault(to, []).append(Delete(ikey))
        for to, tops in sorted(ops.items()):
            for at in range(0, len(tops), TXN_OPS):
                chunk = tops[at : at + TXN_OPS]
                rev = await self.kv.txn([], chunk)
                assert rev is not None  # no compares: it always applies
                for o in chunk:
                    if isinstance(o, Delete):
                        if parse_index_key(o.key) is not None:
                            self._indexes.pop(to, None)
                        else:
                            self._written.pop(o.key, None)
                            log.info("export withdrawn: %s", o.key)
                    elif parse_index_key(o.key) is not None:
                        self._indexes[to] = (entries.get(to, {}), o.lease, rev)
                    else:
                        params, entry = puts[o.key]
                        self._written[o.key] = (params, o.lease, rev, entry)
                        _to, kind, name, _params = want[o.key]
                        log.info("exported %s[%s] to %s", kind, name, to)  # never the parameters
        self._waiting = waiting
        if not waiting and want is self._want and not self._wake.is_set():
            self.acknowledged.set()


# -- collecting ------------------------------------------------------------------------


#: (to, src) of an exporter's records for one target
Pair = tuple[str, str]


class Collector(Follower[KeyValue]):
    """What other hosts export to this one, checked: follows `exported/<me>/` and
    `exported/*/`. Each changed record is verified (signature by the exporter's
    pinned key, sealed to us) once; a record that cannot be verified yet (its
    exporter's key unknown) is kept aside and verified when the key arrives.

    No replay: a record is applied only when its sequence is the one named by the
    newest verified index of its exporter for that target (see the module's doc);
    an older record or index is refused (logged once per change), a record deleted
    while the index lists it keeps its last verified value, a record the index does
    not list is not applied.

    `current()` is the checked set, by World key; listeners are called after each
    batch that changed it."""

    def __init__(
        self,
        kv: KV,
        keys: HostKeys,
        host: str,
        book: HostKeyBook,
        own: Callable[[str, KeyValue | None], None] | None = None,
    ) -> None:
        self.kv = kv
        self.keys = keys
        self.host = host
        self.book = book
        #: told of every change to a record or index of this host's that the
        #: collector sees (its `*` exports): the publisher puts them right
        self._own = own
        #: what is applied: key -> (export, its sequence)
        self._items: dict[str, tuple[Exported, int]] = {}
        #: records waiting for their exporter's key (by exporter)
        self._pending: dict[str, dict[str, KeyValue]] = {}
        #: the records as the World has them now
        self._raw: dict[str, KeyValue] = {}
        #: each record's verification, kept while its value stays: key -> (value,
        #: export or None if refused, sequence)
        self._checked: dict[str, tuple[bytes, Exported | None, int]] = {}
        #: the index records as the World has them now, and the value last judged
        self._idx_raw: dict[Pair, KeyValue] = {}
        self._idx_judged: dict[Pair, bytes] = {}
        #: the index in effect per pair, and the highest sequence verified
        self._index: dict[Pair, Index] = {}
        self._high: dict[Pair, int] = {}
        #: record keys (in the World or applied) by pair, and pairs by exporter (a
        #: key that arrives re-verifies its exporter's records: O(theirs), not O(all))
        self._keys: dict[Pair, set[str]] = {}
        self._by_src: dict[str, set[Pair]] = {}
        #: records kept after a deletion the index does not explain (logged once)
        self._kept: set[str] = set()
        self._idx_kept: set[Pair] = set()
        #: pairs changed in the batch being reported, with their changed records
        self._touched: dict[Pair, set[str]] = {}
        self._listeners: list[Callable[[], None]] = []
        self._synced = 0
        self.ready = asyncio.Event()
        self._dirty = False
        #: records verified (benchmarks: one change must cost one), indexes verified
        self.verified = 0
        self.verified_indexes = 0
        #: records and indexes refused as replayed or stale (tests)
        self.refused = 0
        book.listen(self._key_changed)

    def current(self) -> list[Exported]:
        """The collected exports, in (kind, name, exporter) order."""
        return sorted((e for e, _ in self._items.values()), key=lambda e: (e.kind, e.name, e.src))

    def listen(self, fn: Callable[[], None]) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow(self.kv, f"{EXPORTED}{self.host}/", self))
            tg.create_task(follow(self.kv, f"{EXPORTED}{EVERYONE}/", self))

    def _pair_of(self, key: str) -> tuple[Pair, bool] | None:
        """(pair, is it the index) of a key, None if neither a record nor an index."""
        where = parse_key(key)
        if where is not None:
            return (where[0], where[1]), False
        idx = parse_index_key(key)
        return (idx, True) if idx is not None else None

    def _touch(self, kv: KeyValue | None, key: str) -> None:
        found = self._pair_of(key)
        if found is None:
            return
        pair, is_index = found
        if pair[1] == self.host:
            if self._own is not None:
                self._own(key, kv)
            return
        if is_index:
            if kv is None:
                self._idx_raw.pop(pair, None)
            else:
                self._idx_raw[pair] = kv
        touched = self._touched.setdefault(pair, set())
        if not is_index:
            if kv is None:
                self._raw.pop(key, None)
            else:
                self._raw[key] = kv
                self._kept.discard(key)
            self._keys.setdefault(pair, set()).add(key)
            touched.add(key)
        self._by_src.setdefault(pair[1], set()).add(pair)

    def _drop(self, key: str) -> None:
        if self._items.pop(key, None) is not None:
            self._dirty = True

    def _settle(self, pair: Pair, changed: set[str] | None = None) -> None:
        """Bring what is applied of `pair` in line with its records and index.
        `changed`: the records that changed (None: look at all of them); with the
        records whose entry the index changed, the only ones looked at, so that one
        change among N costs O(1) records, not O(N)."""
        src = pair[1]
        keys = self._keys.get(pair, set())
        trusted = self.book.trusted(src)
        if trusted is None:
            waiting = self._pending.setdefault(src, {})
            for key in sorted(keys):
                self._drop(key)
                kv = self._raw.get(key)
                if kv is None:
                    waiting.pop(key, None)
                elif waiting.get(key) != kv:
                    waiting[key] = kv
                    log.warning("export %s waits for the key of its exporter %s", key, src)
            if not waiting:
                del self._pending[src]
            return
        if (held := self._pending.get(src)) is not None:
            for key in keys:
                held.pop(key, None)
            if not held:
                del self._pending[src]
        verify = trusted[1]
        before = self._index.get(pair)
        self._judge_index(pair, verify, keys)
        idx = self._index.get(pair)
        todo: set[str]
        if changed is None or (idx is None) != (before is None):
            todo = keys
        elif idx is before:
            todo = changed
        else:
            assert idx is not None
            assert before is not None
            old, new = before.entries, idx.entries
            head = f"{EXPORTED}{pair[0]}/{pair[1]}/"
            todo = changed | {head + e for e, n in new.items() if old.get(e) != n}
            todo |= {head + e for e in old.keys() - new.keys()}
        for key in sorted(todo):
            self._settle_record(key, idx, verify)
        gone = [k for k in todo if k in keys and k not in self._raw and k not in self._items]
        for key in gone:
            keys.discard(key)
            self._checked.pop(key, None)
            self._kept.discard(key)
        if not keys and pair not in self._idx_raw:
            self._keys.pop(pair, None)
            self._idx_judged.pop(pair, None)
            self._index.pop(pair, None)
            mine = self._by_src.get(src)
            if mine is not None:
                mine.discard(pair)
                if not mine:
                    del self._by_src[src]

    def _judge_index(self, pair: Pair, verify: str, keys: set[str]) -> None:
        kv = self._idx_raw.get(pair)
        if kv is None:
            self._idx_judged.pop(pair, None)
            if pair not in self._index:
                return
            if any(k in self._raw for k in keys):
                if pair in self._idx_kept:
                    return
                self._idx_kept.add(pair)
                log.error(
                    "%s deleted while records of its exporter remain: keeping what it "
                    "named until the exporter withdraws it",
                    index_key(*pair),
                )
            else:  # index and records gone: withdrawn (or the exporter's lease ended)
                del self._index[pair]
            return
        self._idx_kept.discard(pair)
        if self._idx_judged.get(pair) == kv.value:
            return
        self._idx_judged[pair] = kv.value
        self.verified_indexes += 1
        try:
            idx = open_index(kv, verify)
        except ValueError as e:
            log.error("rejected export index: %s", e)
            return
        high = self._high.get(pair, 0)
        if idx.seq < high or (idx.seq == high and self._index.get(pair) != idx):
            self.refused += 1
            log.error(
                "%s: replayed export index refused: sequence %d, %d already seen",
                kv.key,
                idx.seq,
                high,
            )
            return
        self._index[pair] = idx
        self._high[pair] = idx.seq

    def _settle_record(self, key: str, idx: Index | None, verify: str) -> None:
        kv = self._raw.get(key)
        entry = idx.entries.get(entry_name(key)) if idx is not None else None
        checked: tuple[bytes, Exported | None, int] | None = None
        fresh = False
        if kv is not None:
            checked = self._checked.get(key)
            if checked is None or checked[0] != kv.value:
                fresh = True
                self.verified += 1
                # the bytes a verified index names need no second signature check
                vouched = entry is not None and entry[1] == record_digest(kv.value)
                try:
                    exp, seq = open_record_seq(self.keys, self.host, kv, verify, vouched)
                    checked = (kv.value, exp, seq)
                except ValueError as e:
                    log.error("rejected export: %s", e)
                    checked = (kv.value, None, 0)
                self._checked[key] = checked
        if idx is None:
            self._drop(key)
            if fresh and checked is not None and checked[1] is not None:
                log.warning("export %s waits for its exporter's index", key)
            return
        valid = checked is not None and checked[1] is not None
        if entry is None:
            self._drop(key)
            if fresh and valid:
                self.refused += 1
                log.error(
                    "stale export refused: %s is not in its exporter's index "
                    "(withdrawn, or put back by someone else)",
                    key,
                )
            return
        want = entry[0]
        if fresh and valid and checked is not None and checked[2] < want:
            self.refused += 1
            log.error(
                "replayed export refused: %s has sequence %d, its exporter's index "
                "names %d: keeping the last verified value",
                key,
                checked[2],
                want,
            )
        cur = self._items.get(key)
        if checked is not None and checked[1] is not None and checked[2] == want:
            if cur is None or cur[0] != checked[1]:
                self._dirty = True
            self._items[key] = (checked[1], want)
            return
        # the record is older, newer (its index follows) or gone: keep what is applied
        if kv is None and cur is not None and key not in self._kept:
            self._kept.add(key)
            log.error(
                "export %s deleted, but its exporter's index still lists it: keeping "
                "the last verified value until the exporter withdraws it",
                key,
            )

    def _key_changed(self, host: str) -> None:
        # a key that arrived (or a pin that changed): verify that exporter's records
        # and indexes again, with the key now trusted
        pairs = list(self._by_src.get(host, ()))
        was_dirty = self._dirty
        for pair in pairs:
            before = {k: self._items[k] for k in self._keys.get(pair, ()) if k in self._items}
            for key in self._keys.get(pair, ()):
                self._checked.pop(key, None)
                self._items.pop(key, None)
            self._idx_judged.pop(pair, None)
            self._index.pop(pair, None)
            self._high.pop(pair, None)
            self._settle(pair)
            after = {k: self._items[k] for k in self._keys.get(pair, ()) if k in self._items}
            # the same records verified again with the same key: no change to report
            was_dirty = was_dirty or before != after
        self._dirty = was_dirty
        self._notify()

    def _notify(self) -> None:
        if self._dirty and self.ready.is_set():
            self._dirty = False
            for fn in list(self._listeners):
                fn()

    # follower callbacks: the raw record; checks happen at the batch's end, once per
    # change, with the index of the same batch (written in the same txn) at hand
    async def new(self, obj: KeyValue) -> None:
        self._touch(obj, obj.key)

    async def updated(self, prev: KeyValue, new: KeyValue) -> None:
        self._touch(new, new.key)

    def equals(self, a: KeyValue, b: KeyValue) -> bool:
        return a.value == b.value

    async def deleted(self, prev: KeyValue) -> None:
        self._touch(None, prev.key)

    async def batch_done(self) -> None:
        touched, self._touched = self._touched, {}
        for pair, changed in sorted(touched.items()):
            self._settle(pair, changed)
        self._notify()

    async def synced(self) -> None:
        self._synced += 1
        if self._synced == 2:  # both prefixes read
            self.ready.set()
            self._dirty = False
