"""Leader election with fenced writes (cluster/election.py) on every backend.

Each candidate has its own KV client (as separate processes or hosts would),
behind a `Gated` switch that can freeze it: everything (a dead or frozen
process: keep-alives stop, its lease expires), or only its keep-alives and
its view of the World (a leader that still believes it leads). Waits are on
events, bounded; a TTL is waited out only where that is what is tested.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from evergraph._util.clock import SYSTEM, Clock
from evergraph._util.tasks import first_of
from evergraph.cluster.election import Election, election_key
from evergraph.world.etcd import EtcdKV
from evergraph.world.etcd_server import EtcdServer
from evergraph.world.kv import KV, Compare, Delete, Event, KeyValue, Put
from evergraph.world.memory import MemoryKV, MemoryStore
from tests.kit.clocks import fake_clock
from tests.kit.worlds import BACKENDS, Factory, world_factory

#: lease TTL of the candidates (etcd counts whole seconds)
TTL = 2.0
#: the longest any wait in these tests may take
BOUND = 20.0


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


class Gated(KV):
    """Passes every call to `inner`, unless frozen. `freeze()`: every call and
    watch batch waits (a dead or frozen process); `freeze("keepalive", "view")`:
    only keep-alives, reads and watch batches wait (a leader cut off from the
    news, whose writes still reach the World). `on_grant` runs at each grant."""

    def __init__(self, inner: KV) -> None:
        self.inner = inner
        self.name = inner.name
        self.gates = {g: asyncio.Event() for g in ("all", "keepalive", "view")}
        for g in self.gates.values():
            g.set()
        self.on_grant: Callable[[], None] | None = None

    def freeze(self, *what: str) -> None:
        for w in what or ("all",):
            self.gates[w].clear()

    def thaw(self) -> None:
        for g in self.gates.values():
            g.set()

    async def _pass(self, what: str = "") -> None:
        await self.gates["all"].wait()
        if what:
            await self.gates[what].wait()

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    @property
    def world_id(self) -> str:
        return self.inner.world_id

    async def get(self, key: str) -> KeyValue | None:
        await self._pass("view")
        return await self.inner.get(key)

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        await self._pass("view")
        return await self.inner.range(prefix)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        await self._pass()
        return await self.inner.put(key, value, lease=lease)

    async def delete(self, key: str) -> bool:
        await self._pass()
        return await self.inner.delete(key)

    async def delete_prefix(self, prefix: str) -> int:
        await self._pass()
        return await self.inner.delete_prefix(prefix)

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Put | Delete]) -> int | None:
        await self._pass()
        return await self.inner.txn(compares, ops)

    async def grant(self, ttl: float) -> int:
        await self._pass()
        if self.on_grant is not None:
            self.on_grant()
        return await self.inner.grant(ttl)

    async def keepalive(self, lease: int) -> None:
        await self._pass("keepalive")
        await self.inner.keepalive(lease)

    async def revoke(self, lease: int) -> None:
        await self._pass()
        await self.inner.revoke(lease)

    async def watch(self, prefix: str, start: int) -> AsyncIterator[list[Event]]:
        it = self.inner.watch(prefix, start)
        try:
            async for batch in it:
                await self._pass("view")
                yield batch
        finally:
            await it.aclose()  # type: ignore[attr-defined]

    async def compact(self, revision: int) -> None:
        await self.inner.compact(revision)

    async def close(self) -> None:
        await self.inner.close()


class Candidates:
    """`n` candidates for one election, each on its own client, running; and a
    client of the same World to look at it (`world`)."""

    def __init__(
        self, factory: Factory, n: int = 3, ttl: float = TTL, clock: Clock = SYSTEM
    ) -> None:
        self.factory = factory
        self.world = factory()
        self.gates = [Gated(factory()) for _ in range(n)]
        self.els = [
            Election(g, "test", f"c{i}", ttl=ttl, clock=clock) for i, g in enumerate(self.gates)
        ]
        self.tasks = [asyncio.create_task(e.run()) for e in self.els]
        self.key = election_key("test")

    def gate(self, e: Election) -> Gated:
        return self.gates[self.els.index(e)]

    def others(self, e: Election) -> list[Election]:
        return [x for x in self.els if x is not e and not self.tasks[self.els.index(x)].done()]

    async def close(self) -> None:
        for g in self.gates:
            g.thaw()
        for t in self.tasks:
            t.cancel()
        results = await asyncio.gather(*self.tasks, return_exceptions=True)
        for g in self.gates:
            await g.close()
        await self.world.close()
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                raise r


def run(factory: Factory, body: Callable[[Candidates], Awaitable[None]], **kw: Any) -> None:
    async def main() -> None:
        c = Candidates(factory, **kw)
        try:
            await asyncio.wait_for(body(c), 60)
        finally:
            await c.close()

    asyncio.run(main())


async def first_leader(els: list[Election], bound: float = BOUND) -> Election:
    """The first of `els` to lead (another might follow: callers check)."""

    async def leads(e: Election) -> Election:
        await e.wait_leader()
        return e

    try:
        async with asyncio.timeout(bound):
            return await first_of(*(leads(e) for e in els))
    except TimeoutError:
        raise AssertionError(f"no leader among {[e.me for e in els]} within {bound} s") from None


async def sees(e: Election, who: str | None, bound: float = BOUND) -> None:
    """Wait until `e` sees `who` lead."""
    async with asyncio.timeout(bound):
        while e.leader() != who:
            await e.wait_change()


async def one_leader(c: Candidates, among: list[Election] | None = None) -> Election:
    """Wait for a leader that every running candidate sees; check it is the only one."""
    els = among if among is not None else c.els
    leader = await first_leader(els)
    for e in els:
        await sees(e, leader.me)
    assert [e.me for e in els if e.is_leader] == [leader.me]
    kv = await c.world.get(c.key)
    assert kv is not None
    assert (kv.value, kv.mod_revision) == (leader.me.encode(), leader.term)
    assert all(e.term == 0 for e in els if e is not leader)
    return leader


async def lease_of(c: Candidates, e: Election) -> int:
    kv = await c.world.get(c.key)
    assert kv is not None
    assert kv.value == e.me.encode()
    return kv.lease


def test_exactly_one_leader_among_three(factory: Factory) -> None:
    async def body(c: Candidates) -> None:
        leader = await one_leader(c)
        term = leader.term
        # keep-alives hold it: nobody loses or gains leadership over more than a TTL
        news = [asyncio.ensure_future(e.wait_change()) for e in c.els]
        done, _ = await asyncio.wait(news, timeout=TTL * 1.5, return_when=asyncio.FIRST_COMPLETED)
        for w in news:
            w.cancel()
        assert not done, [e.me for e, w in zip(c.els, news, strict=True) if w in done]
        assert [e.is_leader for e in c.els].count(True) == 1
        assert leader.is_leader
        assert leader.term == term
        # the leader writes behind the fence; the others' fenced writes are refused
        assert await leader.fenced([Put("data/x", b"by leader")]) is True
        for e in c.others(leader):
            assert await e.fenced([Put("data/x", b"by a follower")]) is False
        got = await c.world.get("data/x")
        assert got is not None
        assert got.value == b"by leader"

    run(factory, body)


def test_a_dead_leader_is_replaced_within_the_ttl(factory: Factory) -> None:
    async def body(c: Candidates) -> None:
        old = await one_leader(c)
        # the leader's process freezes (or dies): no keep-alive, nothing
        c.gate(old).freeze()
        t0 = time.monotonic()
        new = await first_leader(c.others(old), bound=TTL * 3 + 5)
        took = time.monotonic() - t0
        assert new is not old
        assert took < TTL + 2, f"took over after {took:.2f} s"
        for e in c.others(old):
            await sees(e, new.me)
        # the frozen one stops believing it leads once its lease was not renewed for the TTL
        async with asyncio.timeout(TTL + 2):
            await old.wait_lost()
        assert not old.is_leader
        # it comes back: it follows the new leader and does not take over
        c.gate(old).thaw()
        await sees(old, new.me)
        assert new.is_leader
        assert not old.is_leader

    run(factory, body)


def test_a_revoked_lease_hands_over_at_once(factory: Factory) -> None:
    async def body(c: Candidates) -> None:
        old = await one_leader(c)
        c.gate(old).freeze()  # dead, and its lease revoked: no TTL to wait for
        t0 = time.monotonic()
        await c.world.revoke(await lease_of(c, old))
        new = await one_leader(c, among=c.others(old))
        took = time.monotonic() - t0
        assert took < TTL, f"took over after {took:.2f} s"
        assert new is not old

    run(factory, body)


def test_a_deposed_leader_that_still_believes_is_fenced_out(factory: Factory) -> None:
    async def body(c: Candidates) -> None:
        old = await one_leader(c)
        stale = old.term
        assert await old.fenced([Put("data/x", b"old, while leading")]) is True
        # cut off from the news (no keep-alive answers, no watch), its writes still arrive
        c.gate(old).freeze("keepalive", "view")
        await c.world.revoke(await lease_of(c, old))
        new = await one_leader(c, among=c.others(old))
        assert old.is_leader  # it still believes...
        assert old.term == stale
        assert await old.fenced([Put("data/x", b"old, deposed"), Delete("data/y")]) is False
        got = await c.world.get("data/x")
        assert got is not None
        assert got.value == b"old, while leading"  # ...and the World refused it
        assert await new.fenced([Put("data/x", b"new")]) is True
        # back in touch: it learns it was deposed, and who leads
        c.gate(old).thaw()
        async with asyncio.timeout(BOUND):
            await old.wait_lost()
        await sees(old, new.me)
        assert new.is_leader
        assert await old.fenced([Put("data/x", b"old, again")]) is False
        got = await c.world.get("data/x")
        assert got is not None
        assert got.value == b"new"

    run(factory, body, ttl=6.0)  # its belief lasts up to a TTL: longer than this test


def test_a_leader_whose_keepalive_finds_the_lease_gone_steps_down_first(
    factory: Factory,
) -> None:
    async def body(c: Candidates) -> None:
        leader = await one_leader(c)
        gate = c.gate(leader)
        at_grant: list[bool] = []
        granted = asyncio.Event()

        def on_grant() -> None:
            at_grant.append(leader.is_leader)
            granted.set()

        gate.on_grant = on_grant
        gate.freeze("view")  # only its keep-alive can tell
        await c.world.revoke(await lease_of(c, leader))
        async with asyncio.timeout(TTL):  # the next keep-alive, within ttl/3
            await leader.wait_lost()
        assert not leader.is_leader
        assert leader.term == 0
        await asyncio.wait_for(granted.wait(), BOUND)
        assert at_grant[0] is False  # stepped down before asking for a new lease
        gate.thaw()
        await one_leader(c)

    run(factory, body)


def test_resign_hands_over(factory: Factory) -> None:
    async def body(c: Candidates) -> None:
        first = await one_leader(c)
        t0 = time.monotonic()
        await first.resign()
        assert not first.is_leader
        assert first.term == 0
        second = await one_leader(c, among=c.others(first))
        assert time.monotonic() - t0 < TTL
        await sees(first, second.me)
        assert not first.is_leader  # it sat out: the handover held
        # the next resignation may go to anyone else, the first one included
        await second.resign()
        third = await one_leader(c, among=c.others(second))
        assert third is not second
        await sees(second, third.me)

    run(factory, body)


def test_a_sole_candidate_that_resigned_leads_again_after_the_ttl(factory: Factory) -> None:
    async def body(c: Candidates) -> None:
        (e,) = c.els
        await one_leader(c)
        await e.resign()
        await sees(e, None)  # its key is gone
        async with asyncio.timeout(TTL * 3 + 5):
            await e.wait_leader()
        await one_leader(c)

    run(factory, body, n=1)


def test_a_stopped_leader_hands_over_at_once(factory: Factory) -> None:
    async def body(c: Candidates) -> None:
        old = await one_leader(c)
        i = c.els.index(old)
        t0 = time.monotonic()
        c.tasks[i].cancel()  # its owner stops it: the lease is revoked, the key goes
        with pytest.raises(asyncio.CancelledError):
            await c.tasks[i]
        assert not old.is_leader
        await one_leader(c, among=c.others(old))
        assert time.monotonic() - t0 < TTL

    run(factory, body)


def test_fenced_with_more_compares_and_not_on_the_leader_key(factory: Factory) -> None:
    async def body(c: Candidates) -> None:
        leader = await one_leader(c)
        with pytest.raises(ValueError, match="leader key"):
            await leader.fenced([Put(c.key, b"mine")])
        assert await leader.fenced([]) is True  # nothing to write, but still the leader
        # more compares: all must hold
        r = await c.world.put("data/seq", b"1")
        assert await leader.fenced([Put("data/z", b"1")], [Compare("data/seq", r - 1)]) is False
        assert await c.world.get("data/z") is None
        assert await leader.fenced([Put("data/z", b"1")], [Compare("data/seq", r)]) is True
        kv = await c.world.get(c.key)
        assert kv is not None
        assert kv.mod_revision == leader.term

    run(factory, body)


@pytest.mark.slow
def test_three_etcd_members_a_leader_cut_off_with_its_member(
    shm: Path, servers: list[EtcdServer]
) -> None:
    """Each candidate talks to its own etcd member; the leader's member dies. The
    leader, unable to renew its lease, stops believing it leads within the TTL;
    one of the others takes over once the cluster expired the lease."""
    members = EtcdServer.cluster(3, shm)
    servers.extend(members)
    EtcdServer.start_all(members)
    urls = [m.client_url for m in members]
    # the first client (the observer) sees every member, each candidate one
    views = iter([urls, *([u] for u in urls)])

    def factory() -> KV:
        return EtcdKV(next(views), timeout=2.0)

    async def body(c: Candidates) -> None:
        old = await one_leader(c)
        i = c.els.index(old)
        members[i].kill()
        async with asyncio.timeout(TTL + 3):
            await old.wait_lost()  # its own deadline: no renewal for a TTL
        new = await first_leader(c.others(old), bound=TTL * 5 + 10)
        assert new is not old
        for e in c.others(old):
            await sees(e, new.me)
        assert await new.fenced([Put("data/x", b"new")]) is True
        assert not old.is_leader

    run(factory, body)


# -- on a fake clock: the memory World and the candidates share it, so TTLs pass in
# no real time and "within the TTL" is exact, not a bound on a busy machine ------------


def run_on_fake_clock(body: Callable[[Candidates, Any], Awaitable[None]], n: int = 3) -> None:
    """`body(candidates, clock)`: candidates on a memory World whose leases, like
    the candidates' keep-alives and deadlines, run on one fake clock."""
    clock = fake_clock()
    store = MemoryStore(clock)

    async def main() -> None:
        c = Candidates(lambda: MemoryKV(store), n=n, clock=clock)
        try:
            await asyncio.wait_for(body(c, clock), 60)
        finally:
            await c.close()

    asyncio.run(main())


def test_on_a_fake_clock_keepalives_hold_one_leader_over_many_ttls() -> None:
    async def body(c: Candidates, clock: Any) -> None:
        leader = await one_leader(c)
        term = leader.term
        news = [asyncio.ensure_future(e.wait_change()) for e in c.els]
        for _ in range(10):
            await clock.advance(TTL)
        assert [w.done() for w in news] == [False] * len(news)  # nobody lost or gained
        for w in news:
            w.cancel()
        assert leader.is_leader
        assert leader.term == term
        assert await lease_of(c, leader) == leader._lease

    run_on_fake_clock(body)


def test_on_a_fake_clock_a_dead_leader_is_replaced_once_its_lease_ends() -> None:
    async def body(c: Candidates, clock: Any) -> None:
        old = await one_leader(c)
        c.gate(old).freeze()  # dead: no keep-alive, nothing
        # renewed at most ttl/3 ago: its lease outlives two thirds of a TTL
        await clock.advance(TTL * 2 / 3 - 0.01)
        assert [e.me for e in c.others(old) if e.is_leader] == []
        assert old.is_leader
        await clock.advance(TTL / 3 + 0.02)  # a whole TTL without renewal
        assert not old.is_leader  # its own deadline: it stopped believing
        new = await first_leader(c.others(old))
        for e in c.others(old):
            await sees(e, new.me)
        c.gate(old).thaw()  # back: it follows, it does not take over
        await sees(old, new.me)
        assert new.is_leader
        assert not old.is_leader

    run_on_fake_clock(body)


def test_on_a_fake_clock_a_sole_candidate_that_resigned_sits_out_one_ttl() -> None:
    async def body(c: Candidates, clock: Any) -> None:
        (e,) = c.els
        await one_leader(c)
        await e.resign()
        await sees(e, None)  # its key is gone
        await clock.advance(TTL * 0.9)
        assert not e.is_leader  # sitting out
        await clock.advance(TTL * 0.5)  # the sit-out is over: the next keep-alive sees it
        async with asyncio.timeout(BOUND):
            await e.wait_leader()
        await one_leader(c)

    run_on_fake_clock(body, n=1)
