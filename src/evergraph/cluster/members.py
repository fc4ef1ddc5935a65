"""Cluster members: each agent's record `members/<host>`, kept alive by a lease.

A record carries what other hosts need to reach and trust this one: its
address, its public keys (encryption and signature), capabilities, groups,
state, version and start time. A dead agent's lease expires and its record
vanishes. Keys are also published without a lease under `hostkeys/<host>`
(cluster/exports.py), so exports of a host that is down can still be verified.

Records are signed by the host's signing key (`signature`, over the record
without it): a record not signed by the key it names is no one's claim.

One agent per hostname: `Membership.claim()` refuses a hostname whose record is
live, genuine (signed) and belongs to another agent (other keys), naming that
agent's address and start time; `replace=True` takes it over deliberately
(the record names the key it replaced, and both agents log it), and the agent
it replaced sees its record taken and stops. The same agent restarting (same
state dir, so the same keys) takes its own record back without a gap. A
record the agent did not write (forged, unsigned, an old copy of its own, or
deleted) never stops it: it restores its own at once and logs an alarm
naming what it found.

A replaced World (world/kv.py, world/worldid.py) is rebuilt: the agent's lease
is never carried over to another World (lease ids are not identities: a new
sqlite World hands out id 1 again), so it grants a fresh one, writes its
record again and tells its `on_regrant` and `on_replaced` listeners, which
re-publish everything else the agent owns.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import os
import socket
import time
from collections.abc import Callable
from typing import Literal

import msgspec

from evergraph._util.clock import SYSTEM, Clock
from evergraph._util.tasks import first_of
from evergraph.cluster.hostkeys import HostKeys, fingerprint
from evergraph.world.follow import watch_one
from evergraph.world.kv import KV, Compare, KeyValue, LeaseExpired, Put, WorldError, log
from evergraph.world.worldid import WorldIdentity

MEMBERS = "members/"
DEFAULT_TTL = 10.0


class HostnameTaken(Exception):
    """Another live agent holds this hostname (the message names it)."""


class Member(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    host: str
    address: str = ""
    #: base64 X25519 public key: directed exports are sealed to it
    public: str = ""
    #: base64 Ed25519 verify key: exports from this host are signed with it
    verify: str = ""
    capabilities: dict[str, str] = {}
    groups: list[str] = []
    state: str = "running"
    version: str = ""
    timestamp: float = 0.0
    #: when this agent started (seconds since the epoch), and its process id
    started: float = 0.0
    pid: int = 0
    #: the verify key of the agent this one took the hostname over from (--replace)
    replaces: str = ""
    #: base64 Ed25519 signature by `verify`'s key over the record without it
    signature: str = ""


_member_decoder = msgspec.json.Decoder(Member)


def member_key(host: str) -> str:
    return f"{MEMBERS}{host}"


def decode_member(kv: KeyValue) -> Member:
    """The member in a record; ValueError (with the reason) for a bad one."""
    try:
        m = _member_decoder.decode(kv.value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{kv.key}: not a member record: {e}") from None
    if member_key(m.host) != kv.key:
        raise ValueError(f"{kv.key}: record names another host {m.host!r}")
    return m


def signed_bytes(m: Member) -> bytes:
    """What a member record's signature covers: the record without it."""
    return msgspec.json.encode(msgspec.structs.replace(m, signature=""))


def sign_member(m: Member, keys: HostKeys) -> Member:
    sig = base64.b64encode(keys.sign(signed_bytes(m))).decode()
    return msgspec.structs.replace(m, signature=sig)


def genuine(m: Member) -> bool:
    """Whether the record is signed by the key it names."""
    if not m.signature or not m.verify:
        return False
    try:
        sig = base64.b64decode(m.signature, validate=True)
    except (ValueError, binascii.Error):
        return False
    return HostKeys.check_signature(m.verify, signed_bytes(m), sig)


async def members(kv: KV) -> list[Member]:
    """The live members, in host order; bad records are skipped with a warning."""
    items, _ = await kv.range(MEMBERS)
    out = []
    for item in items:
        try:
            out.append(decode_member(item))
        except ValueError as e:
            log.warning("world: %s", e)
    return out


def local_address() -> str:
    """This host's address as others would see it (best effort, no traffic sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET: connect() on UDP sends nothing
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "unknown"


def _who(m: Member) -> str:
    """An agent as messages name it."""
    return (
        f"address {m.address or '?'}, pid {m.pid or '?'}, started {_when(m.started)}, "
        f"key {fingerprint(m.verify) if m.verify else '?'}"
    )


#: what a member record found in the World is, for its host's agent
Verdict = Literal["absent", "ours", "other", "fake"]


class Membership:
    """Claims `members/<host>` under a lease and keeps it alive and right (`run()`,
    owned by the agent): keep-alive every ttl/3, the World's id checked at each,
    the record restored whenever it is not the one we wrote.

    Listeners: `on_regrant(fn)` — the lease is new (it had expired, or the World
    was replaced): whatever it carried must be written again; `on_replaced(fn)`
    — the World was replaced (`fn(why)`, after the regrant listeners): every
    record the agent owns, also those without a lease, must be written again."""

    def __init__(
        self,
        kv: KV,
        member: Member,
        ttl: float = DEFAULT_TTL,
        keys: HostKeys | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.kv = kv
        #: the keep-alive's ticks and the records' times (a fake one in tests)
        self.clock = clock
        self.member = msgspec.structs.replace(
            member,
            started=member.started or clock.time(),
            pid=member.pid or os.getpid(),
            address=member.address or local_address(),
        )
        self.keys = keys
        self.key = member_key(self.member.host)
        self.ttl = ttl
        self.lease = 0
        #: the epoch of the World the lease was granted in (another World: not ours)
        self._lease_epoch = kv.epoch
        self._lease_gone = False
        self._regrant: list[Callable[[], None]] = []
        self._replaced_fns: list[Callable[[str], None]] = []
        #: set when another agent took the hostname over (`--replace`)
        self.replaced = asyncio.Event()
        #: the record as we last wrote it, and its mod revision
        self._mine = b""
        self._mod = 0
        self.world = WorldIdentity(kv)
        self._wake = asyncio.Event()
        self._why = ""
        #: listeners still to tell (the regrant's, the replacement's reason)
        self._due_regrant = False
        self._due_replaced: str | None = None
        self._stopping = False
        #: the last record we raised an alarm about (once per record)
        self._alarmed = b""
        kv.listen_replaced(self._world_replaced)

    def on_regrant(self, fn: Callable[[], None]) -> None:
        self._regrant.append(fn)

    def on_replaced(self, fn: Callable[[str], None]) -> None:
        self._replaced_fns.append(fn)

    def _world_replaced(self, why: str) -> None:
        # called by the KV, maybe inside one of its calls: only note and wake
        self._why = why
        self._wake.set()

    # -- judging a record -----------------------------------------------------------
    def _judge(self, cur: KeyValue | None) -> tuple[Verdict, Member | None]:
        if cur is None:
            return "absent", None
        try:
            m = decode_member(cur)
        except ValueError:
            return "fake", None
        if not genuine(m) and self.keys is not None:
            return "fake", m
        if m.verify == self.member.verify:
            return "ours", m
        if not cur.lease:
            return "fake", m  # an agent's record always lives under its lease
        return "other", m

    def _found(self, cur: KeyValue | None, m: Member | None) -> str:
        """What was found instead of our record, for the alarm."""
        if cur is None:
            return "the record was deleted"
        if m is None:
            return "a record that is not a member record"
        if m.verify == self.member.verify:
            if not genuine(m):
                return "a record with this agent's key but not signed by it"
            return f"an older record of this agent ({_when(m.timestamp)}, state {m.state})"
        if not genuine(m):
            return f"a record not signed by the key it names ({_who(m)})"
        return f"a record of another agent that did not take this hostname over ({_who(m)})"

    def _takes_over(self, m: Member) -> bool:
        """A genuine record of another live agent: whether it took the hostname from
        us (`--replace` names our key; or it started after us, while our record was
        gone) rather than being an old record put back."""
        return m.replaces == self.member.verify or m.started > self.member.started

    # -- writing ------------------------------------------------------------------------
    def _encode(self, **changes: object) -> bytes:
        m = msgspec.structs.replace(self.member, timestamp=self.clock.time(), **changes)
        if self.keys is not None:
            m = sign_member(m, self.keys)
        return msgspec.json.encode(m)

    async def _write(self, expect: int, value: bytes) -> bool:
        """Our record, if its mod revision is still `expect`."""
        self._mine = value  # before: our own watch must know it at once
        rev = await self.kv.txn([Compare(self.key, expect)], [Put(self.key, value, self.lease)])
        if rev is None:
            return False
        self._mod = rev
        return True

    async def claim(self, replace: bool = False) -> int | None:
        """Take the hostname: grant the lease and write the record. Raises
        HostnameTaken if another live agent has it (unless `replace`). Returns the
        lease of this agent's previous run, if its record was still live (the
        caller revokes it once everything is re-published under the new one)."""
        m = self.member
        await self.world.check()  # makes the World's id record in a new World
        epoch = self.kv.epoch
        self.lease = await self.kv.grant(self.ttl)
        self._lease_epoch = epoch
        for _ in range(20):
            cur = await self.kv.get(self.key)
            verdict, other = self._judge(cur)
            previous: int | None = None
            replaces = ""
            if verdict == "other" and other is not None:
                if not replace:
                    with contextlib.suppress(WorldError):
                        await self.kv.revoke(self.lease)
                    raise HostnameTaken(
                        f"hostname {m.host!r} is held by another live agent (address "
                        f"{other.address or '?'}, pid {other.pid or '?'}, started "
                        f"{_when(other.started)}): stop it, choose another --hostname, "
                        "or take it over with --replace"
                    )
                log.warning(
                    "taking hostname %r over (--replace) from another agent (%s)",
                    m.host,
                    _who(other),
                )
                replaces = other.verify
            elif verdict == "ours" and other is not None and cur is not None and cur.lease:
                previous = cur.lease  # our own earlier run (killed, or restarting)
            elif verdict == "fake":
                log.error(
                    "%s: alarm: %s: not a claim; writing this agent's own",
                    self.key,
                    self._found(cur, other),
                )
            if replaces:
                self.member = msgspec.structs.replace(self.member, replaces=replaces)
            if await self._write(cur.mod_revision if cur else 0, self._encode()):
                return previous
        raise WorldError(f"{self.key}: kept changing while it was claimed")

    async def run(self) -> None:
        """Keep the lease alive (every ttl/3), re-grant and re-write after an expiry
        or a replaced World, and watch the record: another agent taking it over
        sets `replaced`; anything else is repaired."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._maintain())
            tg.create_task(self._watch_record())

    async def _maintain(self) -> None:
        clock = self.clock
        next_tick = clock.monotonic() + self.ttl / 3
        again = False  # a pass that failed: the next one looks at the record too
        while not self.replaced.is_set():
            left = next_tick - clock.monotonic()
            if left > 0 and not self._wake.is_set():
                await first_of(self._wake.wait(), clock.sleep(left))
            else:
                # a turn of the loop for its other tasks first: a pass on a locked
                # sqlite World waits busy_timeout (5 s) in the loop and fails, after
                # which the next tick is due at once; passes back to back would hold
                # the loop for as long as the lock lasts (no line flushed, no repair)
                await clock.sleep(0)
            woken = self._wake.is_set()
            self._wake.clear()
            tick = clock.monotonic() >= next_tick
            if tick:
                next_tick = clock.monotonic() + self.ttl / 3
            if self._stopping:
                continue
            try:
                await self._pass(tick, woken or again)
                again = False
            except LeaseExpired:
                log.warning("world: lease %x expired; granting a new one", self.lease)
                self._lease_gone = True
                self._wake.set()
            except WorldError as e:
                log.warning("world: keep-alive failed: %s", e)
                next_tick = min(next_tick, clock.monotonic() + 1.0)
                again = True

    async def _pass(self, tick: bool, woken: bool = True) -> None:
        """One round: a fresh lease if ours is gone or of another World; the
        keep-alive and the World's id (on ticks); our record as we wrote it (when
        woken: the record's watch, a new lease or World; a quiet tick costs a
        keep-alive and one read)."""
        look = tick  # at the World's id record
        if self._lease_gone or self.kv.epoch != self._lease_epoch:
            look = True  # a lease lost may be a World lost: look now
            replaced = self.kv.epoch != self._lease_epoch
            epoch = self.kv.epoch
            if replaced:
                log.warning(
                    "world: the World was replaced (%s): re-publishing this agent's "
                    "records under a fresh lease",
                    self._why or "noticed by another call",
                )
            # never the old lease's id: in another World it is someone else's
            self.lease = await self.kv.grant(self.ttl)
            self._lease_epoch, self._lease_gone = epoch, False
            self._due_regrant = True
            if replaced:
                self._due_replaced = self._why or "a new epoch"
        elif tick:
            await self.kv.keepalive(self.lease)
        if look and await self.world.check() is not None:
            self._wake.set()  # another World: a fresh lease first
            return
        if self.kv.epoch != self._lease_epoch:
            self._wake.set()
            return
        if not woken and not self._due_regrant:
            return
        # after a new lease (or World) our record is expected to be gone: no alarm
        await self._restore(expect_gone=self._due_regrant)
        if self.replaced.is_set():
            return
        if self._due_regrant:
            self._due_regrant = False
            for fn in self._regrant:
                fn()
        if self._due_replaced is not None:
            why, self._due_replaced = self._due_replaced, None
            for rfn in self._replaced_fns:
                rfn(why)

    async def _restore(self, expect_gone: bool = False) -> None:
        """Our record, if the World holds anything else (an alarm names it); a
        genuine takeover sets `replaced` instead. `expect_gone`: a new lease or
        World, where no record, or an old one of ours, is no news."""
        for _ in range(20):
            cur = await self.kv.get(self.key)
            if cur is not None and cur.value == self._mine and cur.lease == self.lease:
                return
            verdict, other = self._judge(cur)
            if verdict == "other" and other is not None and self._takes_over(other):
                log.error(
                    "hostname %r was taken over by another agent (%s): stopping",
                    self.member.host,
                    _who(other),
                )
                self.replaced.set()
                return
            if cur is None and not expect_gone:
                # gone with our lease (we were away)? then LeaseExpired: no alarm
                await self.kv.keepalive(self.lease)
            # a rebuild finds nothing, or an old copy of ours (a restored backup)
            expected = expect_gone and (cur is None or verdict == "ours")
            if not expected and (cur is None or cur.value != self._alarmed):
                self._alarmed = cur.value if cur is not None else b""
                log.error(
                    "%s: alarm: %s; restoring this agent's record",
                    self.key,
                    self._found(cur, other),
                )
            if await self._write(cur.mod_revision if cur else 0, self._encode()):
                return
        raise WorldError(f"{self.key}: kept changing while it was restored")

    async def _watch_record(self) -> None:
        async with contextlib.aclosing(watch_one(self.kv, self.key)) as snaps:
            async for snap in snaps:
                if isinstance(snap, KeyValue) and snap.value == self._mine:
                    continue
                self._wake.set()  # not ours: `_maintain` looks (and repairs)
                if self.replaced.is_set():
                    return

    async def stop(self) -> None:
        """Leave: the record and what the lease carries (exports) expire within the
        TTL, so a restart in between takes them back without a flap. Only a record
        still ours is marked: an agent that took the hostname over keeps its own."""
        self._stopping = True
        if self.replaced.is_set():
            return
        with contextlib.suppress(WorldError):
            await self._write(self._mod, self._encode(state="stopped"))
