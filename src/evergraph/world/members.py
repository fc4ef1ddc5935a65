"""Cluster members: each agent's record `members/<host>`, kept alive by a lease.

A record carries what other hosts need to reach and trust this one: its
address, its public keys (encryption and signature), capabilities, groups,
state, version and start time. A dead agent's lease expires and its record
vanishes. Keys are also published without a lease under `hostkeys/<host>`
(world/exports.py), so exports of a host that is down can still be verified.

One agent per hostname: `Membership.claim()` refuses a hostname whose record is
live and belongs to another agent (other keys), naming that agent's address and
start time; `replace=True` takes it over deliberately, and the agent it replaced
sees its record taken and stops. The same agent restarting (same state dir, so
the same keys) takes its own record back without a gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable

import msgspec

from evergraph.world.follow import Tombstone, watch_one
from evergraph.world.kv import KV, KeyValue, LeaseExpired, WorldError, log

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


class Membership:
    """Claims `members/<host>` under a lease and keeps it alive (`run()`, owned by
    the agent). `on_regrant` callbacks run when the lease had expired and was
    granted anew (whatever it carried must be written again)."""

    def __init__(self, kv: KV, member: Member, ttl: float = DEFAULT_TTL) -> None:
        self.kv = kv
        self.member = msgspec.structs.replace(
            member,
            started=member.started or time.time(),
            pid=member.pid or os.getpid(),
            address=member.address or local_address(),
        )
        self.ttl = ttl
        self.lease = 0
        self._regrant: list[Callable[[], None]] = []
        #: set when another agent took the hostname over (`--replace`)
        self.replaced = asyncio.Event()
        self._mod = 0

    def on_regrant(self, fn: Callable[[], None]) -> None:
        self._regrant.append(fn)

    async def claim(self, replace: bool = False) -> int | None:
        """Take the hostname: grant the lease and write the record. Raises
        HostnameTaken if another live agent has it (unless `replace`). Returns the
        lease of this agent's previous run, if its record was still live (the
        caller revokes it once everything is re-published under the new one)."""
        m = self.member
        self.lease = await self.kv.grant(self.ttl)
        for _ in range(20):
            cur = await self.kv.get(member_key(m.host))
            previous: int | None = None
            if cur is not None:
                try:
                    other = decode_member(cur)
                except ValueError:
                    other = None  # garbage: ours to overwrite
                if other is not None and other.verify != m.verify and not replace:
                    with contextlib.suppress(WorldError):
                        await self.kv.revoke(self.lease)
                    raise HostnameTaken(
                        f"hostname {m.host!r} is held by another live agent (address "
                        f"{other.address or '?'}, pid {other.pid or '?'}, started "
                        f"{_when(other.started)}): stop it, choose another --hostname, "
                        "or take it over with --replace"
                    )
                if other is not None and other.verify == m.verify and cur.lease:
                    previous = cur.lease  # our own earlier run (killed, or restarting)
            if await self.kv.cas(
                member_key(m.host),
                self._encode(),
                expect=cur.mod_revision if cur else 0,
                lease=self.lease,
            ):
                got = await self.kv.get(member_key(m.host))
                self._mod = got.mod_revision if got is not None else 0
                return previous
        raise WorldError(f"{member_key(m.host)}: kept changing while it was claimed")

    def _encode(self) -> bytes:
        return msgspec.json.encode(msgspec.structs.replace(self.member, timestamp=time.time()))

    async def _put(self) -> None:
        self._mod = await self.kv.put(
            member_key(self.member.host), self._encode(), lease=self.lease
        )

    async def run(self) -> None:
        """Keep the lease alive (every ttl/3), re-grant and re-write after an expiry,
        and watch the record: another agent taking it over sets `replaced`."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._keepalive())
            tg.create_task(self._watch_record())

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await self.kv.keepalive(self.lease)
            except LeaseExpired:
                log.warning("world: lease %x expired; granting a new one", self.lease)
                try:
                    self.lease = await self.kv.grant(self.ttl)
                    await self._put()
                except WorldError as e:
                    log.warning("world: cannot renew the member record: %s", e)
                    continue
                for fn in self._regrant:
                    fn()
            except WorldError as e:
                log.warning("world: keep-alive failed: %s", e)

    async def _watch_record(self) -> None:
        key = member_key(self.member.host)
        async with contextlib.aclosing(watch_one(self.kv, key)) as snaps:
            async for snap in snaps:
                if isinstance(snap, Tombstone):
                    continue  # expired: the keep-alive loop writes it again
                try:
                    m = decode_member(snap)
                except ValueError:
                    continue
                if m.verify != self.member.verify:
                    log.error(
                        "hostname %r was taken over by another agent (address %s, started "
                        "%s): stopping",
                        m.host,
                        m.address or "?",
                        _when(m.started),
                    )
                    self.replaced.set()
                    return

    async def stop(self) -> None:
        """Leave: the record and what the lease carries (exports) expire within the
        TTL, so a restart in between takes them back without a flap. Only a record
        still ours is marked: an agent that took the hostname over keeps its own."""
        if self.replaced.is_set():
            return
        with contextlib.suppress(WorldError):
            m = msgspec.structs.replace(self.member, state="stopped", timestamp=time.time())
            await self.kv.cas(
                member_key(m.host), msgspec.json.encode(m), expect=self._mod, lease=self.lease
            )
