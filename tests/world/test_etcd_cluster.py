"""The etcd membership API's pure parts, and a client that follows its cluster:
`EtcdKV.set_endpoints` swaps the endpoints under running calls and watches.
Real etcd processes on loopback, data on /dev/shm."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from evergraph.world.etcd import EtcdKV
from evergraph.world.etcd_cluster import (
    EtcdMember,
    follow_members,
    initial_cluster,
    member_list,
    member_status,
)
from evergraph.world.etcd_server import EtcdServer, free_port
from evergraph.world.kv import Event, WorldError

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")


def run(body: Callable[[], Awaitable[None]], timeout: float = 60) -> None:
    async def main() -> None:
        await asyncio.wait_for(body(), timeout)

    asyncio.run(main())


def member(id: int, name: str, peer: str, learner: bool = False) -> EtcdMember:
    return EtcdMember(id, name, (peer,), (), learner)


def test_initial_cluster_names_every_started_member_and_the_joiner() -> None:
    members = [
        member(1, "a", "https://10.0.0.1:2380"),
        EtcdMember(2, "b", ("https://10.0.0.2:2380", "https://b.example:2380"), (), False),
        member(3, "", "https://10.0.0.3:2380", learner=True),  # the joiner, not started
    ]
    assert initial_cluster(members, "c", "https://10.0.0.3:2380") == (
        "a=https://10.0.0.1:2380,b=https://10.0.0.2:2380,b=https://b.example:2380,"
        "c=https://10.0.0.3:2380"
    )
    # the joiner not in the list (yet): added all the same, once
    assert initial_cluster(members[:1], "c", "https://10.0.0.3:2380") == (
        "a=https://10.0.0.1:2380,c=https://10.0.0.3:2380"
    )


def test_set_endpoints_keeps_the_current_channel_and_closes_dropped_ones(
    shm: Path, servers: list[EtcdServer]
) -> None:
    server = EtcdServer.single(shm / "e")
    servers.append(server)
    server.start()
    dead = f"http://127.0.0.1:{free_port()}"

    async def body() -> None:
        kv = EtcdKV([dead, server.client_url], timeout=5)
        kv._current = 0
        await kv.put("k", b"v")  # the dead one tried first: both have a channel now
        assert kv.endpoints == (dead, server.client_url)
        live = kv._endpoints[1]
        channel = live.channel
        gone = kv._endpoints[0]
        assert channel is not None
        assert gone.channel is not None
        other = f"127.0.0.1:{free_port()}"
        kv.set_endpoints([other, server.client_url, server.client_url])
        assert kv.endpoints == (f"http://{other}", server.client_url)
        assert kv._endpoints[kv._current] is live  # the one in use stays current
        assert kv._endpoints[0].channel is None  # a new one connects when first used
        assert gone.channel is not None  # closed at the next call
        got = await kv.get("k")
        assert got is not None
        assert got.value == b"v"
        assert live.channel is channel
        assert gone.channel is None
        with pytest.raises(WorldError, match="no etcd endpoints given"):
            kv.set_endpoints([])
        with pytest.raises(WorldError, match="bad etcd endpoint"):
            kv.set_endpoints(["ftp://x:1"])
        assert kv.endpoints == (f"http://{other}", server.client_url)
        # a member that is down has no status; one that is up tells its own
        assert await member_status(kv, dead) is None
        st = await member_status(kv, server.client_url)
        assert st is not None
        assert st.leader == st.id
        assert not st.is_learner
        assert st.raft_index > 0
        await kv.close()
        with pytest.raises(WorldError, match="closed"):
            kv.set_endpoints([dead])

    run(body)


def test_a_client_given_one_member_follows_the_cluster_when_it_dies(
    shm: Path, servers: list[EtcdServer]
) -> None:
    cluster = EtcdServer.cluster(3, shm)
    servers.extend(cluster)
    EtcdServer.start_all(cluster)
    m0 = cluster[0]

    async def body() -> None:
        kv = EtcdKV([m0.client_url], timeout=10)
        members = await member_list(kv)
        assert [m.name for m in members] == ["m0", "m1", "m2"]
        # what an agent runs for any etcd World: the endpoints follow the member list
        follower = asyncio.create_task(follow_members(kv, every=0.05))
        deadline = time.monotonic() + 10
        while set(kv.endpoints) != {m.client_url for m in cluster}:
            assert time.monotonic() < deadline, f"endpoints stayed {kv.endpoints}"
            await asyncio.sleep(0.01)
        await kv.put("w/a", b"1")
        events: list[Event] = []

        async def watch() -> None:
            async for batch in kv.watch("w/", 1):
                events.extend(batch)

        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(watch())
            deadline = time.monotonic() + 10
            while not events:
                assert time.monotonic() < deadline, "the watch saw nothing"
                await asyncio.sleep(0.01)
            m0.kill()
            # reads and writes go on (through m1 or m2), and the watch with them
            await kv.put("w/b", b"2")
            got = await kv.get("w/a")
            assert got is not None
            assert got.value == b"1"
            deadline = time.monotonic() + 20
            while [e.key for e in events] != ["w/a", "w/b"]:
                assert time.monotonic() < deadline, f"the watch saw {events}"
                await asyncio.sleep(0.01)
            watcher.cancel()
        assert [m.name for m in await member_list(kv)] == ["m0", "m1", "m2"]
        follower.cancel()
        await kv.close()

    run(body)
