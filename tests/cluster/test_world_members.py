"""Membership in process, on the memory World: the record held under its lease by
keep-alives on the injected clock (a fake one: many TTLs pass in no real time),
put back under a fresh lease when the lease is lost while the agent runs, and
keep-alives that fail slowly (a locked sqlite World) never holding the loop."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable

import pytest

from evergraph._util.clock import SYSTEM, Clock
from evergraph.cluster.members import Member, Membership, decode_member, member_key
from evergraph.world.kv import WorldError
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


class LockedKV(MemoryKV):
    """A memory client whose keep-alives fail as sqlite's do while another process
    holds the World locked: after waiting, in the loop, longer than a third of the
    TTL (sqlite's busy_timeout is 5 s, a third of the default TTL 3.3 s)."""

    failing = 0
    #: the other task's turns counted at each failed keep-alive
    turns_seen: list[int]

    def __init__(self, store: MemoryStore, turns: Callable[[], int]) -> None:
        super().__init__(store)
        self.turns = turns
        self.turns_seen = []

    async def keepalive(self, lease: int) -> None:
        if self.failing:
            self.failing -= 1
            self.turns_seen.append(self.turns())
            time.sleep(LOCKED_WAIT)  # noqa: ASYNC251 (in the loop, as sqlite3 waits: no await)
            raise WorldError("database is locked")
        await super().keepalive(lease)


#: a TTL whose third a locked World's wait outlasts
SHORT_TTL = 0.6
LOCKED_WAIT = 0.3


def test_keepalives_failing_slowly_give_the_loop_a_turn_between_two() -> None:
    """Each failed keep-alive of a locked World took longer than the next tick was
    away: retried at once, back to back, they held the event loop as long as the lock
    lasted (no log line flushed, no repair run). Between two, every other task has
    had its turn."""

    async def main() -> None:
        turns = 0

        async def other_task() -> None:
            nonlocal turns
            while True:
                await asyncio.sleep(0)
                turns += 1

        store = MemoryStore(SYSTEM)
        kv = LockedKV(store, lambda: turns)
        m = Membership(kv, Member(host="h1"), ttl=SHORT_TTL, clock=SYSTEM)
        assert await m.claim() is None
        ticker = asyncio.create_task(other_task())
        kv.failing = 4
        task = asyncio.create_task(m.run())
        try:
            deadline = time.monotonic() + 30
            while len(kv.turns_seen) < 4:
                assert time.monotonic() < deadline, "the keep-alives never failed"
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            ticker.cancel()
            for t in (task, ticker):
                with pytest.raises(asyncio.CancelledError):
                    await t
            await kv.close()
        seen = kv.turns_seen
        assert all(b > a for a, b in itertools.pairwise(seen)), seen

    asyncio.run(main())
