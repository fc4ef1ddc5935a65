"""The World KV contract (evergraph.testing.world: each check its own test), run
against every backend (memory, sqlite, etcd); the checks themselves catch a
broken backend; sqlite's file created by several processes at once."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from evergraph.testing.world import CHECKS, check_kv, run_check
from evergraph.world.kv import Compare, Delete, LeaseExpired, Put
from evergraph.world.memory import MemoryKV, MemoryStore
from evergraph.world.sqlite import SQLiteKV
from tests.kit.clocks import fake_clock
from tests.kit.worlds import BACKENDS, Factory, world_factory


@pytest.fixture(autouse=True)
def collect_garbage() -> Iterator[None]:
    """Collect each test's garbage in this process: gRPC objects left in reference
    cycles (an etcd error's traceback) would otherwise be finalised in the forked
    child of a later test, where gRPC spins forever (this file forks)."""
    yield
    gc.collect()


@pytest.fixture(params=BACKENDS)
def factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    with world_factory(request.param, tmp_path) as (make, _server):
        yield make


def test_world_contract(factory: Factory, check: str) -> None:
    run_check(factory, check)


@pytest.fixture(params=list(CHECKS))
def check(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class ForgetfulKV(MemoryKV):
    """A backend that breaks the contract: its txn ignores the compares."""

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Put | Delete]) -> int | None:
        return await super().txn([], ops)


def per_loop(kind: type[MemoryKV]) -> Factory:
    """Clients of one memory World per event loop (check_kv runs each check in its own)."""
    stores: dict[asyncio.AbstractEventLoop, MemoryStore] = {}

    def make() -> MemoryKV:
        return kind(stores.setdefault(asyncio.get_running_loop(), MemoryStore()))

    return make


def test_check_kv_names_the_check_a_broken_backend_fails() -> None:
    with pytest.raises(AssertionError, match="World contract, compare_and_swap: ") as e:
        check_kv(per_loop(ForgetfulKV), skip=LEASE_CHECKS)
    assert e.value.__cause__ is not None  # the failed assert itself, for its traceback
    check_kv(per_loop(MemoryKV), skip=LEASE_CHECKS)  # the sound one passes
    with pytest.raises(ValueError, match="no such World contract check: leases"):
        check_kv(per_loop(MemoryKV), skip=["leases"])


def test_check_kv_on_one_world_for_every_check(tmp_path: Path) -> None:
    """The checks clean up after each other: one sqlite World passes them all."""
    check_kv(lambda: SQLiteKV(tmp_path / "w.sqlite"), skip=LEASE_CHECKS)


#: the checks that wait for a lease's TTL (real seconds on the memory World here)
LEASE_CHECKS = ["leases_expire_and_take_their_keys", "keepalive_and_revoke"]


def test_memory_leases_pass_the_contract_on_a_fake_clock() -> None:
    """The lease checks with no real time spent: the memory World's leases run on
    its clock, which the checks advance instead of sleeping."""
    clocks: dict[asyncio.AbstractEventLoop, Any] = {}
    stores: dict[asyncio.AbstractEventLoop, MemoryStore] = {}

    def make() -> MemoryKV:
        loop = asyncio.get_running_loop()
        clock = clocks.setdefault(loop, fake_clock())
        return MemoryKV(stores.setdefault(loop, MemoryStore(clock)))

    async def advance(seconds: float) -> None:
        await clocks[asyncio.get_running_loop()].advance(seconds)

    for name in LEASE_CHECKS:
        run_check(make, name, wait=advance)


def test_a_memory_lease_ends_exactly_at_its_ttl_on_the_worlds_clock() -> None:
    async def main() -> None:
        clock = fake_clock()
        store = MemoryStore(clock)
        a, b = MemoryKV(store), MemoryKV(store)
        lease = await a.grant(10)
        rev = await a.put("m/me", b"here", lease=lease)
        it = b.watch("m/", rev + 1)
        await clock.advance(9.5)
        await a.keepalive(lease)  # the TTL starts again
        await clock.advance(9.5)
        assert await b.get("m/me") is not None
        await clock.advance(0.5)
        batch = await asyncio.wait_for(anext(it), 10)
        assert [(e.type, e.key) for e in batch] == [("delete", "m/me")]
        with pytest.raises(LeaseExpired):
            await a.keepalive(lease)
        await it.aclose()  # type: ignore[attr-defined]
        await a.close()
        await b.close()

    asyncio.run(main())


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
