"""The World KV contract, run against every backend (memory, sqlite, etcd)."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evergraph.world.kv import KV, Compacted, Event, LeaseExpired, WorldReplaced
from tests.kit.worlds import BACKENDS, Factory, run_pair, world_factory


@pytest.fixture(params=BACKENDS)
def factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    with world_factory(request.param, tmp_path) as (make, _server):
        yield make


run = run_pair


async def next_batch(it: object) -> list[Event]:
    return await asyncio.wait_for(it.__anext__(), 10)  # type: ignore[attr-defined,no-any-return]


def test_put_get_range_and_revisions(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        r1 = await a.put("t/b", b"2")
        r2 = await a.put("t/a", b"1")
        r3 = await a.put("t/b", b"3")
        await a.put("u/x", b"other prefix")
        assert r1 < r2 < r3
        kv = await b.get("t/b")
        assert kv is not None
        assert (kv.value, kv.create_revision, kv.mod_revision) == (b"3", r1, r3)
        assert await b.get("t/none") is None
        items, rev = await b.range("t/")
        assert [(i.key, i.value) for i in items] == [("t/a", b"1"), ("t/b", b"3")]
        assert rev >= r3
        assert await a.delete("t/a") is True
        assert await a.delete("t/a") is False
        await a.put("t/c", b"")  # an empty value is a value
        assert await a.delete_prefix("t/") == 2
        assert (await b.range("t/"))[0] == []
        assert await b.get("u/x") is not None

    run(factory, body)


def test_compare_and_swap(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        assert await a.cas("lock", b"a", expect=0) is True  # create if absent
        assert await b.cas("lock", b"b", expect=0) is False  # someone holds it
        kv = await b.get("lock")
        assert kv is not None
        assert kv.value == b"a"
        assert await b.cas("lock", b"b", expect=kv.mod_revision) is True
        assert await a.cas("lock", b"stale", expect=kv.mod_revision) is False
        cur = await a.get("lock")
        assert cur is not None
        assert cur.value == b"b"
        assert await a.cas("lock", None, expect=cur.mod_revision) is True  # delete
        assert await a.get("lock") is None

    run(factory, body)


def test_watch_sees_another_clients_writes_in_revision_batches(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        start = await a.put("other", b"x") + 1
        it = b.watch("w/", start)
        r1 = await a.put("w/1", b"one")
        await a.put("not-w", b"skip")
        r2 = await a.put("w/2", b"two")
        await a.delete_prefix("w/")
        got = [await next_batch(it) for _ in range(3)]
        assert [[(e.type, e.key, e.value) for e in batch] for batch in got] == [
            [("put", "w/1", b"one")],
            [("put", "w/2", b"two")],
            [("delete", "w/1", b""), ("delete", "w/2", b"")],  # one revision, one batch
        ]
        assert got[0][0].revision == r1
        assert got[1][0].revision == r2
        assert got[2][0].revision == got[2][1].revision > r2

    run(factory, body)


def test_watch_resumes_from_a_past_revision(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        r1 = await a.put("r/1", b"1")
        r2 = await a.put("r/2", b"2")
        await a.put("r/3", b"3")
        it = b.watch("r/", r2)  # history from r2 on, as after a reconnect
        got = [(await next_batch(it))[0].key for _ in range(2)]
        assert got == ["r/2", "r/3"]
        it2 = b.watch("r/", r1)
        assert (await next_batch(it2))[0].key == "r/1"

    run(factory, body)


def test_compacted_history_raises(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        r1 = await a.put("c/1", b"1")
        r2 = await a.put("c/2", b"2")
        await a.put("c/3", b"3")
        await a.compact(r2)
        with pytest.raises(Compacted):
            await next_batch(b.watch("c/", r1))
        it = b.watch("c/", r2 + 1)  # still in history
        assert (await next_batch(it))[0].key == "c/3"

    run(factory, body)


def test_world_identity(factory: Factory) -> None:
    """Clients of one World agree on its id and have seen no replacement (what
    happens when there is one: test_world_replaced.py)."""

    async def body(a: KV, b: KV) -> None:
        await a.put("x", b"1")
        assert await b.get("x") is not None  # etcd learns the id from an answer
        assert a.world_id == b.world_id != ""
        assert (a.epoch, b.epoch) == (0, 0)
        # code that re-reads after a Compacted re-reads after a replacement too
        assert issubclass(WorldReplaced, Compacted)
        e = WorldReplaced("cluster id 1 -> 2")
        assert str(e) == "the World was replaced (cluster id 1 -> 2): resyncing"

    run(factory, body)


def test_leases_expire_and_take_their_keys(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        lease = await a.grant(1)
        await a.put("l/member", b"alive", lease=lease)
        rev = await a.put("l/plain", b"stays")
        it = b.watch("l/", rev + 1)
        # no keep-alive: the lease ends within its TTL (etcd may round it up)
        batch = await asyncio.wait_for(it.__anext__(), 10)
        assert [(e.type, e.key) for e in batch] == [("delete", "l/member")]
        assert await b.get("l/plain") is not None
        with pytest.raises(LeaseExpired):
            await a.keepalive(lease)
        with pytest.raises(LeaseExpired):
            await a.put("l/late", b"x", lease=lease)

    run(factory, body)


def test_keepalive_and_revoke(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        lease = await a.grant(1)
        await a.put("k/1", b"1", lease=lease)
        for _ in range(6):  # 1.8 s, longer than the TTL: kept alive
            await asyncio.sleep(0.3)
            await a.keepalive(lease)
        assert await b.get("k/1") is not None
        await a.revoke(lease)
        assert await b.get("k/1") is None

    run(factory, body)


def test_closed_client_ends_its_watch(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        rev = await a.put("x", b"1")
        it = b.watch("x", rev + 1)
        task = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)  # let the watch start
        await b.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(task, 10)

    run(factory, body)


def _open_and_put(path: str, barrier: Any) -> None:
    from evergraph.world.sqlite import SQLiteKV

    barrier.wait()  # every process creates the file at the same moment

    async def main() -> None:
        kv = SQLiteKV(path)
        await kv.put(f"p/{os.getpid()}", b"v")
        await kv.close()

    asyncio.run(main())


def test_sqlite_world_created_by_several_processes_at_once(tmp_path: Path) -> None:
    # forked children inherit this process's garbage: gRPC objects from earlier etcd
    # tests, finalised in a child, spin there. Collect it before forking.
    gc.collect()
    ctx = multiprocessing.get_context("fork")
    for i in range(40):  # the race is rare: many rounds
        path = str(tmp_path / f"w{i}.sqlite")
        barrier = ctx.Barrier(4)
        procs = [ctx.Process(target=_open_and_put, args=(path, barrier)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
