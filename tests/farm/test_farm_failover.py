"""The matcher's leader killed twice while 200 requests flow through 5 workers: every
request ends terminal, no worker ever holds two jobs, nothing is lost. Three
candidate leaders, the workers and users run in one process on the shipped memory
World; an invariant checker sees every revision."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from pathlib import Path

import pytest

from evergraph.cluster.election import Election, election_key
from evergraph.cluster.hostkeys import HostKeys
from evergraph.farm import model
from evergraph.farm.leader import FarmLeader
from evergraph.farm.service import (
    ALIVE,
    REQS,
    Farm,
    alive_value,
    encode,
    open_request,
    worker_key,
)
from evergraph.farm.signed import FarmTrust
from evergraph.farm.tokens import User
from evergraph.world.follow import SimpleFollower, follow
from evergraph.world.kv import KV, KeyValue
from tests.kit.worlds import Factory, world_factory

USER = User(name="u")
N_REQUESTS = 200
N_WORKERS = 5


@pytest.mark.parametrize("backend", ["memory", "etcd"])
def test_leader_killed_twice_during_matching(tmp_path: Path, backend: str) -> None:
    rng = random.Random(7)
    with world_factory(backend, tmp_path) as (factory, _server):
        _run(factory, rng, HostKeys(tmp_path / "keys"))


def _run(factory: Factory, rng: random.Random, keys: HostKeys) -> None:
    # the farm servers (three candidate leaders, the users' API server) pin each other
    names = ("l0", "l1", "l2", "api")
    servers = dict.fromkeys(names, keys.verify)

    def trust(name: str) -> FarmTrust:
        return FarmTrust(keys, name, servers)

    async def main() -> None:
        clients: list[KV] = []

        def client() -> KV:
            c = factory()
            clients.append(c)
            return c

        kv = client()
        farm = Farm(kv, trust=trust("api"))
        uuids = [f"00000000-0000-4000-8000-00000000000{i}" for i in range(N_WORKERS)]
        for u in uuids:
            w = model.register_worker(
                uuid=u, caps={}, address="127.0.0.1", port=22, username="t", now=0.0
            )
            w = model.complete_prepare(model.set_state(w, model.IDLE))
            await kv.put(worker_key(u), farm.trust.seal(worker_key(u), encode(w)))
            await kv.put(f"{ALIVE}{u}", alive_value(farm.trust, u, []))

        # the invariant: at every revision, a worker runs at most one request
        violations: list[str] = []
        running: dict[int, str] = {}
        done: set[int] = set()
        progressed = asyncio.Event()

        def on_req(item: KeyValue) -> None:
            r = open_request(farm.trust, item)[0]
            if r.state == model.IN_PROGRESS and r.job is not None:
                running[r.id] = r.job.worker
            else:
                running.pop(r.id, None)
            if model.is_terminal(r):
                done.add(r.id)
            progressed.set()

        def check() -> None:
            for uuid, n in Counter(running.values()).items():
                if n > 1:
                    violations.append(f"worker {uuid} holds {n} jobs")

        tasks: list[asyncio.Task[None]] = [
            asyncio.create_task(
                follow(kv, REQS, SimpleFollower(on_new_updated=on_req, on_batch_done=check))
            )
        ]
        candidates: dict[str, list[asyncio.Task[None]]] = {}
        elections: dict[str, Election] = {}

        def start(name: str) -> None:
            ckv = client()
            e = Election(ckv, "farm", name, ttl=1.0)
            elections[name] = e
            candidates[name] = [
                asyncio.create_task(e.run()),
                asyncio.create_task(FarmLeader(ckv, e, trust(name)).run()),
            ]

        async def kill_leader() -> str:
            item = await kv.get(election_key("farm"))
            assert item is not None
            name = item.value.decode()
            for t in candidates.pop(name):
                t.cancel()
            await kv.revoke(item.lease)  # its lease dies with it
            return name

        for name in ("l0", "l1", "l2"):
            start(name)

        async def users() -> None:
            # the owner closes each job a little after it starts (a user done with it)
            while len(done) < N_REQUESTS:
                for rid in list(running):
                    if rng.random() < 0.5:
                        with contextlib.suppress(model.Refused):
                            await farm.close_request(USER, rid)
                await asyncio.sleep(0.002)  # pacing the simulated users, not a wait

        for i in range(N_REQUESTS):
            await farm.new_request(USER, priority=1 + i % 16)
        tasks.append(asyncio.create_task(users()))
        killed = []
        try:
            async with asyncio.timeout(30):
                for threshold in (N_REQUESTS // 4, N_REQUESTS // 2):
                    while len(done) < threshold:
                        progressed.clear()
                        await progressed.wait()
                    killed.append(await kill_leader())
                while len(done) < N_REQUESTS:
                    progressed.clear()
                    await progressed.wait()
        except TimeoutError:
            reqs = await farm.requests(User(name="root", admin=True))
            stuck = [(r.id, r.state, r.job) for r in reqs if not model.is_terminal(r)]
            workers = [(w.uuid[-1], w.state, w.job) for w in await farm.workers()]
            leader = await kv.get(election_key("farm"))
            raise AssertionError(
                f"stuck: {len(done)} done; not done: {stuck[:8]}; workers: {workers}; "
                f"leader: {leader.value if leader else None}; killed: {killed}"
            ) from None
        for ts in [*candidates.values(), [t for t in tasks]]:
            for t in ts:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    try:
                        await asyncio.wait_for(t, 10)
                    except TimeoutError:
                        raise AssertionError(f"task did not stop: {t!r}") from None
        assert len(killed) == 2
        assert violations == []
        reqs = await farm.requests(User(name="root", admin=True))
        assert len(reqs) == N_REQUESTS
        assert Counter(r.state for r in reqs) == {model.DONE: N_REQUESTS}
        # and every worker is free again
        for w in await farm.workers():
            assert (w.state, w.job) == (model.IDLE, None)
        for c in clients:
            try:
                await asyncio.wait_for(c.close(), 10)
            except TimeoutError:
                raise AssertionError(f"client did not close: {c!r}") from None

    asyncio.run(main())
