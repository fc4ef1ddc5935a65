"""Membership in process, on the memory World: the record held under its lease by
keep-alives on the injected clock (a fake one: many TTLs pass in no real time),
and put back under a fresh lease when the lease is lost while the agent runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from evergraph._util.clock import SYSTEM, Clock
from evergraph.cluster.members import Member, Membership, decode_member, member_key
from evergraph.world.memory import MemoryKV, MemoryStore
from tests.kit.clocks import fake_clock

TTL = 10.0


class CountingKV(MemoryKV):
    """A memory client that counts its keep-alives."""

    keepalives = 0

    async def keepalive(self, lease: int) -> None:
        self.keepalives += 1
        await super().keepalive(lease)


def run(
    body: Callable[[Membership, CountingKV, MemoryKV], Awaitable[None]], clock: Clock = SYSTEM
) -> None:
    """`body(membership, its client, another client)`, the membership claimed and
    running; stopped (cancelled) after."""

    async def main() -> None:
        store = MemoryStore(clock)
        kv, other = CountingKV(store), MemoryKV(store)
        m = Membership(kv, Member(host="h1"), ttl=TTL, clock=clock)
        assert await m.claim() is None
        task = asyncio.create_task(m.run())
        try:
            await body(m, kv, other)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await kv.close()
            await other.close()

    asyncio.run(main())


def test_keepalives_hold_the_record_over_many_ttls_of_the_clock() -> None:
    clock = fake_clock()

    async def body(m: Membership, kv: CountingKV, other: MemoryKV) -> None:
        rec = await other.get(member_key("h1"))
        assert rec is not None
        assert rec.lease == m.lease
        assert decode_member(rec).started == clock.time()  # the clock's time, not the host's
        for _ in range(10):
            await clock.advance(TTL)
        rec = await other.get(member_key("h1"))
        assert rec is not None
        assert rec.lease == m.lease  # the same lease all along
        assert kv.keepalives == 30  # one every ttl/3
        kv.keepalives = 0
        await clock.advance(TTL / 3 - 0.1)
        assert kv.keepalives == 0  # not before its time

    run(body, clock)


def test_a_lease_lost_while_running_is_granted_again_and_the_record_put_back() -> None:
    async def body(m: Membership, kv: CountingKV, other: MemoryKV) -> None:
        regranted = asyncio.Event()
        m.on_regrant(regranted.set)
        old = m.lease
        await other.revoke(old)  # as if it expired while the agent was away
        assert await other.get(member_key("h1")) is None
        await asyncio.wait_for(regranted.wait(), 10)
        rec = await other.get(member_key("h1"))
        assert rec is not None
        assert rec.lease == m.lease != old
        assert decode_member(rec).host == "h1"

    run(body)
