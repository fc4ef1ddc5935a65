"""The contract every World backend must pass, as checks a backend's own tests run:
`check_kv(factory)` runs them all, `run_check(factory, name)` one of `CHECKS` (to
give each its own test). What they hold a backend to is written in
`evergraph.world.kv`: revisions, multi-key txns, watches in revision batches that
resume and raise `Compacted`, leases that expire and take their keys, a closed
client's watch that ends. The memory, sqlite and etcd backends run them in
tests/world/test_world_kv.py.

`factory()` opens a new client of one and the same World (as another host would),
inside the running event loop (each check runs in a loop of its own); every check
uses two clients, some more. The checks write anywhere in the World and each
starts by deleting every key: give them a World of their own. A backend
whose leases run on a fake clock passes `wait=clock.advance`, so that lease
checks take no real time; by default time passes for real (`asyncio.sleep`).

Example, for a backend `MyKV` of a World at `url`::

    from evergraph.testing.world import check_kv

    def test_my_backend_keeps_the_world_contract(url):
        check_kv(lambda: MyKV(url))
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from evergraph.world.kv import (
    KV,
    Compacted,
    Compare,
    Delete,
    Event,
    LeaseExpired,
    Put,
    WorldReplaced,
)

__all__ = ["CHECKS", "Factory", "check_kv", "run_check"]

T = TypeVar("T")

#: opens a new client of the World under test (called inside the running loop)
Factory = Callable[[], KV]
#: lets `seconds` of the World's time pass (asyncio.sleep, or a fake clock's advance)
Wait = Callable[[float], Awaitable[None]]

#: how long one check may take, and one awaited watch batch
_BOUND = 30.0
_BATCH = 10.0


@dataclass(frozen=True)
class _World:
    """What a check gets besides its two clients: more clients, and time."""

    open: Factory
    wait: Wait

    async def within(self, seconds: float, aw: Awaitable[T], step: float = 0.25) -> T:
        """`aw`'s result, letting up to `seconds` of the World's time pass for it."""
        fut = asyncio.ensure_future(aw)
        try:
            waited = 0.0
            while not fut.done():
                assert waited < seconds, f"nothing within {seconds} s"
                await self.wait(step)
                waited += step
            return fut.result()
        finally:
            fut.cancel()


async def _next_batch(it: AsyncIterator[list[Event]]) -> list[Event]:
    return await asyncio.wait_for(anext(it), _BATCH)


def summary(batch: list[Event]) -> list[tuple[str, str, bytes]]:
    return [(e.type, e.key, e.value) for e in batch]


@contextlib.contextmanager
def _raises(kind: type[BaseException], match: str | None = None) -> Iterator[None]:
    try:
        yield
    except kind as e:
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"{kind.__name__} {str(e)!r} does not say {match!r}") from e
        return
    raise AssertionError(f"{kind.__name__} was not raised")


async def _put_get_range_and_revisions(a: KV, b: KV, w: _World) -> None:
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


async def _compare_and_swap(a: KV, b: KV, w: _World) -> None:
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


async def _watch_sees_another_clients_writes_in_revision_batches(a: KV, b: KV, w: _World) -> None:
    start = await a.put("other", b"x") + 1
    it = b.watch("w/", start)
    r1 = await a.put("w/1", b"one")
    await a.put("not-w", b"skip")
    r2 = await a.put("w/2", b"two")
    await a.delete_prefix("w/")
    got = [await _next_batch(it) for _ in range(3)]
    assert [[(e.type, e.key, e.value) for e in batch] for batch in got] == [
        [("put", "w/1", b"one")],
        [("put", "w/2", b"two")],
        [("delete", "w/1", b""), ("delete", "w/2", b"")],  # one revision, one batch
    ]
    assert got[0][0].revision == r1
    assert got[1][0].revision == r2
    assert got[2][0].revision == got[2][1].revision > r2


async def _watch_resumes_from_a_past_revision(a: KV, b: KV, w: _World) -> None:
    r1 = await a.put("r/1", b"1")
    r2 = await a.put("r/2", b"2")
    await a.put("r/3", b"3")
    it = b.watch("r/", r2)  # history from r2 on, as after a reconnect
    got = [(await _next_batch(it))[0].key for _ in range(2)]
    assert got == ["r/2", "r/3"]
    it2 = b.watch("r/", r1)
    assert (await _next_batch(it2))[0].key == "r/1"


async def _compacted_history_raises(a: KV, b: KV, w: _World) -> None:
    r1 = await a.put("c/1", b"1")
    r2 = await a.put("c/2", b"2")
    await a.put("c/3", b"3")
    await a.compact(r2)
    with _raises(Compacted):
        await _next_batch(b.watch("c/", r1))
    it = b.watch("c/", r2 + 1)  # still in history
    assert (await _next_batch(it))[0].key == "c/3"


async def _world_identity(a: KV, b: KV, w: _World) -> None:
    """Clients of one World agree on its id and have seen no replacement (what
    happens when there is one: test_world_replaced.py)."""
    await a.put("x", b"1")
    assert await b.get("x") is not None  # etcd learns the id from an answer
    assert a.world_id == b.world_id != ""
    assert (a.epoch, b.epoch) == (0, 0)
    # code that re-reads after a Compacted re-reads after a replacement too
    assert issubclass(WorldReplaced, Compacted)
    e = WorldReplaced("cluster id 1 -> 2")
    assert str(e) == "the World was replaced (cluster id 1 -> 2): resyncing"


async def _leases_expire_and_take_their_keys(a: KV, b: KV, w: _World) -> None:
    lease = await a.grant(1)
    await a.put("l/member", b"alive", lease=lease)
    rev = await a.put("l/plain", b"stays")
    it = b.watch("l/", rev + 1)
    # no keep-alive: the lease ends within its TTL (etcd may round it up)
    batch = await w.within(10, it.__anext__())
    assert [(e.type, e.key) for e in batch] == [("delete", "l/member")]
    assert await b.get("l/plain") is not None
    with _raises(LeaseExpired):
        await a.keepalive(lease)
    with _raises(LeaseExpired):
        await a.put("l/late", b"x", lease=lease)


async def _keepalive_and_revoke(a: KV, b: KV, w: _World) -> None:
    lease = await a.grant(1)
    await a.put("k/1", b"1", lease=lease)
    for _ in range(6):  # 1.8 s, longer than the TTL: kept alive
        await w.wait(0.3)
        await a.keepalive(lease)
    assert await b.get("k/1") is not None
    await a.revoke(lease)
    assert await b.get("k/1") is None


async def _closed_client_ends_its_watch(a: KV, b: KV, w: _World) -> None:
    rev = await a.put("x", b"1")
    it = b.watch("x", rev + 1)
    task = asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0)  # let the watch start
    await b.close()
    with _raises(StopAsyncIteration):
        await asyncio.wait_for(task, 10)


async def _every_op_in_one_revision_and_one_watch_batch(a: KV, b: KV, w: _World) -> None:
    ra = await a.put("t/a", b"1")
    rz = await a.put("t/z", b"z")
    it = b.watch("t/", rz + 1)
    rev = await a.txn(
        [Compare("t/a", ra), Compare("t/b", 0), Compare("t/z", rz)],
        [Put("t/c", b"3"), Delete("t/a"), Put("t/b", b"2"), Put("t/z", b"zz")],
    )
    assert rev is not None
    assert rev == rz + 1  # one new revision for four ops
    items, at = await b.range("t/")
    assert at == rev
    assert [(i.key, i.value, i.mod_revision) for i in items] == [
        ("t/b", b"2", rev),
        ("t/c", b"3", rev),
        ("t/z", b"zz", rev),
    ]
    z = items[2]
    assert z.create_revision == rz  # an overwrite keeps its create revision
    assert items[0].create_revision == rev
    batch = await _next_batch(it)  # one batch, the ops in their order
    assert summary(batch) == [
        ("put", "t/c", b"3"),
        ("delete", "t/a", b""),
        ("put", "t/b", b"2"),
        ("put", "t/z", b"zz"),
    ]
    assert {e.revision for e in batch} == {rev}
    # the next write is the next batch: nothing else came of the txn
    r2 = await a.put("t/after", b"x")
    assert summary(await _next_batch(it)) == [("put", "t/after", b"x")]
    assert r2 == rev + 1


async def _a_failed_compare_changes_nothing(a: KV, b: KV, w: _World) -> None:
    ra = await a.put("f/a", b"1")
    rb = await a.put("f/b", b"2")
    it = b.watch("f/", rb + 1)
    for compares in (
        [Compare("f/a", ra), Compare("f/b", rb - 1)],  # one of two is stale
        [Compare("f/a", 0)],  # must not exist, but does
        [Compare("f/none", ra)],  # must exist at ra, but does not
        [Compare("f/a", rb)],  # another key's revision
    ):
        got = await a.txn(compares, [Put("f/a", b"new"), Delete("f/b"), Put("f/c", b"3")])
        assert got is None, compares
    items, at = await b.range("f/")
    assert at == rb  # no revision was made
    assert [(i.key, i.value, i.mod_revision) for i in items] == [
        ("f/a", b"1", ra),
        ("f/b", b"2", rb),
    ]
    await a.put("f/sentinel", b"s")
    assert summary(await _next_batch(it)) == [("put", "f/sentinel", b"s")]


async def _compares_that_hold_and_no_compares_at_all(a: KV, b: KV, w: _World) -> None:
    r = await a.txn([], [Put("n/a", b"1")])  # unconditional
    assert r is not None
    kv = await b.get("n/a")
    assert kv is not None
    assert kv.mod_revision == r
    # the same compare twice, and compares on keys the ops do not touch
    r2 = await b.txn([Compare("n/a", r), Compare("n/a", r), Compare("n/x", 0)], [])
    assert r2 == r  # no ops: nothing changed, no new revision
    assert (await a.range("n/"))[1] == r


async def _deleting_a_missing_key_is_a_no_op(a: KV, b: KV, w: _World) -> None:
    r0 = await a.put("d/keep", b"k")
    it = b.watch("d/", r0 + 1)
    only = await a.txn([Compare("d/none", 0)], [Delete("d/none")])
    assert only == r0  # succeeded, changed nothing: no new revision
    r1 = await a.txn([], [Delete("d/none"), Put("d/new", b"n"), Delete("d/other")])
    assert r1 == r0 + 1
    assert summary(await _next_batch(it)) == [("put", "d/new", b"n")]
    # cas delete of an absent key: it stays absent, and that is success
    assert await a.cas("d/none", None, expect=0) is True
    assert (await b.range("d/"))[1] == r1


async def _puts_under_a_lease(a: KV, b: KV, w: _World) -> None:
    lease = await a.grant(30)
    r = await a.txn([Compare("l/a", 0)], [Put("l/a", b"1", lease), Put("l/plain", b"2")])
    assert r is not None
    got = await b.get("l/a")
    assert got is not None
    assert got.lease == lease
    it = b.watch("l/", r + 1)
    await a.revoke(lease)
    assert summary(await _next_batch(it)) == [("delete", "l/a", b"")]
    assert await b.get("l/plain") is not None
    # a lease that is gone: LeaseExpired, and none of the ops is applied
    with _raises(LeaseExpired):
        await a.txn([], [Put("l/other", b"x"), Put("l/a", b"again", lease)])
    items, _ = await b.range("l/")
    assert [i.key for i in items] == ["l/plain"]
    await a.put("l/sentinel", b"s")
    assert summary(await _next_batch(it)) == [("put", "l/sentinel", b"s")]
    # ...but a failed compare wins over a dead lease: nothing is tried
    assert await a.txn([Compare("l/plain", 0)], [Put("l/a", b"x", lease)]) is None


async def _concurrent_txns_on_one_compare_exactly_one_wins(a: KV, b: KV, w: _World) -> None:
    clients = [a, b, w.open(), w.open()]  # four hosts race
    try:
        for i in range(15):
            key = f"race/{i}"
            results = await asyncio.gather(
                *(
                    c.txn([Compare(key, 0)], [Put(key, b"%d" % n), Put(f"{key}/by{n}", b"")])
                    for n, c in enumerate(clients)
                )
            )
            won = [n for n, r in enumerate(results) if r is not None]
            assert len(won) == 1, results
            items, _ = await a.range(key)
            assert [(i.key, i.value) for i in items] == [
                (key, b"%d" % won[0]),
                (f"{key}/by{won[0]}", b""),
            ]
            # then fenced writes: only the compare on the current revision wins
            cur = results[won[0]]
            assert cur is not None
            stale, fresh = await asyncio.gather(
                clients[2].txn([Compare(key, cur - 1)], [Put(key, b"stale")]),
                clients[3].txn([Compare(key, cur)], [Put(key, b"fresh")]),
            )
            assert stale is None
            assert fresh is not None
    finally:
        for c in clients[2:]:
            await c.close()


async def _two_ops_on_one_key_are_refused(a: KV, b: KV, w: _World) -> None:
    with _raises(ValueError, match="more than once"):
        await a.txn([], [Put("k", b"1"), Delete("k")])
    with _raises(ValueError, match="more than once"):
        await a.txn([], [Put("k", b"1"), Put("k", b"2")])
    assert await b.get("k") is None


Check = Callable[[KV, KV, _World], Awaitable[None]]

#: every check by name, in the order check_kv runs them
CHECKS: dict[str, Check] = {
    fn.__name__.removeprefix("_"): fn
    for fn in (
        _put_get_range_and_revisions,
        _compare_and_swap,
        _watch_sees_another_clients_writes_in_revision_batches,
        _watch_resumes_from_a_past_revision,
        _compacted_history_raises,
        _world_identity,
        _leases_expire_and_take_their_keys,
        _keepalive_and_revoke,
        _closed_client_ends_its_watch,
        _every_op_in_one_revision_and_one_watch_batch,
        _a_failed_compare_changes_nothing,
        _compares_that_hold_and_no_compares_at_all,
        _deleting_a_missing_key_is_a_no_op,
        _puts_under_a_lease,
        _concurrent_txns_on_one_compare_exactly_one_wins,
        _two_ops_on_one_key_are_refused,
    )
}


def run_check(factory: Factory, name: str, *, wait: Wait | None = None) -> None:
    """Run the check `name` of CHECKS on two fresh clients of `factory`'s World, in
    a new event loop (like `asyncio.run`); closes every client it opened. An
    AssertionError names the check and what did not hold."""
    check = CHECKS[name]
    passes = wait if wait is not None else asyncio.sleep

    async def main() -> None:
        opened: list[KV] = []

        def open_client() -> KV:
            kv = factory()
            opened.append(kv)
            return kv

        try:
            a, b = open_client(), open_client()
            await a.delete_prefix("")  # each check starts from an empty World
            await asyncio.wait_for(check(a, b, _World(open_client, passes)), _BOUND)
        finally:
            for kv in opened:
                await kv.close()

    try:
        asyncio.run(main())
    except AssertionError as e:
        raise AssertionError(f"World contract, {name}: {e}") from e


def check_kv(factory: Factory, *, wait: Wait | None = None, skip: Iterable[str] = ()) -> None:
    """Run every check of the World contract (CHECKS, but those in `skip`) against
    the World that `factory` opens clients of; the first that fails raises an
    AssertionError naming it. Each check runs in an event loop of its own."""
    skipped = set(skip)
    unknown = skipped - set(CHECKS)
    if unknown:
        raise ValueError(f"no such World contract check: {', '.join(sorted(unknown))}")
    for name in CHECKS:
        if name not in skipped:
            run_check(factory, name, wait=wait)
