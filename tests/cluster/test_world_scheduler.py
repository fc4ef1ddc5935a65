"""A scheduler volunteer in process, on the memory World and a fake clock: its
record, its lease and its election held over many TTLs in no real time."""

from __future__ import annotations

import asyncio
import contextlib

from evergraph.cluster.scheduler import Options, Volunteer, chosen_key, volunteer_key
from evergraph.world.follow import watch_one
from evergraph.world.kv import KeyValue
from evergraph.world.memory import MemoryKV, MemoryStore
from tests.kit.clocks import fake_clock

TTL = 3


def test_on_a_fake_clock_a_volunteer_holds_its_lease_and_leads_over_many_ttls() -> None:
    clock = fake_clock()

    async def body() -> None:
        store = MemoryStore(clock)
        kv, world = MemoryKV(store), MemoryKV(store)
        vol = Volunteer(kv, "web", "h1", Options(ttl=TTL), clock=clock)
        task = asyncio.create_task(vol.run())
        try:
            async with asyncio.timeout(10):
                await vol.volunteered.wait()
                await vol.election.wait_leader()
            rec = await world.get(volunteer_key("web", "h1"))
            assert rec is not None
            lease, term = rec.lease, vol.election.term
            async with (
                asyncio.timeout(10),
                contextlib.aclosing(watch_one(world, chosen_key("web"))) as snaps,
            ):
                async for snap in snaps:
                    if isinstance(snap, KeyValue):
                        break  # the leader made its choice
            for _ in range(10):
                await clock.advance(TTL)
            rec = await world.get(volunteer_key("web", "h1"))
            assert rec is not None
            assert rec.lease == lease  # kept alive, never granted anew
            assert vol.election.term == term  # led all along
            assert await world.get(chosen_key("web")) is not None
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await vol.leave(withdraw=False)
            await kv.close()
            await world.close()

    asyncio.run(body())
