"""The World's multi-key transactions (`KV.txn`), run against every backend."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from evergraph.world.kv import KV, Compare, Delete, Event, LeaseExpired, Put
from tests.kit.worlds import BACKENDS, Factory, run_pair, world_factory


@pytest.fixture(autouse=True)
def collect_garbage() -> Iterator[None]:
    """Collect each test's garbage in this process: gRPC objects left in reference
    cycles (an etcd error's traceback) would otherwise be finalised in the forked
    child of a later test, where gRPC spins forever (test_world_kv forks)."""
    yield
    gc.collect()


@pytest.fixture(params=BACKENDS)
def factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    with world_factory(request.param, tmp_path) as (make, _server):
        yield make


run = run_pair


async def next_batch(it: object) -> list[Event]:
    return await asyncio.wait_for(it.__anext__(), 10)  # type: ignore[attr-defined]


def summary(batch: list[Event]) -> list[tuple[str, str, bytes]]:
    return [(e.type, e.key, e.value) for e in batch]


def test_every_op_in_one_revision_and_one_watch_batch(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
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
        batch = await next_batch(it)  # one batch, the ops in their order
        assert summary(batch) == [
            ("put", "t/c", b"3"),
            ("delete", "t/a", b""),
            ("put", "t/b", b"2"),
            ("put", "t/z", b"zz"),
        ]
        assert {e.revision for e in batch} == {rev}
        # the next write is the next batch: nothing else came of the txn
        r2 = await a.put("t/after", b"x")
        assert summary(await next_batch(it)) == [("put", "t/after", b"x")]
        assert r2 == rev + 1

    run(factory, body)


def test_a_failed_compare_changes_nothing(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
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
        assert summary(await next_batch(it)) == [("put", "f/sentinel", b"s")]

    run(factory, body)


def test_compares_that_hold_and_no_compares_at_all(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        r = await a.txn([], [Put("n/a", b"1")])  # unconditional
        assert r is not None
        kv = await b.get("n/a")
        assert kv is not None
        assert kv.mod_revision == r
        # the same compare twice, and compares on keys the ops do not touch
        r2 = await b.txn([Compare("n/a", r), Compare("n/a", r), Compare("n/x", 0)], [])
        assert r2 == r  # no ops: nothing changed, no new revision
        assert (await a.range("n/"))[1] == r

    run(factory, body)


def test_deleting_a_missing_key_is_a_no_op(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        r0 = await a.put("d/keep", b"k")
        it = b.watch("d/", r0 + 1)
        only = await a.txn([Compare("d/none", 0)], [Delete("d/none")])
        assert only == r0  # succeeded, changed nothing: no new revision
        r1 = await a.txn([], [Delete("d/none"), Put("d/new", b"n"), Delete("d/other")])
        assert r1 == r0 + 1
        assert summary(await next_batch(it)) == [("put", "d/new", b"n")]
        # cas delete of an absent key: it stays absent, and that is success
        assert await a.cas("d/none", None, expect=0) is True
        assert (await b.range("d/"))[1] == r1

    run(factory, body)


def test_puts_under_a_lease(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        lease = await a.grant(30)
        r = await a.txn([Compare("l/a", 0)], [Put("l/a", b"1", lease), Put("l/plain", b"2")])
        assert r is not None
        got = await b.get("l/a")
        assert got is not None
        assert got.lease == lease
        it = b.watch("l/", r + 1)
        await a.revoke(lease)
        assert summary(await next_batch(it)) == [("delete", "l/a", b"")]
        assert await b.get("l/plain") is not None
        # a lease that is gone: LeaseExpired, and none of the ops is applied
        with pytest.raises(LeaseExpired):
            await a.txn([], [Put("l/other", b"x"), Put("l/a", b"again", lease)])
        items, _ = await b.range("l/")
        assert [i.key for i in items] == ["l/plain"]
        await a.put("l/sentinel", b"s")
        assert summary(await next_batch(it)) == [("put", "l/sentinel", b"s")]
        # ...but a failed compare wins over a dead lease: nothing is tried
        assert await a.txn([Compare("l/plain", 0)], [Put("l/a", b"x", lease)]) is None

    run(factory, body)


def test_concurrent_txns_on_one_compare_exactly_one_wins(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        clients = [a, b, factory(), factory()]  # four hosts race
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

    run(factory, body)


def test_two_ops_on_one_key_are_refused(factory: Factory) -> None:
    async def body(a: KV, b: KV) -> None:
        with pytest.raises(ValueError, match="more than once"):
            await a.txn([], [Put("k", b"1"), Delete("k")])
        with pytest.raises(ValueError, match="more than once"):
            await a.txn([], [Put("k", b"1"), Put("k", b"2")])
        assert await b.get("k") is None

    run(factory, body)
