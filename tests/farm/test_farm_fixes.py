"""Issue 22's farm fixes with real agents on one sqlite World, over real HTTP with
real tokens: fragments are a right (`token create --fragment`), limited by the
worker's `--fragment-kinds` and reversed when the job ends; a worker that serves
the API answers acquire_worker for its own job; acquire through a server the
worker does not serve is refused at once; `--farm-job-period` and
`--farm-max-prolong` hold on the HTTP side too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from evergraph.cluster.election import election_key
from evergraph.farm import model, tokens
from evergraph.farm.service import Farm
from evergraph.farm.tokens import User
from evergraph.world.etcd import EtcdKV
from evergraph.world.etcd_server import EtcdServer
from evergraph.world.follow import Tombstone, watch_one
from evergraph.world.kv import KV
from evergraph.world.sqlite import SQLiteKV
from tests.conftest import Agent, host_key, run_cli, wait_for
from tests.kit.farm import ADMIN, farm_token, srv_trust
from tests.kit.http import api_url

GRAPH = "graph: g\nresources:\n  noop:\n  - name: n\n"


def _setup(tmp_path: Path) -> tuple[Path, Path, Path, tuple[str, str]]:
    """The World file, the job keys' authorized_keys, the agents' graph, the World
    flags."""
    db = tmp_path / "world.sqlite"
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    return db, tmp_path / "home" / "authorized_keys", g, ("--world-db", str(db))


def _leader(db: Path) -> str:
    """Who leads the farm's matcher now ("" if nobody)."""

    async def main() -> str:
        kv = SQLiteKV(db)
        try:
            item = await kv.get(election_key("farm"))
        finally:
            await kv.close()
        return item.value.decode() if item is not None else ""

    return asyncio.run(main())


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": "Bearer " + token}


def _idle(c: httpx.Client, admin: dict[str, str]) -> str:
    """The one worker's UUID, made IDLE."""
    wait_for(lambda: c.get("/api/v1/workers/", headers=admin).json(), what="a worker")
    [w] = c.get("/api/v1/workers/", headers=admin).json()
    uuid: str = w["WorkerUUID"]
    body = json.dumps({"WorkerState": "IDLE"})
    r = c.post(f"/api/v1/workers/{uuid}/setstate", content=body, headers=admin)
    assert r.status_code == 202, r.text
    wait_for(
        lambda: c.get(f"/api/v1/workers/{uuid}", headers=admin).json()["State"] == "IDLE",
        what="worker IDLE",
    )
    return uuid


def _new(c: httpx.Client, who: dict[str, str], fragment: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"Priority": 3}
    if fragment is not None:
        body["Fragment"] = fragment
    return c.post("/api/v1/reqs/", content=json.dumps(body), headers=who)


def _state(c: httpx.Client, who: dict[str, str], rid: int) -> str:
    state: str = c.get(f"/api/v1/reqs/{rid}", headers=who).json()["State"]
    return state


@pytest.mark.slow
def test_fragments_are_a_right_limited_by_kind_and_reversed_at_job_end(
    tmp_path: Path, agents: Any
) -> None:
    _db, keys, g, world = _setup(tmp_path)
    srv: Agent = agents(g, tmp_path / "srv", "--hostname", "srv", *world, "--http", "127.0.0.1:0")
    wk: Agent = agents(
        g,
        tmp_path / "wk1",
        "--hostname",
        "wk1",
        *world,
        "--worker",
        "--authorized-keys",
        str(keys),
        "--farm-server",
        f"srv={host_key(tmp_path / 'srv')}",
        "--fragment-kinds",
        "file",
    )
    srv.wait_converged()
    wk.wait_converged()
    admin = _bearer(farm_token(tmp_path / "srv", world, "root", "--admin"))
    bob = _bearer(farm_token(tmp_path / "srv", world, "bob"))
    carol = _bearer(farm_token(tmp_path / "srv", world, "carol", "--fragment"))
    made = tmp_path / "job" / "made-by-the-fragment"
    # the fragment's own meta does not ask for a reversal: the worker adds it
    file_fragment = f'resources:\n  file:\n  - name: {made}\n    content: "in a job\\n"\n'
    marker = tmp_path / "exec-ran"
    exec_fragment = f"resources:\n  exec:\n  - name: touch\n    cmd: touch {marker}\n"
    with httpx.Client(base_url=api_url(srv), timeout=30) as c:
        _idle(c, admin)
        # a token without the right: refused, and nothing is stored
        r = _new(c, bob, file_fragment)
        assert r.status_code == 403, r.text
        assert "--fragment" in r.json()["message"]
        assert c.post("/api/v1/reqs/list", content="", headers=admin).json() == []
        # with the right: the fragment's file exists for the job's life only
        r = _new(c, carol, file_fragment)
        assert r.status_code == 201, r.text
        rid = r.json()["ReqID"]
        assert rid == 1  # (the refused one took no id)
        wait_for(lambda: _state(c, carol, rid) == "IN PROGRESS", what="job 1 started")
        wait_for(lambda: made.exists() and made.read_text() == "in a job\n", what="the file")
        assert c.post(f"/api/v1/reqs/{rid}/close", headers=carol).status_code == 204
        wait_for(lambda: not made.exists(), what="the fragment's file removed at job end")
        # an exec fragment on a worker that takes only file fragments: never run
        wait_for(
            lambda: c.get("/api/v1/workers/", headers=admin).json()[0]["State"] == "IDLE",
            what="worker IDLE again",
        )
        converged = wk.converged_count()
        r = _new(c, carol, exec_fragment)
        assert r.status_code == 201, r.text
        rid = r.json()["ReqID"]
        wait_for(lambda: _state(c, carol, rid) == "IN PROGRESS", what="job 2 started")
        wait_for(
            lambda: keys.exists() and f"evergraph-job-{rid}" in keys.read_text(),
            what="job 2's key authorized (its graph swapped in)",
        )
        wk.wait_converged(converged + 1)
        assert not marker.exists()
        refused = "request 2's fragment uses exec, not among this worker's --fragment-kinds (file)"
        wait_for(lambda: refused in wk.log.read_text(), what="the refusal logged")
        assert c.post(f"/api/v1/reqs/{rid}/close", headers=carol).status_code == 204
        wait_for(lambda: f"evergraph-job-{rid}" not in keys.read_text(), what="key revoked")
    assert not marker.exists()
    assert wk.stop() == 0
    assert wk.log.read_text().count(refused) == 1  # once, whatever the swaps
    assert srv.stop() == 0


@pytest.mark.slow
def test_a_worker_serving_the_api_answers_acquire_for_its_own_job(
    tmp_path: Path, agents: Any
) -> None:
    """The one-host farm a new user tries first: one agent, `--http --worker`."""
    _db, keys, g, world = _setup(tmp_path)
    solo: Agent = agents(
        g,
        tmp_path / "solo",
        "--hostname",
        "solo",
        *world,
        "--http",
        "127.0.0.1:0",
        "--worker",
        "--authorized-keys",
        str(keys),
    )
    solo.wait_converged()
    admin = _bearer(farm_token(tmp_path / "solo", world, "root", "--admin"))
    with httpx.Client(base_url=api_url(solo), timeout=30) as c:
        _idle(c, admin)
        rid = _new(c, admin).json()["ReqID"]
        t0 = time.monotonic()
        r = c.post(f"/api/v1/reqs/{rid}/acquire_worker?wait=10", headers=admin)
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 5
        key = r.json()["Key"]
        assert key.startswith("-----BEGIN RSA PRIVATE KEY-----")
        wait_for(
            lambda: keys.exists() and f"evergraph-job-{rid}" in keys.read_text(),
            what="the job's key",
        )
    assert solo.stop() == 0


@pytest.mark.slow
def test_acquire_elsewhere_is_refused_at_once_and_the_periods_hold_over_http(
    tmp_path: Path, agents: Any
) -> None:
    db, keys, g, world = _setup(tmp_path)
    periods = ("--farm-job-period", "100", "--farm-max-prolong", "1")
    # the API servers trust each other (either may lead the matcher, and a token or a
    # request signed by one is acted on by the other)
    pin_srv = ("--farm-server", f"srv={host_key(tmp_path / 'srv')}")
    pin_other = ("--farm-server", f"other={host_key(tmp_path / 'other')}")
    srv: Agent = agents(
        g,
        tmp_path / "srv",
        "--hostname",
        "srv",
        *world,
        "--http",
        "127.0.0.1:0",
        *periods,
        *pin_other,
    )
    srv.wait_converged()
    wait_for(lambda: _leader(db) == "srv", what="srv leads the matcher")  # (before other)
    other: Agent = agents(
        g,
        tmp_path / "other",
        "--hostname",
        "other",
        *world,
        "--http",
        "127.0.0.1:0",
        *periods,
        *pin_srv,
    )
    wk: Agent = agents(
        g,
        tmp_path / "wk1",
        "--hostname",
        "wk1",
        *world,
        "--worker",
        "--authorized-keys",
        str(keys),
        *pin_srv,  # not "other": acquire through it must be refused
    )
    for a in (srv, other, wk):
        a.wait_converged()
    admin = _bearer(farm_token(tmp_path / "srv", world, "root", "--admin"))
    alice = _bearer(farm_token(tmp_path / "srv", world, "alice"))

    def job_timeout(rid: int) -> float:
        async def main() -> float:
            kv = SQLiteKV(db)
            try:
                # as srv sees it: "other" is a farm server it pins (--farm-server)
                trust = srv_trust(tmp_path / "srv", servers=("other",))
                req = await Farm(kv, trust=trust).request(ADMIN, rid)
            finally:
                await kv.close()
            assert req.job is not None
            return req.job.timeout

        return asyncio.run(main())

    with (
        httpx.Client(base_url=api_url(srv), timeout=30) as c,
        httpx.Client(base_url=api_url(other), timeout=30) as elsewhere,
    ):
        _idle(c, admin)
        rid = _new(c, alice).json()["ReqID"]
        wait_for(lambda: _state(c, alice, rid) == "IN PROGRESS", what="matched")
        # the matcher (whichever server leads) gave the job --farm-job-period
        assert job_timeout(rid) - time.time() == pytest.approx(100, abs=15)
        # through a server the worker does not hand keys to: 400 at once, naming them
        t0 = time.monotonic()
        r = elsewhere.post(f"/api/v1/reqs/{rid}/acquire_worker?wait=20", headers=alice)
        assert time.monotonic() - t0 < 5
        assert r.status_code == 400, r.text
        message = r.json()["message"]
        assert message.startswith("invalid request: ")
        assert "(srv, wk1)" in message
        assert "other" in message
        # through its server: the key
        r = c.post(f"/api/v1/reqs/{rid}/acquire_worker?wait=20", headers=alice)
        assert r.status_code == 200, r.text
        # prolong on the HTTP side: by the period given, at most --farm-max-prolong times
        r = elsewhere.post(f"/api/v1/reqs/{rid}/prolong", headers=alice)
        assert r.status_code == 204, r.text
        assert job_timeout(rid) - time.time() == pytest.approx(100, abs=15)
        r = c.post(f"/api/v1/reqs/{rid}/prolong", headers=alice)
        assert r.status_code == 400, r.text
        assert "the limit is 1" in r.json()["message"]
        assert c.post(f"/api/v1/reqs/{rid}/close", headers=alice).status_code == 204
    for a in (wk, other, srv):
        assert a.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "etcd"])
def test_the_matcher_resumes_soon_after_a_killed_leaders_lease_expires(
    tmp_path: Path, agents: Any, backend: str, shm: Path, servers: list[EtcdServer]
) -> None:
    """kill -9 of the leading matcher's agent: the next leader matches a waiting
    request within 2 s of the dead leader's election lease expiring, and the lease
    is `--farm-election-ttl` long."""
    ttl = 3.0
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    world: tuple[str, ...] = ("--world-db", str(tmp_path / "world.sqlite"))
    if backend == "etcd":
        server = EtcdServer.single(shm)
        servers.append(server)
        server.start()
        world = ("--seeds", server.client_url)
    flags = ("--http", "127.0.0.1:0", "--farm-election-ttl", str(ttl))
    names = ("m0", "m1")
    pins = {n: ("--farm-server", f"{n}={host_key(tmp_path / n)}") for n in names}
    serving = {
        name: agents(
            g,
            tmp_path / name,
            "--hostname",
            name,
            *world,
            *flags,
            *(p for n in names if n != name for p in pins[n]),
        )
        for name in names
    }
    wk: Agent = agents(
        g, tmp_path / "wk1", "--hostname", "wk1", *world, "--worker", *pins["m0"], *pins["m1"]
    )
    for a in (*serving.values(), wk):
        a.wait_converged()

    def kv() -> KV:
        return EtcdKV([servers[0].client_url]) if backend == "etcd" else SQLiteKV(world[1])

    async def main() -> tuple[float, float]:
        client = kv()

        # requests signed as m0 (a farm server both the other server and the worker pin),
        # read with m0's pins of the worker's key
        def as_m0() -> Farm:
            return Farm(client, trust=srv_trust(tmp_path / "m0", "m0", servers=("m1",)))

        farm = as_m0()
        try:
            async with asyncio.timeout(15):
                # (until m0 has pinned the worker's key: its registration is signed by it)
                while not (found := await as_m0().workers()):
                    await asyncio.sleep(0.02)
            [w] = found
            await farm.set_state(ADMIN, w.uuid, model.IDLE)
            async with asyncio.timeout(15):
                while (await farm.worker(w.uuid)).state != model.IDLE:
                    await asyncio.sleep(0.02)  # polling the World: PREPARE -> IDLE
            item = await client.get(election_key("farm"))
            assert item is not None
            dead = serving[item.value.decode()]
            lease_gone = asyncio.Event()

            async def watch() -> float:
                async with contextlib.aclosing(watch_one(client, election_key("farm"))) as snaps:
                    async for snap in snaps:
                        if isinstance(snap, Tombstone) or snap.lease != item.lease:
                            lease_gone.set()
                            return time.monotonic()
                raise AssertionError("the watch ended")

            watcher = asyncio.create_task(watch())
            t0 = time.monotonic()
            os.kill(dead.proc.pid, signal.SIGKILL)
            rid = await farm.new_request(ADMIN, priority=1)
            req = await farm.wait_started(ADMIN, rid, 30)
            t1 = time.monotonic()
            assert req.state == model.IN_PROGRESS
            gone = await watcher
            return t1 - t0, t1 - gone
        finally:
            await client.close()

    after_kill, after_expiry = asyncio.run(main())
    assert after_expiry < 2.0
    assert after_kill < ttl + 2.0 + (1.0 if backend == "etcd" else 0.0)  # etcd: whole seconds
    for a in (wk, *serving.values()):
        a.stop()


def test_token_create_fragment_gives_the_right_and_list_shows_it(tmp_path: Path) -> None:
    s = tmp_path / "s"
    plain = farm_token(s, (), "bob")
    fragment = farm_token(s, (), "carol", "--fragment")

    async def find(t: str) -> User | None:
        kv = SQLiteKV(s / "world.sqlite")
        try:
            return await tokens.lookup(kv, t, srv_trust(s))
        finally:
            await kv.close()

    bob, carol = asyncio.run(find(plain)), asyncio.run(find(fragment))
    assert bob is not None
    assert carol is not None
    assert (bob.fragment, carol.fragment, carol.admin) == (False, True, False)
    r = run_cli("farm", "token", "list", "--state-dir", s)
    assert r.returncode == 0, r.stderr
    rows = sorted(line.split("\t")[1:] for line in r.stdout.splitlines())
    assert rows == [["bob", "-", "-"], ["carol", "-", "fragment"]]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--farm-job-period", "60"), "--farm-job-period"),  # no --http: no matcher here
        (("--worker", "--fragment-kinds", "file,nosuch"), "--fragment-kinds"),
        (("--fragment-kinds", "file"), "--worker"),
        (("--http", "127.0.0.1:0", "--farm-election-ttl", "0.1"), "--farm-election-ttl"),
    ],
)
def test_bad_farm_flags_are_one_line_and_exit_2(
    tmp_path: Path, args: tuple[str, ...], flag: str
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    r = run_cli("run", g, "--state-dir", tmp_path / "s", *args)
    assert r.returncode == 2, r.stderr
    assert len([line for line in r.stderr.splitlines() if flag in line]) == 1, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_worker_away_for_a_moment_does_not_invalidate_its_requests(
    tmp_path: Path, agents: Any
) -> None:
    """`--farm-invalid-grace`: the only fitting worker deregistered and started again
    within the grace leaves its waiting request WAITING; a request no worker fits
    becomes INVALID once the grace has passed, not before."""
    grace = 5.0
    db = tmp_path / "world.sqlite"
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    world = ("--world-db", str(db))
    srv: Agent = agents(
        g,
        tmp_path / "srv",
        "--hostname",
        "srv",
        *world,
        "--http",
        "127.0.0.1:0",
        "--farm-invalid-grace",
        str(grace),
    )
    worker = ("--hostname", "wk1", *world, "--worker", "--cap", "board=rpi4")
    wk: Agent = agents(g, tmp_path / "wk1", *worker)
    srv.wait_converged()
    wk.wait_converged()
    admin = _bearer(farm_token(tmp_path / "srv", world, "root", "--admin"))
    with httpx.Client(base_url=api_url(srv), timeout=30) as c:
        wait_for(lambda: c.get("/api/v1/workers/", headers=admin).json(), what="a worker")
        [w] = c.get("/api/v1/workers/", headers=admin).json()
        uuid = w["WorkerUUID"]
        # (the worker stays in MAINTENANCE: a request that fits it waits)
        body = json.dumps({"Priority": 3, "Caps": {"board": "rpi4"}})
        rid = c.post("/api/v1/reqs/", content=body, headers=admin).json()["ReqID"]
        assert wk.stop() == 0
        r = c.post(f"/api/v1/workers/{uuid}/deregister", headers=admin)
        assert r.status_code == 204, r.text
        gone = time.monotonic()
        wk2: Agent = agents(g, tmp_path / "wk1", *worker)
        wait_for(
            lambda: c.get(f"/api/v1/workers/{uuid}", headers=admin).status_code == 200,
            what="the worker registered again",
        )
        assert time.monotonic() - gone < grace, "the worker took longer than the grace"
        body = json.dumps({"Priority": 3, "Caps": {"board": "nosuch"}})
        never = c.post("/api/v1/reqs/", content=body, headers=admin).json()["ReqID"]
        asked = time.monotonic()
        wait_for(lambda: _state(c, admin, never) == "INVALID", what="INVALID after the grace")
        assert time.monotonic() - asked >= grace - 0.5  # (the matcher's clock started first)
        assert _state(c, admin, rid) == "WAITING"
    assert wk2.stop() == 0
    assert srv.stop() == 0
