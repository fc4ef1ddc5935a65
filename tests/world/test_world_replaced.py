"""A World replaced under its clients (issue 11, item 9): a new etcd cluster at the
same address or restored etcd data, `world.sqlite` deleted and created anew by
another process, a reset memory World. Clients notice (`WorldReplaced` from
watches, a new `epoch`), and followers resync against the new World, reporting
what vanished with the old one.

Each backend's `Worlds` replaces its World at once: the new World is made
elsewhere first and then appears at the old address, so what a follower reports
does not depend on timing. (`test_sqlite_world_deleted_and_recreated_in_place`
does it the slow way, and checks only where the follower ends up.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sqlite3
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from evergraph.world.follow import Follower, Tombstone, follow, watch_one
from evergraph.world.kv import KV, KeyValue, WorldReplaced

TIMEOUT = 20.0

#: (key, value) written in order into a new World; None deletes
Writes = list[tuple[str, bytes | None]]


async def apply(kv: KV, writes: Writes) -> int:
    rev = 0
    for key, value in writes:
        if value is None:
            await kv.delete(key)
        else:
            rev = await kv.put(key, value)
    return rev


class Worlds:
    """One backend's World, and a way to put another World in its place."""

    backend = ""
    #: what the WorldReplaced message says on this backend (a regex)
    reason = ""

    def client(self) -> KV:
        raise NotImplementedError

    async def replace(self, writes: Writes) -> None:
        """A new World holding `writes` (applied in order) takes the old one's place."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemoryWorlds(Worlds):
    backend = "memory"
    reason = r"the memory World was reset"

    def __init__(self) -> None:
        from evergraph.world.memory import MemoryStore

        self.store: MemoryStore | None = None

    def client(self) -> KV:
        from evergraph.world.memory import MemoryKV, MemoryStore

        if self.store is None:  # its asyncio objects belong to the test's loop
            self.store = MemoryStore()
        return MemoryKV(self.store)

    async def replace(self, writes: Writes) -> None:
        from evergraph.world.memory import MemoryKV

        assert self.store is not None
        self.store.reset()
        # no await suspends in the memory World: nobody sees it half written
        await apply(MemoryKV(self.store), writes)


#: run by another process: make a new World at argv[2] with the writes in argv[3],
#: then put it in place of argv[1] (its log files first, then the file itself)
_SQLITE_REPLACE = """
import asyncio, json, os, sys
from evergraph.world.sqlite import SQLiteKV

path, new, writes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

async def main():
    kv = SQLiteKV(new)
    for key, value in writes:
        if value is None:
            await kv.delete(key)
        else:
            await kv.put(key, value.encode())
    await kv.close()  # the last connection: its -wal is merged and removed

asyncio.run(main())
for suffix in ("-wal", "-shm"):
    if os.path.exists(path + suffix):
        os.unlink(path + suffix)
os.replace(new, path)
"""


def _json_writes(writes: Writes) -> str:
    return json.dumps([(k, None if v is None else v.decode()) for k, v in writes])


class SQLiteWorlds(Worlds):
    backend = "sqlite"
    reason = r"world\.sqlite was recreated"

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "world.sqlite"

    def client(self) -> KV:
        from evergraph.world.sqlite import SQLiteKV

        return SQLiteKV(self.path)

    async def replace(self, writes: Writes) -> None:
        new = self.path.with_name("new.sqlite")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _SQLITE_REPLACE, str(self.path), str(new), _json_writes(writes)
        )
        assert await proc.wait() == 0


class EtcdWorlds(Worlds):
    """A replacement is another etcd server, with its own data dir, on the same
    client port. `same_cluster_id`: it also has the same name, peer URL and token,
    so etcd gives it the same cluster id: only its revision can tell."""

    backend = "etcd"
    reason = r"etcd at http://127\.0\.0\.1:\d+: cluster id [0-9a-f]+ -> [0-9a-f]+"

    def __init__(self, same_cluster_id: bool = False) -> None:
        from evergraph.world.etcd_server import EtcdServer, free_port

        self.same_cluster_id = same_cluster_id
        self.base = Path(tempfile.mkdtemp(prefix="evergraph-etcd-", dir="/dev/shm"))
        self.client_port, self.peer_port = free_port(), free_port()
        self.servers: list[EtcdServer] = []
        self.server = self._server(self.base / "w0", self.client_port, self.peer_port)
        self.server.start()

    def _server(self, data: Path, client_port: int, peer_port: int) -> Any:
        from evergraph.world.etcd_server import FAST_TIMING, EtcdServer

        s = EtcdServer(data, client_port=client_port, peer_port=peer_port, timing=FAST_TIMING)
        self.servers.append(s)
        return s

    def client(self) -> KV:
        from evergraph.world.etcd import EtcdKV

        return EtcdKV([self.server.client_url])

    async def replace(self, writes: Writes) -> None:
        from evergraph.world.etcd import EtcdKV
        from evergraph.world.etcd_server import free_port

        # the servers are started from the loop's thread (they die with the thread
        # that started them); clients wait meanwhile, as for any slow World
        self.server.stop()
        data = self.base / f"w{len(self.servers)}"
        peer = self.peer_port if self.same_cluster_id else free_port()
        making = self._server(data, free_port(), peer)
        making.start()
        async with EtcdKV([making.client_url]) as kv:
            await apply(kv, writes)
        making.stop()
        self.server = self._server(data, self.client_port, peer)
        self.server.start()

    def close(self) -> None:
        for s in self.servers:
            s.stop()
        shutil.rmtree(self.base, ignore_errors=True)


def _backends() -> list[Any]:
    etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")
    return ["memory", "sqlite", pytest.param("etcd", marks=etcd)]


@pytest.fixture(params=_backends())
def worlds(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Worlds]:
    w: Worlds
    if request.param == "memory":
        w = MemoryWorlds()
    elif request.param == "sqlite":
        w = SQLiteWorlds(tmp_path)
    else:
        w = EtcdWorlds()
    try:
        yield w
    finally:
        w.close()


def run(body: Any) -> None:
    async def main() -> None:
        await asyncio.wait_for(body(), 60)

    asyncio.run(main())


@contextlib.asynccontextmanager
async def clients(worlds: Worlds, n: int) -> AsyncIterator[list[KV]]:
    kvs = [worlds.client() for _ in range(n)]
    try:
        yield kvs
    finally:
        for kv in kvs:
            await kv.close()


# -- the KV ------------------------------------------------------------------------------


def test_clients_notice_the_replacement(worlds: Worlds, caplog: pytest.LogCaptureFixture) -> None:
    """A watch raises WorldReplaced (a Compacted, so old code re-reads); a client
    that only reads gets the new World's data and a new epoch; world_id changes."""

    async def body() -> None:
        async with clients(worlds, 3) as (writer, watcher, reader):
            await writer.put("k/old", b"1")
            rev = await writer.put("k/both", b"old")
            assert (await reader.get("k/both")) is not None
            assert (await watcher.get("k/both")) is not None  # etcd: id known once it answered
            old_id = watcher.world_id
            assert old_id != ""
            assert (watcher.epoch, reader.epoch) == (0, 0)
            it = watcher.watch("k/", rev + 1)
            pending = asyncio.ensure_future(it.__anext__())
            await asyncio.sleep(0)  # the watch is waiting
            await worlds.replace([("k/both", b"new"), ("k/new", b"2")])
            with pytest.raises(WorldReplaced, match=worlds.reason) as e:
                await asyncio.wait_for(pending, TIMEOUT)
            assert str(e.value).startswith("the World was replaced (")
            assert str(e.value).endswith("): resyncing")
            assert watcher.epoch == 1
            assert watcher.world_id not in ("", old_id)
            # a reader learns it from its next call: new data, a new epoch
            items, _ = await reader.range("k/")
            assert [(i.key, i.value) for i in items] == [("k/both", b"new"), ("k/new", b"2")]
            assert reader.epoch == 1
            assert reader.world_id == watcher.world_id
            # and writes go to the new World
            await writer.put("k/later", b"3")
            got = await watcher.get("k/later")
            assert got is not None
            assert got.value == b"3"
            # a watch of the new World works
            items, now = await watcher.range("k/")
            it2 = watcher.watch("k/", now + 1)
            await writer.delete("k/later")
            batch = await asyncio.wait_for(it2.__anext__(), TIMEOUT)
            assert [(ev.type, ev.key) for ev in batch] == [("delete", "k/later")]

    with caplog.at_level(logging.WARNING, logger="evergraph.world"):
        run(body)
    assert any("the World was replaced (" in r.getMessage() for r in caplog.records)


# -- follow ------------------------------------------------------------------------------


def rec(v: int) -> bytes:
    return json.dumps({"v": v}).encode()


class KeyedRecorder(Follower[tuple[str, int]]):
    """Follows `{"v": n}` records as (key, n) and keeps what it was told in `state`."""

    def __init__(self) -> None:
        self.calls: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.state: dict[str, int] = {}
        self.changed = asyncio.Event()

    def decode(self, kv: KeyValue) -> tuple[str, int]:
        return kv.key, int(json.loads(kv.value)["v"])

    async def new(self, obj: tuple[str, int]) -> None:
        self.state[obj[0]] = obj[1]
        self.calls.put_nowait(("new", *obj))

    async def updated(self, prev: tuple[str, int], new: tuple[str, int]) -> None:
        self.state[new[0]] = new[1]
        self.calls.put_nowait(("updated", new[0], prev[1], new[1]))

    async def deleted(self, prev: tuple[str, int]) -> None:
        del self.state[prev[0]]
        self.calls.put_nowait(("deleted", prev[0]))

    async def batch_done(self) -> None:
        self.calls.put_nowait(("done",))
        self.changed.set()

    async def synced(self) -> None:
        self.calls.put_nowait(("synced",))

    async def take(self, n: int) -> list[tuple[Any, ...]]:
        return [await asyncio.wait_for(self.calls.get(), TIMEOUT) for _ in range(n)]

    async def until(self, state: dict[str, int]) -> None:
        """Wait until what the follower was told is `state`."""
        async with asyncio.timeout(TIMEOUT):
            while self.state != state:
                self.changed.clear()
                await self.changed.wait()


@contextlib.asynccontextmanager
async def following(kv: KV, prefix: str, follower: Follower[Any]) -> AsyncIterator[None]:
    task = asyncio.create_task(follow(kv, prefix, follower))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # a follow that failed raises here


def test_follow_reports_the_difference_from_the_new_world(worlds: Worlds) -> None:
    """Both Worlds were written the same number of times: p/b has the same mod
    revision in both, with another value (reported: revisions of the old World
    are forgotten), p/c the same value (not reported), p/a vanished (deleted),
    p/d is new. One batch, then the follow goes on in the new World."""

    async def body() -> None:
        async with clients(worlds, 2) as (a, b):
            await a.put("p/a", rec(1))
            await a.put("p/b", rec(1))
            await a.put("p/c", rec(1))
            r = KeyedRecorder()
            async with following(b, "p/", r):
                assert await r.take(5) == [
                    ("new", "p/a", 1),
                    ("new", "p/b", 1),
                    ("new", "p/c", 1),
                    ("done",),
                    ("synced",),
                ]
                old_b = await a.get("p/b")
                await worlds.replace(
                    [("other", b"x"), ("p/b", rec(2)), ("p/c", rec(1)), ("p/d", rec(1))]
                )
                new_b = await a.get("p/b")
                assert old_b is not None
                assert new_b is not None
                assert new_b.mod_revision == old_b.mod_revision  # the trap is set
                assert await r.take(4) == [
                    ("updated", "p/b", 1, 2),
                    ("new", "p/d", 1),
                    ("deleted", "p/a"),
                    ("done",),
                ]
                await a.put("p/e", rec(5))
                await a.delete("p/b")
                assert await r.take(4) == [
                    ("new", "p/e", 5),
                    ("done",),
                    ("deleted", "p/b"),
                    ("done",),
                ]
                assert r.state == {"p/c": 1, "p/d": 1, "p/e": 5}

    run(body)


def test_follow_of_a_world_replaced_by_an_empty_one(worlds: Worlds) -> None:
    async def body() -> None:
        async with clients(worlds, 2) as (a, b):
            await a.put("p/a", rec(1))
            await a.put("p/b", rec(2))
            r = KeyedRecorder()
            async with following(b, "p/", r):
                assert (await r.take(4))[-1] == ("synced",)
                await worlds.replace([])
                assert await r.take(3) == [("deleted", "p/a"), ("deleted", "p/b"), ("done",)]
                await a.put("p/a", rec(3))
                assert await r.take(2) == [("new", "p/a", 3), ("done",)]

    run(body)


# -- watch_one ---------------------------------------------------------------------------


async def next_of(it: Any) -> KeyValue | Tombstone:
    return await asyncio.wait_for(it.__anext__(), TIMEOUT)


def value_of(snap: KeyValue | Tombstone) -> bytes | None:
    return None if isinstance(snap, Tombstone) else snap.value


def test_watch_one_after_the_world_was_replaced(worlds: Worlds) -> None:
    """w/gone is not in the new World: a Tombstone. w/same has the same value (at
    another revision): nothing. w/changed has the same mod revision, another
    value: the new snapshot."""

    async def body() -> None:
        async with clients(worlds, 2) as (a, b):
            await a.put("w/gone", b"g")
            await a.put("w/same", b"s")
            await a.put("w/changed", b"c1")
            gone, same, changed = (watch_one(b, k) for k in ("w/gone", "w/same", "w/changed"))
            try:
                assert value_of(await next_of(gone)) == b"g"
                old_same = await next_of(same)
                assert value_of(old_same) == b"s"
                old = await next_of(changed)
                assert value_of(old) == b"c1"
                # all three are watching when the World goes
                pending = [asyncio.ensure_future(next_of(it)) for it in (gone, same, changed)]
                await asyncio.sleep(0)
                await worlds.replace([("w/same", b"s"), ("x", b""), ("w/changed", b"c2")])
                snap = await pending[0]
                assert isinstance(snap, Tombstone)
                assert snap.key == "w/gone"
                new = await pending[2]
                assert value_of(new) == b"c2"
                assert isinstance(new, KeyValue)
                assert isinstance(old, KeyValue)
                assert new.mod_revision == old.mod_revision
                # w/same (another revision, the same value) yielded nothing for the
                # replacement: what it yields next is the next write
                now_same = await a.get("w/same")
                assert now_same is not None
                assert isinstance(old_same, KeyValue)
                assert now_same.mod_revision != old_same.mod_revision
                assert not pending[1].done()
                await a.put("w/same", b"s2")
                assert value_of(await pending[1]) == b"s2"
                await a.put("w/gone", b"back")
                assert value_of(await next_of(gone)) == b"back"
            finally:
                for it in (gone, same, changed):
                    await it.aclose()

    run(body)


# -- sqlite: deleted and created anew, in place -------------------------------------------

_SQLITE_RECREATE = """
import asyncio, os, sys
from evergraph.world.sqlite import SQLiteKV

path = sys.argv[1]
for suffix in ("", "-wal", "-shm"):
    os.unlink(path + suffix)

async def main():
    kv = SQLiteKV(path)
    await kv.put("p/b", b'{"v": 2}')
    await kv.put("p/new", b'{"v": 1}')
    await kv.close()

asyncio.run(main())
"""


def test_sqlite_world_deleted_and_recreated_in_place(tmp_path: Path) -> None:
    """Another process deletes world.sqlite (and its -wal and -shm) and opens the
    path again, which creates a new World, and writes to it. Whatever the follower
    saw in between, it ends with the new World's content; closing the clients of
    the old file leaves the new one intact."""
    worlds = SQLiteWorlds(tmp_path)

    async def body() -> None:
        async with clients(worlds, 2) as (a, b):
            await a.put("p/a", rec(1))
            await a.put("p/b", rec(1))
            r = KeyedRecorder()
            seen: list[KeyValue | Tombstone] = []
            async with following(b, "p/", r):
                one = watch_one(b, "p/a")
                try:
                    seen.append(await next_of(one))
                    await r.until({"p/a": 1, "p/b": 1})
                    proc = await asyncio.create_subprocess_exec(
                        sys.executable, "-c", _SQLITE_RECREATE, str(worlds.path)
                    )
                    assert await proc.wait() == 0
                    await r.until({"p/b": 2, "p/new": 1})
                    seen.append(await next_of(one))
                    assert isinstance(seen[-1], Tombstone)
                finally:
                    await one.aclose()
            assert b.epoch >= 1
        # every client of the old file is closed now: the new World is intact
        async with clients(worlds, 1) as (c,):
            items, _ = await c.range("p/")
            assert [(i.key, i.value) for i in items] == [("p/b", rec(2)), ("p/new", rec(1))]

    run(body)
    assert sorted(os.listdir(tmp_path)) == ["world.sqlite"]


def test_sqlite_world_id_is_kept_in_the_file(tmp_path: Path) -> None:
    from evergraph.world.sqlite import SQLiteKV

    async def body() -> None:
        a, b = SQLiteKV(tmp_path / "w.sqlite"), SQLiteKV(tmp_path / "w.sqlite")
        other = SQLiteKV(tmp_path / "other.sqlite")
        try:
            assert len(a.world_id) == 16
            assert a.world_id == b.world_id != other.world_id
            assert (a.epoch, b.epoch) == (0, 0)
        finally:
            for kv in (a, b, other):
                await kv.close()

    run(body)


# -- etcd: a new cluster that etcd gives the same id -----------------------------------------


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")
def test_etcd_revision_going_back_is_a_replacement(caplog: pytest.LogCaptureFixture) -> None:
    """Restored data, or a new cluster with the same member name, peer URL and
    token: the cluster id is the same, the revision went back."""
    worlds = EtcdWorlds(same_cluster_id=True)

    async def body() -> None:
        async with clients(worlds, 3) as (a, b, reader):
            for i in range(10):  # the old World is further on than the new one will be
                await a.put(f"p/{i}", rec(i))
            _, rev = await reader.range("p/")
            r = KeyedRecorder()
            async with following(b, "p/", r):
                assert (await r.take(12))[-1] == ("synced",)
                old_id = b.world_id
                assert old_id == reader.world_id != ""
                await worlds.replace([("p/0", rec(0)), ("p/1", rec(100))])
                assert await r.take(10) == [
                    ("updated", "p/1", 1, 100),
                    *[("deleted", f"p/{i}") for i in range(2, 10)],
                    ("done",),
                ]
                assert b.world_id == old_id  # the same cluster id: the revision told
                assert b.epoch == 1
            items, now = await reader.range("p/")
            assert now < rev
            assert [i.key for i in items] == ["p/0", "p/1"]
            assert reader.epoch == 1

    with caplog.at_level(logging.WARNING, logger="evergraph.world"):
        try:
            run(body)
        finally:
            worlds.close()
    assert any(
        "revision went back from" in r.getMessage() and "resyncing" in r.getMessage()
        for r in caplog.records
    )


def test_the_world_id_record_tells_an_etcd_replaced_under_the_same_id_with_a_revision_ahead(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The new cluster has the same id and is already further on than the old one:
    the client resumes its watch there and sees nothing wrong (the deletions are
    lost). The World's id record tells: the follower then reports what vanished."""
    from evergraph.world.worldid import WORLD_ID, WorldIdentity

    worlds = EtcdWorlds(same_cluster_id=True)

    async def body() -> None:
        async with clients(worlds, 2) as (a, b):
            ident = WorldIdentity(b)
            assert await ident.check() is None  # makes the record
            for i in range(5):
                await a.put(f"p/{i}", rec(i))
            r = KeyedRecorder()
            async with following(b, "p/", r):
                await r.until({f"p/{i}": i for i in range(5)})
                filler: Writes = [(f"f/{i}", b"x") for i in range(40)]
                await worlds.replace([*filler, ("p/0", rec(0)), ("p/1", rec(100))])
                _, _rev = await b.range("f/")
                assert b.epoch == 0  # the backend saw nothing
                why = await ident.check()
                assert why is not None
                assert f"its {WORLD_ID} record" in why
                assert b.epoch == 1
                await r.until({"p/0": 0, "p/1": 100})
                assert await ident.check() is None  # the new World's record, known now
                assert b.epoch == 1

    with caplog.at_level(logging.WARNING, logger="evergraph.world"):
        try:
            run(body)
        finally:
            worlds.close()
    assert any("world/id record" in r.getMessage() for r in caplog.records)


def test_a_client_that_found_the_world_rolled_back_tells_the_others(tmp_path: Path) -> None:
    """A backup restored in place: the writer that saw the revision go back bumps
    the World id record's epoch, so a client that had not looked before others
    wrote past its revision finds the World replaced too."""
    from evergraph.world.sqlite import SQLiteKV
    from evergraph.world.worldid import WorldIdentity

    db, backup = tmp_path / "world.sqlite", tmp_path / "backup.sqlite"

    async def body() -> None:
        w, f = SQLiteKV(db), SQLiteKV(db)
        try:
            wi, fi = WorldIdentity(w), WorldIdentity(f)
            assert await wi.check() is None
            assert await fi.check() is None
            for i in range(5):
                await w.put(f"p/{i}", rec(i))
            with (
                contextlib.closing(sqlite3.connect(db)) as src,
                contextlib.closing(sqlite3.connect(backup)) as dst,
            ):
                src.backup(dst)
            for i in range(5, 10):
                await w.put(f"p/{i}", rec(i))
            await w.range("p/")  # f has not read since: it saw revision 6, w 11
            with (
                contextlib.closing(sqlite3.connect(backup)) as src,
                contextlib.closing(sqlite3.connect(db)) as dst,
            ):
                src.backup(dst)
            await w.put("q/x", b"1")  # w: the revision went back
            assert w.epoch == 1
            assert await wi.check() is None  # already counted: it bumps the record
            for i in range(20):
                await w.put(f"q/{i}", b"1")  # now past what f saw
            assert f.epoch == 0
            why = await fi.check()
            assert why is not None
            assert "epoch 1 to" in why
            assert "epoch 2" in why
            assert f.epoch == 1
        finally:
            await w.close()
            await f.close()

    run(body)


# -- deploys -------------------------------------------------------------------------------


def test_deploys_follow_yields_the_new_worlds_deploy(worlds: Worlds) -> None:
    """The new World numbers its deploys afresh: its newest is yielded although its
    number is lower than the last one yielded. A World restored with the deploy
    already yielded yields nothing until its next deploy."""
    import nacl.signing

    from evergraph.cluster import deploys as dp
    from evergraph.world.memory import MemoryKV

    key = nacl.signing.SigningKey(b"\1" * 32)
    trust = dp.Trust(keys=[dp.verify_key_of(key)])

    async def publish(kv: KV, text: bytes) -> dp.Deploy:
        files = {"main.yaml": dp.Content(text, 0o644)}
        return await dp.publish(kv, "main.yaml", files, key=key, git=None, by="t@h")

    async def world_of(texts: list[bytes]) -> Writes:
        """The writes that make a World holding a deploy of each text."""
        scratch = MemoryKV()
        for text in texts:
            await publish(scratch, text)
        items, _ = await scratch.range("")
        await scratch.close()
        return [(i.key, i.value) for i in items]

    async def body() -> None:
        async with clients(worlds, 2) as (a, b):
            for i in range(3):
                old = await publish(a, f"old {i}".encode())
            it = dp.follow(b, trust).__aiter__()
            try:
                assert (await asyncio.wait_for(it.__anext__(), TIMEOUT)).hash == old.hash
                pending = asyncio.ensure_future(it.__anext__())
                await asyncio.sleep(0)
                await worlds.replace(await world_of([b"new 0"]))
                got = await asyncio.wait_for(pending, TIMEOUT)
                assert (got.n, got.hash) == (1, (await dp.latest(a) or old).hash)
                assert got.hash != old.hash
                d2 = await publish(a, b"new 1")
                assert (await asyncio.wait_for(it.__anext__(), TIMEOUT)).hash == d2.hash
                # the same World again (restored): nothing new, then its next deploy
                items, _ = await a.range("")
                pending = asyncio.ensure_future(it.__anext__())
                await worlds.replace([(i.key, i.value) for i in items])
                assert (await dp.latest(a) or old).hash == d2.hash
                d3 = await publish(a, b"new 2")
                assert d3.n == 3
                assert (await asyncio.wait_for(pending, TIMEOUT)).hash == d3.hash
            finally:
                await it.aclose()  # type: ignore[attr-defined]

    run(body)


# -- a forged world/id (issue 22, round 2, item 4) ------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "etcd"])
def test_a_forged_world_id_makes_agents_republish_never_stop_nor_adopt(
    kind: str, tmp_path: Path, agents: Any, servers: list[Any], shm: Path
) -> None:
    """Whoever writes the World can rewrite `world/id` (a new id, an epoch far
    ahead, garbage): each agent takes it for another World and re-publishes what it
    owns (its lease, member record, host key, exports), compared by content: a
    resync. No agent stops, nothing it applied is dropped or swapped, and nothing
    the attacker wrote alongside (an export forged "from" the exporter) is applied."""
    from evergraph.cluster.hostkeys import HostKeys
    from evergraph.world.kv import Put
    from tests.conftest import wait_for
    from tests.kit.identity_attacks import (
        COLLECT_FILES,
        AttackWorld,
        file_export_graph,
        forged_export,
    )

    world = AttackWorld(kind, tmp_path, servers, shm)
    target = tmp_path / "on-b" / "conf"
    ga, gb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    ga.write_text(file_export_graph("a", target, "v1\n"))
    gb.write_text(COLLECT_FILES)
    eb = agents(gb, tmp_path / "sb", "--hostname", "eb", *world.args)
    eb.wait_converged()
    ea = agents(ga, tmp_path / "sa", "--hostname", "ea", *world.args)
    wait_for(lambda: target.exists() and target.read_text() == "v1\n", what="v1 on eb")
    wait_for(lambda: eb.log.read_text().count("collected exports changed") >= 1, what="eb swap")
    swaps = eb.log.read_text().count("collected exports changed")
    known = world.get("world/id")
    assert known is not None
    mallory = HostKeys(tmp_path / "mallory")
    forged_path = tmp_path / "on-b" / "forged"
    forged_id = json.dumps({"id": "0123456789abcdef", "epoch": 999, "created": 1.0}).encode()
    for value in (forged_id, b"not a world id"):

        async def attack(kv: KV, value: bytes = value) -> None:
            rev = await kv.txn(
                [], [Put("world/id", value), *forged_export(mallory, "ea", "*", forged_path, "x")]
            )
            assert rev is not None

        world.call(attack)
        for a in (ea, eb):
            wait_for(
                lambda a=a, n=int(value != forged_id): (
                    a.log.read_text().count("the World was replaced") > n
                ),
                what=f"{a.log.parent.name} re-publishing after the forged world/id",
            )
        # what each owns is in the World again, under a live lease
        for key in ("hostkeys/ea", "hostkeys/eb", "members/ea", "members/eb"):
            wait_for(lambda key=key: world.get(key) is not None, what=f"{key} there")
        assert ea.proc.poll() is None
        assert eb.proc.poll() is None
    # eb never dropped the export (no swap), and applied nothing forged
    assert target.read_text() == "v1\n"
    assert eb.log.read_text().count("collected exports changed") == swaps
    assert not forged_path.exists()
    # (the garbage stays the World's id: only a change of the record matters, and
    # the next one is noticed the same way)
    for a in (ea, eb):
        assert "Traceback" not in a.log.read_text()
    assert ea.stop() == 0
    assert eb.stop() == 0


def test_a_write_refused_for_an_expired_lease_is_no_replacement(tmp_path: Path) -> None:
    """A put under a lease that has expired sweeps the expired leases and is then
    refused: the transaction rolls back, and the revisions it counted on the way
    (the sweep's, the put's) were never the World's. The next read must not take
    the World's real revision for a restored copy (it once did: every agent then
    re-published everything and a farm worker never came back from FAILED)."""
    from evergraph.world.kv import LeaseExpired
    from evergraph.world.sqlite import SQLiteKV

    async def main() -> None:
        kv = SQLiteKV(tmp_path / "w.sqlite")
        try:
            lease = await kv.grant(0.05)
            await kv.put("a", b"1", lease=lease)
            await kv.put("b", b"1")
            await asyncio.sleep(0.2)  # the lease's TTL, on the clock the file keeps
            with pytest.raises(LeaseExpired):
                await kv.put("a", b"2", lease=lease)
            assert await kv.get("a") is None  # (swept by a later call)
            _, _rev = await kv.range("")
            assert kv.epoch == 0, "a refused write made the World look replaced"
        finally:
            await kv.close()

    asyncio.run(main())


def test_a_lease_id_is_never_given_twice(tmp_path: Path) -> None:
    """An expired lease's id is never granted again: an agent still holding it
    would keep someone else's lease alive, and never learn its own had gone."""
    from evergraph.world.kv import LeaseExpired
    from evergraph.world.sqlite import SQLiteKV

    async def main() -> None:
        kv = SQLiteKV(tmp_path / "w.sqlite")
        try:
            first = await kv.grant(60)
            second = await kv.grant(0.05)
            await asyncio.sleep(0.2)
            with pytest.raises(LeaseExpired):
                await kv.keepalive(second)  # swept: gone
            third = await kv.grant(60)
            assert third not in (first, second)
            with pytest.raises(LeaseExpired):
                await kv.keepalive(second)
            await kv.revoke(third)
        finally:
            await kv.close()
        kv = SQLiteKV(tmp_path / "w.sqlite")  # and across a reopen
        try:
            assert await kv.grant(60) not in (first, second, third)
        finally:
            await kv.close()

    asyncio.run(main())
