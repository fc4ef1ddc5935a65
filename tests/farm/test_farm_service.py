"""The farm over a World: the service's operations, the elected matcher loop and a
worker host, together in one process on the shipped memory World (real keys,
real sealing, real transactions)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from evergraph.cluster.election import Election
from evergraph.cluster.exports import Collector, HostKeyBook, Publisher, publish_hostkeys
from evergraph.cluster.hostkeys import HostKeys
from evergraph.cluster.pins import Pins
from evergraph.farm import model
from evergraph.farm.host import WorkerHost
from evergraph.farm.leader import FarmLeader
from evergraph.farm.model import Refused
from evergraph.farm.service import ALIVE, Farm, FarmSettings, Forbidden, NotFound, alive_value
from evergraph.farm.signed import FarmTrust
from evergraph.farm.tokens import User
from evergraph.world.kv import KeyValue, Put
from evergraph.world.memory import MemoryKV, MemoryStore

ALICE = User(name="alice", groups=["lab"])
BOB = User(name="bob")
ADMIN = User(name="root", admin=True)


async def until(pred: Callable[[], Awaitable[bool]], what: str, timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while not await pred():
            await asyncio.sleep(0.005)  # polling the World in-process; bounded by timeout
    # (the condition is a World state written by another task; there is no event for it)


class Cluster:
    """A serving host ("srv": API + matcher) and a worker host ("wk1")."""

    def __init__(self, tmp: Path) -> None:
        self.store = MemoryStore()
        self.tmp = tmp
        self.tasks: list[asyncio.Task[Any]] = []

    def kv(self) -> MemoryKV:
        return MemoryKV(self.store)

    async def host(self, name: str) -> tuple[HostKeys, HostKeyBook, Publisher, Collector]:
        kv = self.kv()
        keys = HostKeys(self.tmp / name)
        await publish_hostkeys(kv, keys, name)
        book = HostKeyBook(kv, Pins(self.tmp / name), name)
        pub = Publisher(kv, keys, name, book, lambda: 0)
        col = Collector(kv, keys, name, book)
        for coro in (book.run(), pub.run(), col.run()):
            self.tasks.append(asyncio.create_task(coro))
        await book.ready.wait()
        await col.ready.wait()
        return keys, book, pub, col

    @contextlib.asynccontextmanager
    async def running(
        self, settings: FarmSettings | None = None
    ) -> AsyncIterator[tuple[Farm, WorkerHost]]:
        skeys, sbook, _, col = await self.host("srv")
        wkeys, _, wpub, _ = await self.host("wk1")

        def host_key(h: str) -> str | None:
            pair = sbook.trusted(h)
            return pair[1] if pair else None

        strust = FarmTrust(skeys, "srv", host_key=host_key)
        election = Election(self.kv(), "farm", "srv", ttl=5)
        # (no grace after an alive key is gone, unless a test asks: FAILED at once)
        leader = FarmLeader(self.kv(), election, strust, settings or FarmSettings(alive_grace=0))
        self.tasks += [asyncio.create_task(election.run()), asyncio.create_task(leader.run())]
        farm = Farm(self.kv(), trust=strust, collector=col)
        worker = WorkerHost(
            self.kv(),
            uuid="5f0c0e8a-1111-4222-8333-944445555666",
            host="wk1",
            caps={"arch": "x86_64", "hostname": "wk1", "board": "rpi4"},
            groups=["lab"],
            address="127.0.0.1",
            port=22,
            username="tester",
            lease=lambda: 0,
            publisher=wpub,
            key_servers={"srv"},
            trust=FarmTrust(wkeys, "wk1", {"srv": skeys.verify}),
        )
        await worker.alive()
        await worker.register()
        self.tasks.append(asyncio.create_task(worker.run()))
        try:
            yield farm, worker
        finally:
            for t in self.tasks:
                t.cancel()
            for t in self.tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t


def test_request_matched_acquired_and_closed(tmp_path: Path) -> None:
    async def main() -> None:
        async with Cluster(tmp_path).running() as (farm, worker):
            uuid = worker.uuid
            w = await farm.worker(uuid)
            assert w.state == model.MAINTENANCE
            with pytest.raises(Forbidden):
                await farm.set_state(ALICE, uuid, model.IDLE)
            await farm.set_state(ADMIN, uuid, model.IDLE)

            async def idle() -> bool:
                return (await farm.worker(uuid)).state == model.IDLE

            await until(idle, "the leader completes PREPARE -> IDLE")
            rid = await farm.new_request(ALICE, priority=4, caps={"board": "rpi3|rpi4"})
            # others cannot see it
            with pytest.raises(NotFound):
                await farm.request(BOB, rid)
            req = await farm.wait_started(ALICE, rid, 10)
            assert req.state == model.IN_PROGRESS
            assert req.job is not None
            assert req.job.worker == uuid
            assert (await farm.worker(uuid)).state == model.RUNNING
            access = await farm.acquire(ALICE, rid, 10)
            assert access.key.startswith("-----BEGIN RSA PRIVATE KEY-----")
            assert (access.ip, access.port, access.username) == ("127.0.0.1", 22, "tester")
            assert worker.job is not None
            assert worker.job.public_key.startswith("ssh-rsa ")
            # the key is in the World only sealed: never in plain bytes
            items, _ = await farm.kv.range("")
            body = access.key.split("\n")[1].encode()
            assert not any(body in i.value for i in items)
            await farm.close_request(ALICE, rid)
            assert (await farm.request(ALICE, rid)).state == model.DONE

            async def released() -> bool:
                return worker.job is None and (await farm.worker(uuid)).state == model.IDLE

            await until(released, "the job ends: worker IDLE, access revoked")
            with pytest.raises(Refused, match="only an IN PROGRESS request"):
                await farm.acquire(ALICE, rid, 0)

    asyncio.run(main())


def test_unsatisfiable_is_invalid_and_a_dead_worker_fails_its_job(tmp_path: Path) -> None:
    async def main() -> None:
        async with Cluster(tmp_path).running(FarmSettings(invalid_grace=0, alive_grace=0)) as (
            farm,
            worker,
        ):
            uuid = worker.uuid
            # (the worker in MAINTENANCE: nothing takes the request meanwhile)
            waiting = await farm.new_request(ALICE, priority=8)
            with pytest.raises(Refused, match="WAITING"):
                await farm.acquire(ALICE, waiting, 0)
            await farm.close_request(ALICE, waiting)
            await farm.set_state(ADMIN, uuid, model.IDLE)
            bad = await farm.new_request(ALICE, priority=8, caps={"board": "pi5"})
            req = await farm.wait_started(ALICE, bad, 10)
            assert req.state == model.INVALID
            rid2 = await farm.new_request(BOB, priority=1)
            # bob has no group, the worker has one: a request with no groups fits any
            req = await farm.wait_started(BOB, rid2, 10)
            assert req.state == model.IN_PROGRESS
            # the worker's agent dies: its alive key vanishes with its lease
            await farm.kv.delete(f"{ALIVE}{uuid}")

            async def failed() -> bool:
                r = await farm.request(BOB, rid2)
                return r.state == model.FAILED and (await farm.worker(uuid)).state == model.FAILED

            await until(failed, "worker FAILED, its request FAILED")

    asyncio.run(main())


def test_a_stale_worker_record_never_fails_a_running_request(tmp_path: Path) -> None:
    """The matcher decided from a snapshot where the request is IN PROGRESS but its
    worker's record is older (still IDLE): its write to fail the request is
    conditioned on that worker record, so it is refused and the request runs on."""
    from evergraph.farm.service import encode, open_request, req_key, worker_key
    from evergraph.world.kv import KeyValue

    async def main() -> None:
        store = MemoryStore()
        kv = MemoryKV(store)
        election = Election(kv, "farm", "m", ttl=5)
        task = asyncio.create_task(election.run())
        await election.wait_leader()
        trust = FarmTrust(HostKeys(tmp_path), "m")
        leader = FarmLeader(kv, election, trust)
        uuid = "00000000-0000-4000-8000-000000000001"
        w = model.register_worker(
            uuid=uuid, caps={}, address="127.0.0.1", port=22, username="t", now=0.0
        )
        idle = model.complete_prepare(model.set_state(w, model.IDLE))
        wkey, rkey = worker_key(uuid), req_key(1)
        idle_rec = trust.seal(wkey, encode(idle))
        rev_idle = await kv.put(wkey, idle_rec)
        alive_rec = alive_value(trust, uuid, [])
        await kv.put(f"{ALIVE}{uuid}", alive_rec)
        farm = Farm(kv, trust=trust)
        rid = await farm.new_request(ALICE, priority=1)
        req = await farm.request(ALICE, rid)
        started = model.start_request(req, uuid, req.valid_after + 1, 3600)
        running = model.assign_worker(idle, rid)
        started_rec = trust.seal(rkey, encode(started))
        rev = await kv.txn(
            [], [Put(rkey, started_rec), Put(wkey, trust.seal(wkey, encode(running)))]
        )
        assert rev is not None
        stale = {wkey: KeyValue(wkey, idle_rec, 1, rev_idle)}
        reqs = {rkey: KeyValue(rkey, started_rec, 1, rev)}
        alive = {f"{ALIVE}{uuid}": KeyValue(f"{ALIVE}{uuid}", alive_rec, 1, 1)}
        await leader.step(reqs, stale, alive)
        item = await kv.get(req_key(rid))
        assert item is not None
        assert open_request(trust, item)[0].state == model.IN_PROGRESS
        assert leader.refused >= 1
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_request_is_invalid_only_after_its_workers_are_gone_for_the_grace(
    tmp_path: Path,
) -> None:
    """Its only fitting worker deregistered for a moment (re-registered within the
    grace), a WAITING request stays WAITING; one no worker fits becomes INVALID, but
    not before the grace has passed."""
    grace = 1.5

    async def main() -> None:
        async with Cluster(tmp_path).running(FarmSettings(invalid_grace=grace)) as (farm, wk):
            # the worker stays in MAINTENANCE: requests that fit it wait
            rid = await farm.new_request(ALICE, priority=4, caps={"board": "rpi4"})
            await farm.deregister(ADMIN, wk.uuid)
            gone = asyncio.get_running_loop().time()
            never = await farm.new_request(ALICE, priority=4, caps={"board": "pi5"})
            await asyncio.sleep(grace / 3)  # the worker is away for a moment
            await wk.register()
            req = await farm.wait_started(ALICE, never, 10)
            assert req.state == model.INVALID
            assert asyncio.get_running_loop().time() - gone >= grace
            # the matcher has passed the grace of the first request too: still waiting
            assert (await farm.request(ALICE, rid)).state == model.WAITING

    asyncio.run(main())


def test_request_ids_are_dense_whatever_priority_changes_happen(tmp_path: Path) -> None:
    """A priority change sends a request to the tail of its priority's FIFO, and
    takes no request id: ids are 1, 2, 3, ... with no gap."""
    from evergraph.farm.matcher import match

    async def main() -> None:
        farm = Farm(MemoryKV(MemoryStore()), trust=FarmTrust(HostKeys(tmp_path), "m"))
        a = await farm.new_request(ALICE, priority=4)
        b = await farm.new_request(ALICE, priority=4)
        await farm.update_request(ALICE, a, priority=3)
        await farm.update_request(ALICE, a, priority=4)  # now behind b
        c = await farm.new_request(ALICE, priority=4)
        d = await farm.new_request(ALICE, priority=4)
        assert [a, b, c, d] == [1, 2, 3, 4]
        reqs = await farm.requests(ADMIN)
        # FIFO within the priority: b, then a (moved to the tail), then c and d
        workers = [
            model.complete_prepare(
                model.set_state(
                    model.register_worker(
                        uuid=f"00000000-0000-4000-8000-00000000000{i}",
                        caps={},
                        address="127.0.0.1",
                        port=22,
                        username="t",
                        now=0.0,
                    ),
                    model.IDLE,
                )
            )
            for i in range(3)
        ]
        plan = match(reqs, workers, max(r.valid_after for r in reqs) + 1)
        assert [x.request for x in plan.assign] == [b, a, c]

    asyncio.run(main())


def test_waiting_for_a_start_runs_on_the_farms_clock(tmp_path: Path) -> None:
    """`wait_started` bounds its wait by the farm's clock: on a fake one, a request
    no worker takes is answered WAITING exactly when the fake wait is over (no real
    seconds spent), and not a moment before."""
    from evergraph.testing.clock import FakeClock

    async def main() -> None:
        async with Cluster(tmp_path).running() as (farm, _wk):
            clock = FakeClock(epoch=time.time())  # (the leader's clock is the real one)
            timed = Farm(farm.kv, trust=farm.trust, collector=farm.collector, clock=clock)
            # the worker stays in MAINTENANCE: a request that fits it waits
            rid = await timed.new_request(ALICE, priority=4, caps={"board": "rpi4"})
            waiting = asyncio.create_task(timed.wait_started(ALICE, rid, 600))
            while clock.waiting() == 0:  # the wait armed its timer on the fake clock
                await asyncio.sleep(0)
            await clock.advance(599)
            assert not waiting.done()
            await clock.advance(1)
            req = await asyncio.wait_for(waiting, 10)
            assert req.state == model.WAITING

    asyncio.run(main())


async def _made_invalid(
    tmp_path: Path,
) -> tuple[MemoryKV, FarmTrust, FarmLeader, asyncio.Task[Any], str, KeyValue, KeyValue]:
    """A leading farm leader (its election's task) and a request it made INVALID (no
    worker fits): (kv, trust, leader, task, key, the WAITING and INVALID versions)."""
    from evergraph.farm.service import req_key

    kv = MemoryKV(MemoryStore())
    election = Election(kv, "farm", "m", ttl=5)
    task = asyncio.create_task(election.run())
    await election.wait_leader()
    trust = FarmTrust(HostKeys(tmp_path), "m")
    leader = FarmLeader(kv, election, trust, FarmSettings(invalid_grace=0))
    rid = await Farm(kv, trust=trust).new_request(ALICE, priority=1, caps={"board": "x"})
    rkey = req_key(rid)
    waiting = await kv.get(rkey)
    assert waiting is not None
    await leader.step({rkey: waiting}, {}, {})
    invalid = await kv.get(rkey)
    assert invalid is not None
    return kv, trust, leader, task, rkey, waiting, invalid


def test_a_request_deleted_right_after_the_leaders_own_write_is_put_back(
    tmp_path: Path,
) -> None:
    """The leader makes a request INVALID; someone deletes it before the leader's
    follow has read that write (a loaded host: both come in one read, one pass), so
    the last version the follow knew is the leader's own INVALID record, never
    verified by a pass. It is put back all the same, INVALID."""
    from evergraph.farm.service import open_request

    async def main() -> None:
        kv, trust, leader, task, rkey, waiting, invalid = await _made_invalid(tmp_path)
        assert invalid.mod_revision > waiting.mod_revision
        await kv.delete(rkey)
        # the follow's one read: updated(waiting -> invalid), deleted(invalid)
        await leader.step({}, {}, {}, {rkey: invalid})
        back = await kv.get(rkey)
        assert back is not None, "the deleted request was not put back"
        assert open_request(trust, back)[0].state == model.INVALID
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())


@pytest.mark.parametrize("attack", ["forged", "replayed"])
def test_a_deleted_record_the_leader_cannot_trust_is_not_put_back(
    tmp_path: Path, attack: str
) -> None:
    """Someone with World access writes a request record the leader never wrote
    (unsigned bytes, or its own INVALID record's predecessor, WAITING, replayed),
    then deletes it: the last version the follow knew is that one. The leader
    verifies it before putting anything back, refuses it, and writes nothing."""

    async def main() -> None:
        kv, _, leader, task, rkey, waiting, invalid = await _made_invalid(tmp_path)
        await leader.step({rkey: invalid}, {}, {})  # (verified: the leader's last known)
        planted = b'{"state": "WAITING"}' if attack == "forged" else waiting.value
        await kv.txn([], [Put(rkey, planted)])
        attacked = await kv.get(rkey)
        assert attacked is not None
        await kv.delete(rkey)
        before, _ = await kv.range("farm/")
        await leader.step({}, {}, {}, {rkey: attacked})
        assert await kv.get(rkey) is None, "an untrusted record was put back"
        assert (await kv.range("farm/"))[0] == before
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
