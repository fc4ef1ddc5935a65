"""Cluster members: each agent's record `members/<host>`, kept alive by a lease.

A record carries what other hosts need to reach and trust this one: its
address, its public keys (encryption and signature), capabilities, groups,
state and version. A dead agent's lease expires and its record vanishes.
Keys are also published without a lease under `hostkeys/<host>`, so exports
of a host that is down can still be verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec

from evergraph.world.kv import KV, KeyValue, LeaseKeeper, WorldError, log

MEMBERS = "members/"
HOSTKEYS = "hostkeys/"
DEFAULT_TTL = 10.0


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


class HostKeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    public: str
    verify: str


_member_decoder = msgspec.json.Decoder(Member)
_keys_decoder = msgspec.json.Decoder(HostKeyRecord)


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


def decode_hostkeys(kv: KeyValue) -> HostKeyRecord:
    try:
        return _keys_decoder.decode(kv.value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{kv.key}: not a host key record: {e}") from None


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


async def host_keys(kv: KV, host: str) -> HostKeyRecord | None:
    item = await kv.get(f"{HOSTKEYS}{host}")
    if item is None:
        return None
    try:
        return decode_hostkeys(item)
    except ValueError as e:
        log.warning("world: %s", e)
        return None


class Membership:
    """Registers this host and keeps its record alive until `stop()`."""

    def __init__(self, kv: KV, member: Member, ttl: float = DEFAULT_TTL) -> None:
        self.kv = kv
        self.member = member
        self.keeper = LeaseKeeper(kv, ttl)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        m = self.member
        keys = HostKeyRecord(host=m.host, public=m.public, verify=m.verify)
        await self.kv.put(f"{HOSTKEYS}{m.host}", msgspec.json.encode(keys))
        await self.keeper.start()
        await self._put()
        self._task = asyncio.create_task(self._reput(), name="member-reput")

    async def _put(self) -> None:
        m = msgspec.structs.replace(self.member, timestamp=time.time())
        await self.kv.put(member_key(m.host), msgspec.json.encode(m), lease=self.keeper.lease)

    async def _reput(self) -> None:
        while True:
            await self.keeper.regranted.wait()
            self.keeper.regranted.clear()
            try:
                await self._put()
            except WorldError as e:
                log.warning("world: cannot renew the member record: %s", e)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.keeper.stop(revoke=True)
