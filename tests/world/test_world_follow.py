"""The follow library (SPEC §4.2): `watch_one` and `follow` on every real backend.

Broken connections are made by `FlakyKV`, a switch in front of a real backend
(it holds or cuts the watch stream as a dropped connection would); compaction
is the backend's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from evergraph.world.follow import Follower, SimpleFollower, Tombstone, follow, watch_one
from evergraph.world.kv import KV, Compacted, Event, KeyValue, WorldError
from evergraph.world.memory import MemoryKV, MemoryStore
from tests.kit.worlds import Factory, run_pair, world_factory


def _backends() -> list[str]:
    out = ["memory", "sqlite"]
    try:
        import evergraph.world.etcd  # noqa: F401
    except Exception:  # not written yet (or its client library is missing)
        return out
    return [*out, "etcd"]


BACKENDS = _backends()
TIMEOUT = 10.0


@pytest.fixture(params=BACKENDS)
def factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    with world_factory(request.param, tmp_path) as (make, _server):
        yield make


run = run_pair


# -- a switch in front of a real backend --------------------------------------------


class FlakyKV(KV):
    """Passes everything to `inner`, except that `hold()` stops the watch stream
    (batches wait) and `cut()` then fails it: the held batch is lost and the watch
    raises, as when a connection drops. `fail_ranges` makes the next reads fail.

    `held()` waits until a batch is waiting at the switch: the backend's watch is
    then parked at its yield, and only the switch decides what happens next.
    `blind`: hide the backend's epoch (a KV that does not notice a replaced World)."""

    name = "flaky"

    def __init__(self, inner: KV, blind: bool = False) -> None:
        self.inner = inner
        self.blind = blind
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.waiting = asyncio.Event()
        self.error: WorldError | None = None
        self.fail_ranges = 0
        self.ranges = 0
        self._read = asyncio.Condition()
        self._reads_ok = 0
        self.watch_starts: list[int] = []

    @property
    def epoch(self) -> int:
        return 0 if self.blind else self.inner.epoch

    @property
    def world_id(self) -> str:
        return "" if self.blind else self.inner.world_id

    def hold(self) -> None:
        self.waiting.clear()
        self.flowing.clear()

    async def held(self) -> None:
        await asyncio.wait_for(self.waiting.wait(), TIMEOUT)

    def cut(self, error: WorldError | None = None) -> None:
        self.error = error or WorldError("connection lost (test)")
        self.flowing.set()

    async def get(self, key: str) -> KeyValue | None:
        return await self.inner.get(key)

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        self.ranges += 1
        if self.fail_ranges:
            self.fail_ranges -= 1
            raise WorldError("unreachable (test)")
        out = await self.inner.range(prefix)
        async with self._read:
            self._reads_ok += 1
            self._read.notify_all()
        return out

    async def reads(self, n: int) -> None:
        """Wait until `n` reads (range calls) have succeeded."""
        async with self._read:
            await asyncio.wait_for(self._read.wait_for(lambda: self._reads_ok >= n), TIMEOUT)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        return await self.inner.put(key, value, lease=lease)

    async def delete(self, key: str) -> bool:
        return await self.inner.delete(key)

    async def delete_prefix(self, prefix: str) -> int:
        return await self.inner.delete_prefix(prefix)

    async def cas(self, key: str, value: bytes | None, *, expect: int, lease: int = 0) -> bool:
        return await self.inner.cas(key, value, expect=expect, lease=lease)

    async def grant(self, ttl: float) -> int:
        return await self.inner.grant(ttl)

    async def keepalive(self, lease: int) -> None:
        await self.inner.keepalive(lease)

    async def revoke(self, lease: int) -> None:
        await self.inner.revoke(lease)

    async def watch(self, prefix: str, start: int) -> AsyncIterator[list[Event]]:
        self.watch_starts.append(start)
        it = self.inner.watch(prefix, start)
        try:
            async for batch in it:
                if not self.flowing.is_set():
                    self.waiting.set()
                    await self.flowing.wait()
                if self.error is not None:
                    error, self.error = self.error, None
                    raise error
                yield batch
        finally:
            await it.aclose()  # type: ignore[attr-defined]

    async def compact(self, revision: int) -> None:
        await self.inner.compact(revision)

    async def close(self) -> None:
        await self.inner.close()


# -- a follower that records what it is told ----------------------------------------


@dataclass(frozen=True)
class Item:
    key: str
    up: bool
    v: int
    note: str = ""


def rec(v: int, up: bool = True, note: str = "") -> bytes:
    return json.dumps({"up": up, "v": v, "note": note}).encode()


def decode_item(kv: KeyValue) -> Item:
    try:
        d = json.loads(kv.value)  # UnicodeDecodeError and JSONDecodeError are ValueErrors
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    return Item(kv.key, bool(d.get("up", True)), int(d.get("v", 0)), str(d.get("note", "")))


class Recorder(Follower[Item]):
    """Follows records whose `up` is true; `note` is no change (see equals)."""

    def __init__(self) -> None:
        self.calls: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()

    def decode(self, kv: KeyValue) -> Item:
        return decode_item(kv)

    def filter(self, obj: Item) -> bool:
        return obj.up

    def equals(self, a: Item, b: Item) -> bool:
        return (a.up, a.v) == (b.up, b.v)

    async def new(self, obj: Item) -> None:
        self.calls.put_nowait(("new", obj.key, obj.v))

    async def updated(self, prev: Item, new: Item) -> None:
        assert prev.key == new.key
        self.calls.put_nowait(("updated", new.key, prev.v, new.v))

    async def deleted(self, prev: Item) -> None:
        self.calls.put_nowait(("deleted", prev.key))

    async def batch_done(self) -> None:
        self.calls.put_nowait(("done",))

    async def synced(self) -> None:
        self.calls.put_nowait(("synced",))

    async def take(self, n: int) -> list[tuple[Any, ...]]:
        return [await asyncio.wait_for(self.calls.get(), TIMEOUT) for _ in range(n)]


@contextlib.asynccontextmanager
async def following(kv: KV, prefix: str, follower: Follower[Any]) -> AsyncIterator[None]:
    task = asyncio.create_task(follow(kv, prefix, follower))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # a follow that failed raises here


# -- follow -------------------------------------------------------------------------


def test_spec_sequence_filter_out_and_back_in(factory: Factory) -> None:
    """SPEC §4.2: add, filter-out, filter-in, filter-out, delete → new, deleted, new,
    deleted, each batch closed by batch_done; the deletion of a key already outside
    the filter reports nothing (the sentinel h2 comes next)."""

    async def body(a: KV, b: KV) -> None:
        r = Recorder()
        async with following(b, "hosts/", r):
            assert await r.take(1) == [("synced",)]  # empty prefix: no batch at all
            await a.put("hosts/h1", rec(1))
            await a.put("hosts/h1", rec(2, up=False))
            await a.put("hosts/h1", rec(3))
            await a.put("hosts/h1", rec(4, up=False))
            await a.delete("hosts/h1")
            await a.put("other/h1", rec(9))  # outside the prefix
            await a.put("hosts/h2", rec(5))
            assert await r.take(10) == [
                ("new", "hosts/h1", 1),
                ("done",),
                ("deleted", "hosts/h1"),
                ("done",),
                ("new", "hosts/h1", 3),
                ("done",),
                ("deleted", "hosts/h1"),
                ("done",),
                ("new", "hosts/h2", 5),
                ("done",),
            ]

    run(factory, body)


def test_initial_snapshot_is_one_batch_in_key_order_then_synced(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        for key in ("p/c", "p/a", "p/b"):
            await a.put(key, rec(ord(key[-1])))
        await a.put("p/x", rec(0, up=False))
        await a.put("q/a", rec(0))
        r = Recorder()
        async with following(b, "p/", r):
            assert await r.take(5) == [
                ("new", "p/a", ord("a")),
                ("new", "p/b", ord("b")),
                ("new", "p/c", ord("c")),
                ("done",),
                ("synced",),
            ]
            # one revision deleting four keys: one batch, in key order, p/x silent
            assert await a.delete_prefix("p/") == 4
            assert await r.take(4) == [
                ("deleted", "p/a"),
                ("deleted", "p/b"),
                ("deleted", "p/c"),
                ("done",),
            ]

    run(factory, body)


def test_equals_decides_what_is_an_update(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        r = Recorder()
        async with following(b, "p/", r):
            assert await r.take(1) == [("synced",)]
            await a.put("p/a", rec(1))
            await a.put("p/a", rec(1, note="only the note"))  # equal for the follower
            await a.put("p/a", rec(2))
            await a.put("p/z", rec(0))
            assert await r.take(6) == [
                ("new", "p/a", 1),
                ("done",),
                ("updated", "p/a", 1, 2),
                ("done",),
                ("new", "p/z", 0),
                ("done",),
            ]

    run(factory, body)


def test_broken_stream_resumes_from_the_last_revision(factory: Factory) -> None:
    """The World is unreachable at first (retried), then the stream breaks while
    changes happen: they are all reported, each as it happened, deletions too."""

    async def body(a: KV, b: KV) -> None:
        flaky = FlakyKV(b)
        flaky.fail_ranges = 2
        await a.put("p/a", rec(1))
        r_init = await a.put("p/b", rec(1))
        r = Recorder()
        async with following(flaky, "p/", r):
            assert await r.take(4) == [("new", "p/a", 1), ("new", "p/b", 1), ("done",), ("synced",)]
            assert flaky.ranges == 3
            r1 = await a.put("p/z", rec(0))
            assert await r.take(2) == [("new", "p/z", 0), ("done",)]
            flaky.hold()
            await a.delete("p/a")
            await flaky.held()
            await a.put("p/b", rec(2))
            await a.put("p/c", rec(1))
            flaky.cut()
            assert await r.take(6) == [
                ("deleted", "p/a"),
                ("done",),
                ("updated", "p/b", 1, 2),
                ("done",),
                ("new", "p/c", 1),
                ("done",),
            ]
            assert flaky.watch_starts == [r_init + 1, r1 + 1]
            assert flaky.ranges == 3  # resumed, not re-read

    run(factory, body)


def test_resync_after_compaction_reports_what_vanished(factory: Factory) -> None:
    """While the stream is down the history it would resume from is compacted: the
    follow re-reads the prefix and reports the difference as one batch —
    new/updated in key order, then deleted in key order, then batch_done."""

    async def body(a: KV, b: KV) -> None:
        flaky = FlakyKV(b)
        for key in ("p/b", "p/d", "p/f", "p/g"):
            await a.put(key, rec(1))
        r = Recorder()
        async with following(flaky, "p/", r):
            assert await r.take(6) == [
                ("new", "p/b", 1),
                ("new", "p/d", 1),
                ("new", "p/f", 1),
                ("new", "p/g", 1),
                ("done",),
                ("synced",),
            ]
            flaky.hold()
            await a.delete("p/b")
            # the backend's watch must be parked before compacting: the memory
            # backend's live watch spins if history vanishes under it
            await flaky.held()
            await a.put("p/d", rec(2))
            await a.put("p/c", rec(1))
            await a.put("p/e", rec(1))
            await a.put("p/f", rec(2, up=False))  # left the filter
            await a.put("p/g", rec(1, note="same for the follower"))
            await a.put("p/h", rec(1))  # came and went while we were away
            await a.delete("p/h")
            _, now = await a.range("p/")
            await a.compact(now)
            flaky.cut()
            assert await r.take(6) == [
                ("new", "p/c", 1),
                ("updated", "p/d", 1, 2),
                ("new", "p/e", 1),
                ("deleted", "p/b"),
                ("deleted", "p/f"),
                ("done",),
            ]
            assert flaky.ranges == 2  # the initial read and the resync
            # and it follows on from the resync's revision
            await a.delete("p/c")
            assert await r.take(2) == [("deleted", "p/c"), ("done",)]

    run(factory, body)


def test_bad_record_is_rejected_with_a_warning_and_the_follow_goes_on(
    factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    def warnings_about(key: str) -> int:
        return sum(
            1 for m in caplog.records if m.levelno == logging.WARNING and key in m.getMessage()
        )

    async def body(a: KV, b: KV) -> None:
        flaky = FlakyKV(b)
        await a.put("p/bad", b"\xff\xfe\x00 garbage")
        await a.put("p/good", rec(1))
        r = Recorder()
        async with following(flaky, "p/", r):
            assert await r.take(3) == [("new", "p/good", 1), ("done",), ("synced",)]
            assert warnings_about("p/bad") == 1
            await a.put("p/bad", rec(2))  # repaired: it appears
            await a.put("p/bad", b"[1, 2]")  # JSON, but not a record: it vanishes
            assert await r.take(4) == [
                ("new", "p/bad", 2),
                ("done",),
                ("deleted", "p/bad"),
                ("done",),
            ]
            assert warnings_about("p/bad") == 2
            # a resync reads the same bad revision again: no second warning for it
            flaky.hold()
            await a.put("p/good", rec(3))
            await flaky.held()
            _, now = await a.range("p/")
            await a.compact(now)
            flaky.cut()
            assert await r.take(2) == [("updated", "p/good", 1, 3), ("done",)]
            assert warnings_about("p/bad") == 2
            await a.put("p/bad", rec(4))
            assert await r.take(2) == [("new", "p/bad", 4), ("done",)]

    with caplog.at_level(logging.WARNING, logger="evergraph.world"):
        run(factory, body)


class Boom(Recorder):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def updated(self, prev: Item, new: Item) -> None:
        raise self.error


@pytest.mark.parametrize(
    "error", [RuntimeError("boom"), WorldError("a callback's own World error")]
)
def test_callback_error_ends_the_follow(factory: Factory, error: Exception) -> None:
    """Even a WorldError from a callback is the callback's: not retried as a break."""

    async def body(a: KV, b: KV) -> None:
        r = Boom(error)
        task = asyncio.create_task(follow(b, "p/", r))
        try:
            assert await r.take(1) == [("synced",)]
            await a.put("p/a", rec(1))
            assert await r.take(2) == [("new", "p/a", 1), ("done",)]
            await a.put("p/a", rec(2))
            with pytest.raises(type(error)) as got:
                await asyncio.wait_for(task, TIMEOUT)
            assert got.value is error
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    run(factory, body)


def test_follow_returns_when_the_world_is_closed(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        r = Recorder()
        task = asyncio.create_task(follow(b, "p/", r))
        assert await r.take(1) == [("synced",)]
        await b.close()
        await asyncio.wait_for(task, TIMEOUT)  # returned, did not raise

    run(factory, body)


def test_simple_follower(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        seen: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()

        async def gone(i: Item) -> None:  # callbacks may be async ...
            seen.put_nowait(("deleted", i.key))

        items = SimpleFollower[Item](
            filter=lambda i: i.up,
            equals=lambda x, y: x.v == y.v,
            on_new_updated=lambda i: seen.put_nowait(("new/updated", i.key, i.v)),  # ... or not
            on_deleted=gone,
            on_batch_done=lambda: seen.put_nowait(("done",)),
            decode=decode_item,
            on_synced=lambda: seen.put_nowait(("synced",)),
        )
        raw: SimpleFollower[KeyValue] = SimpleFollower(
            on_new_updated=lambda kv: seen.put_nowait(("raw", kv.key, kv.value))
        )

        async def take(n: int) -> list[tuple[Any, ...]]:
            return [await asyncio.wait_for(seen.get(), TIMEOUT) for _ in range(n)]

        async with following(b, "s/", items):
            assert await take(1) == [("synced",)]
            await a.put("s/a", rec(1))
            await a.put("s/a", rec(2))
            await a.put("s/a", rec(2, up=False))
            assert await take(6) == [
                ("new/updated", "s/a", 1),
                ("done",),
                ("new/updated", "s/a", 2),
                ("done",),
                ("deleted", "s/a"),
                ("done",),
            ]
        async with following(b, "s/", raw):  # no decode: the KeyValue itself
            assert await take(1) == [("raw", "s/a", rec(2, up=False))]

    run(factory, body)


# -- a replaced World (more in test_world_replaced.py) -------------------------------


def test_follow_resyncs_when_another_call_noticed_the_world_replaced() -> None:
    """The stream breaks while the World is replaced, and the KV already knows
    (a new epoch): the follow reads the new World rather than wait in it for the
    old World's next revision."""

    async def body() -> None:
        store = MemoryStore()
        a, flaky = MemoryKV(store), FlakyKV(MemoryKV(store))
        await a.put("p/a", rec(1))
        r = Recorder()
        async with following(flaky, "p/", r):
            assert await r.take(3) == [("new", "p/a", 1), ("done",), ("synced",)]
            flaky.hold()
            await a.put("p/x", rec(1))
            await flaky.held()
            store.reset()
            await a.put("p/b", rec(2))
            assert flaky.epoch == 1
            flaky.cut()  # a WorldError: the follow resumes, and sees the new epoch
            assert await r.take(3) == [("new", "p/b", 2), ("deleted", "p/a"), ("done",)]
            assert flaky.ranges == 2
            await a.put("p/b", rec(3))
            assert await r.take(2) == [("updated", "p/b", 2, 3), ("done",)]

    asyncio.run(asyncio.wait_for(body(), 30))


def test_follow_resyncs_when_a_read_goes_back_in_revisions() -> None:
    """A KV that does not notice replacements (no epoch): a resync that reads an
    older revision than the follow reported is a replaced World all the same, so
    p/a, at the same mod revision with another value, is an update."""

    async def body() -> None:
        store = MemoryStore()
        a, flaky = MemoryKV(store), FlakyKV(MemoryKV(store), blind=True)
        r1 = await a.put("p/a", rec(1))
        await a.put("p/c", rec(1))
        r = Recorder()
        async with following(flaky, "p/", r):
            assert (await r.take(4))[-1] == ("synced",)
            flaky.hold()
            await a.put("p/x", rec(1))
            await flaky.held()
            store.reset()
            assert await a.put("p/a", rec(5)) == r1
            flaky.cut(Compacted(0, 0))
            assert await r.take(3) == [("updated", "p/a", 1, 5), ("deleted", "p/c"), ("done",)]

    asyncio.run(asyncio.wait_for(body(), 30))


# -- watch_one --------------------------------------------------------------------------


async def next_of(it: AsyncGenerator[KeyValue | Tombstone, None]) -> KeyValue | Tombstone:
    return await asyncio.wait_for(it.__anext__(), TIMEOUT)


def value_of(snap: KeyValue | Tombstone) -> bytes | None:
    return None if isinstance(snap, Tombstone) else snap.value


def test_watch_one_created_updated_deleted_recreated(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        r0 = await a.put("elsewhere", b"x")
        it = watch_one(b, "w/k")
        try:
            assert await next_of(it) == Tombstone("w/k", r0)  # absent at first
            r1 = await a.put("w/k", b"v1")
            await a.put("w/kk", b"a longer key under the same prefix: not ours")
            r2 = await a.put("w/k", b"v2")
            assert await a.delete("w/k")
            r4 = await a.put("w/k", b"v3")
            assert r4 == r2 + 2
            got = [await next_of(it) for _ in range(4)]
            assert [value_of(s) for s in got] == [b"v1", b"v2", None, b"v3"]
            assert got[0] == KeyValue("w/k", b"v1", r1, r1)
            assert got[1] == KeyValue("w/k", b"v2", r1, r2)
            assert got[2] == Tombstone("w/k", r2 + 1)  # the deleting revision
            assert got[3] == KeyValue("w/k", b"v3", r4, r4)  # a new incarnation
        finally:
            await it.aclose()

    run(factory, body)


def test_watch_one_survives_compaction_and_breaks(factory: Factory) -> None:
    """After a Compacted or a broken stream the key is read again and yielded only
    if it changed meanwhile. (watch_one is pulled: the switch's error hits the
    first batch the watch reads after `cut()`.)"""

    async def body(a: KV, b: KV) -> None:
        flaky = FlakyKV(b)
        await a.put("w/k", b"v1")
        it = watch_one(flaky, "w/k")
        try:
            assert value_of(await next_of(it)) == b"v1"
            await a.put("w/k", b"v2")
            await a.put("w/k", b"v3")
            flaky.cut(Compacted(0, 0))
            assert value_of(await next_of(it)) == b"v3"  # re-read: the latest, v2 skipped
            assert flaky.ranges == 2
            # a break while w/k did not change: the re-read yields nothing
            await a.put("w/kk", b"not ours")
            flaky.cut()
            pending = asyncio.ensure_future(next_of(it))
            await flaky.reads(3)
            await a.put("w/k", b"v4")
            assert value_of(await pending) == b"v4"
            assert flaky.ranges == 3  # v4 came by the watch
            # a deletion during a break
            assert await a.delete("w/k")
            flaky.cut()
            assert isinstance(await next_of(it), Tombstone)
            assert flaky.ranges == 4
        finally:
            await it.aclose()

    run(factory, body)
