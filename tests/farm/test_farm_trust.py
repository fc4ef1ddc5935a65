"""The farm trusts nothing the World says (issue 22): real agents (an API server
`srv` with `--http`, a worker `wk1` pinning it with `--farm-server srv=KEY`) on a
sqlite World (and a real etcd for the forged assignment), attacked by a World
writer who holds no farm server key. Each attack: no effect on the worker (no
command run, no job key made), one refusal line naming the record, no traceback."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import pytest

from evergraph.cluster.election import election_key
from evergraph.cluster.exports import export_key
from evergraph.cluster.hostkeys import HostKeys, KeyError_
from evergraph.farm import model
from evergraph.farm.service import ALIVE, encode, req_key, worker_key
from evergraph.farm.signed import seal
from evergraph.world.etcd import EtcdKV
from evergraph.world.etcd_server import EtcdServer
from evergraph.world.kv import KV, Put
from evergraph.world.sqlite import SQLiteKV
from tests.conftest import Agent, host_key, run_cli, wait_for
from tests.kit.farm import ADMIN, farm_call, worker_uuid
from tests.kit.http import api_url

T = TypeVar("T")
GRAPH = "graph: g\nresources:\n  noop:\n  - name: n\n"


@dataclass
class Farm:
    tmp: Path
    world: tuple[str, ...]
    kv: Callable[[], KV]
    srv: Agent
    wk: Agent
    uuid: str
    #: what a forged fragment's exec would create, and the job keys file
    marker: Path
    keys: Path

    def call(self, fn: Callable[[KV], Awaitable[T]]) -> T:
        """`fn` on the World, as the attacker (any World writer) can."""

        async def main() -> T:
            kv = self.kv()
            try:
                return await fn(kv)
            finally:
                await kv.close()

        return asyncio.run(main())

    def get(self, key: str) -> tuple[bytes, int] | None:
        async def get(kv: KV) -> tuple[bytes, int] | None:
            item = await kv.get(key)
            return (item.value, item.mod_revision) if item is not None else None

        return self.call(get)

    def put(self, *items: tuple[str, bytes]) -> int:
        """Write records in one transaction; its revision."""

        async def put(kv: KV) -> int:
            rev = await kv.txn([], [Put(k, v) for k, v in items])
            assert rev is not None
            return rev

        return self.call(put)

    def term(self) -> int:
        item = self.get(election_key("farm"))
        assert item is not None
        return item[1]

    def worker(self) -> model.Worker:
        return farm_call(self.tmp / "world.sqlite", lambda f: f.worker(self.uuid), self.kv)

    def exec_fragment(self) -> str:
        return f'resources:\n  exec:\n  - name: pwn\n    cmd: "touch {self.marker}"\n'

    def no_effect(self) -> None:
        # no job started for a forged request (ids 97-99, the fuzz's 1000-1049): no
        # key made, no fragment merged, nothing run
        started = re.findall(r"job of request (\d+) started", self.wk.log.read_text())
        assert not [n for n in started if int(n) >= 97], started
        assert not self.marker.exists(), "a forged fragment ran on the worker"
        assert not self.keys.exists() or "evergraph-job-" not in self.keys.read_text()
        assert self.wk.proc.poll() is None
        for a in (self.srv, self.wk):
            assert "Traceback" not in a.log.read_text()


def refusals(agent: Agent, key: str) -> list[str]:
    pat = re.compile(rf"farm: {re.escape(key)} \(revision (\d+)\) refused: (.*)")
    return [m[0] for m in pat.finditer(agent.log.read_text())]


def wait_refused(agent: Agent, key: str, rev: int, what: str) -> str:
    line: list[str] = []

    def found() -> bool:
        line[:] = [x for x in refusals(agent, key) if f"(revision {rev})" in x]
        return bool(line)

    wait_for(found, what=f"{agent.log.parent.name} refusing {key}@{rev} ({what})")
    assert len(line) == 1, f"logged more than once: {line}"
    return line[0]


@pytest.fixture(params=["sqlite"])
def farm(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    agents: Any,
    shm: Path,
    servers: list[EtcdServer],
) -> Farm:
    db = tmp_path / "world.sqlite"
    world: tuple[str, ...] = ("--world-db", str(db))
    kv: Callable[[], KV] = lambda: SQLiteKV(db)  # noqa: E731
    if request.param == "etcd":
        server = EtcdServer.single(shm)
        servers.append(server)
        server.start()
        url = server.client_url
        world = ("--seeds", url)
        kv = lambda: EtcdKV([url])  # noqa: E731
    return _start(tmp_path, agents, world, kv)


def _start(
    tmp: Path,
    agents: Any,
    world: tuple[str, ...],
    kv: Callable[[], KV],
    *,
    attacker_first: bool = False,
    srv_flags: tuple[str, ...] = (),
) -> Farm:
    g = tmp / "g.yaml"
    g.write_text(GRAPH)
    keys = tmp / "home" / "authorized_keys"
    srv_key = host_key(tmp / "srv")  # made before srv runs: what its operator gives out

    def start_srv() -> Agent:
        # (no grace before INVALID: a test waits for a request no worker can take)
        flags = ("--http", "127.0.0.1:0", "--farm-invalid-grace", "0", *srv_flags)
        a: Agent = agents(g, tmp / "srv", "--hostname", "srv", *world, *flags)
        a.wait_converged()
        return a

    srv = None if attacker_first else start_srv()
    wk: Agent = agents(
        g,
        tmp / "wk1",
        *("--hostname", "wk1", *world, "--worker", "--authorized-keys", str(keys)),
        *("--farm-server", f"srv={srv_key}"),
    )
    wk.wait_converged()
    if srv is None:
        srv = start_srv()
    uuid = worker_uuid(tmp / "wk1")
    f = Farm(tmp, world, kv, srv, wk, uuid, tmp / "pwned", keys)
    farm_call(tmp / "world.sqlite", lambda x: x.set_state(ADMIN, uuid, model.IDLE), kv)
    wait_for(lambda: f.worker().state == model.IDLE, what="worker IDLE")
    return f


def _request(rid: int, uuid: str, fragment: str | None, state: str = model.IN_PROGRESS) -> bytes:
    now = time.time()  # a job running now, as a real one would be
    req = model.new_request(
        id=rid, owner="mallory", priority=1, now=now, queued=rid, fragment=fragment
    )
    if state == model.IN_PROGRESS:
        req = model.start_request(req, uuid, now, 3600)
    return encode(req)


def _running(f: Farm, rid: int) -> bytes:
    return encode(model.assign_worker(f.worker(), rid))


def _signed(keys: HostKeys, signer: str, key: str, body: bytes, term: int, prev: int) -> bytes:
    return seal(keys, signer, key, body, term=term, prev=prev)


# -- 1. the forged assignment ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("farm", ["sqlite", "etcd"], indirect=True)
def test_a_forged_assignment_runs_nothing_and_the_leader_does_not_act_on_it(farm: Farm) -> None:
    f = farm
    wkey, rkey = worker_key(f.uuid), req_key(99)
    # as today's records were: plain JSON, an IN PROGRESS request holding an exec
    forged = _request(99, f.uuid, f.exec_fragment())
    rev = f.put((rkey, forged), (wkey, _running(f, 99)))
    why = wait_refused(f.wk, wkey, rev, "an unsigned assignment")
    assert "not a signed farm record" in why
    wait_refused(f.srv, rkey, rev, "the leader: an unsigned request")
    f.no_effect()
    # the leader neither failed nor touched it: treated as absent
    assert f.get(rkey) == (forged, rev)
    # the worker put its own record back (signed, as it was)
    wait_for(lambda: (f.get(wkey) or (b"", 0))[1] > rev, what="the worker record restored")
    assert f.worker().state == model.IDLE
    # signed, but by the attacker's own key claiming to be srv, with the current term
    mallory = HostKeys(f.tmp / "mallory")
    item = f.get(wkey)
    assert item is not None
    term = f.term()
    rev2 = f.put(
        (rkey, _signed(mallory, "srv", rkey, _request(99, f.uuid, f.exec_fragment()), term, 0)),
        (wkey, _signed(mallory, "srv", wkey, _running(f, 99), term, item[1])),
    )
    assert "neither a farm server" in wait_refused(f.wk, wkey, rev2, "signed by another key")
    wait_refused(f.srv, rkey, rev2, "the leader: the request signed by another key")
    f.no_effect()


# -- 2. replay and 3. mixing terms -----------------------------------------------------------
@pytest.mark.slow
def test_an_old_terms_assignment_put_back_runs_nothing(farm: Farm) -> None:
    """Records srv really signed, but in an earlier term (what an attacker who kept
    old records puts back): refused by the worker, and not signed again by the
    leader (it was not there when the leader took office)."""
    f = farm
    srv = HostKeys(f.tmp / "srv")
    wkey, rkey = worker_key(f.uuid), req_key(98)
    old = f.term() - 1
    item = f.get(wkey)
    assert item is not None
    rev = f.put(
        (rkey, _signed(srv, "srv", rkey, _request(98, f.uuid, f.exec_fragment()), old, 0)),
        (wkey, _signed(srv, "srv", wkey, _running(f, 98), old, item[1])),
    )
    assert f"in term {old}" in wait_refused(f.wk, wkey, rev, "an old term's assignment")
    assert "put back" in wait_refused(f.srv, wkey, rev, "the leader does not sign it again")
    f.no_effect()


@pytest.mark.slow
def test_records_of_two_terms_mixed_run_nothing(farm: Farm) -> None:
    """The worker record of the current term, the request of an earlier one."""
    f = farm
    srv = HostKeys(f.tmp / "srv")
    wkey, rkey = worker_key(f.uuid), req_key(97)
    term = f.term()
    item = f.get(wkey)
    assert item is not None
    rev = f.put(
        (rkey, _signed(srv, "srv", rkey, _request(97, f.uuid, f.exec_fragment()), term - 1, 0)),
        (wkey, _signed(srv, "srv", wkey, _running(f, 97), term, item[1])),
    )
    why = wait_refused(f.wk, wkey, rev, "two terms mixed")
    assert f"started in term {term - 1}" in why
    assert "put back" in wait_refused(f.srv, wkey, rev, "the leader does not sign it again")
    f.no_effect()


# -- 4. a forged admin token -------------------------------------------------------------------
@pytest.mark.slow
def test_a_forged_admin_token_is_refused(farm: Farm) -> None:
    f = farm
    mallory = HostKeys(f.tmp / "mallory")
    user = msgspec.json.encode({"name": "mallory", "groups": [], "admin": True})
    plain, signed = "egt_" + "p" * 43, "egt_" + "s" * 43
    pkey, skey = (f"farm/tokens/{hashlib.sha256(t.encode()).hexdigest()}" for t in (plain, signed))
    rev = f.put((pkey, user), (skey, seal(mallory, "srv", skey, user)))
    here = ("--state-dir", f.tmp / "srv")
    made = run_cli("farm", "token", "create", "root", "--admin", *f.world, *here)
    assert made.returncode == 0, made.stderr
    genuine = made.stdout.strip()
    with httpx.Client(base_url=api_url(f.srv), timeout=10) as c:
        for token in (plain, signed, plain):
            r = c.get("/api/v1/workers/", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 401, r.text
        r = c.get("/api/v1/workers/", headers={"Authorization": f"Bearer {genuine}"})
        assert r.status_code == 200
    # logged once, though presented twice
    assert "not a signed" in wait_refused(f.srv, pkey, rev, "an unsigned token")
    assert "trust" in wait_refused(f.srv, skey, rev, "a token signed by another key")
    f.no_effect()


# -- 5. job-key theft through a poisoned hostkeys/<server> ------------------------------------
@pytest.mark.slow
def test_a_job_key_goes_only_to_the_explicitly_pinned_server(tmp_path: Path, agents: Any) -> None:
    db = tmp_path / "world.sqlite"
    mallory = HostKeys(tmp_path / "mallory")
    rec = {"host": "srv", "public": mallory.public, "verify": mallory.verify}

    async def poison() -> None:
        kv = SQLiteKV(db)
        await kv.put("hostkeys/srv", msgspec.json.encode(rec))
        await kv.close()

    asyncio.run(poison())  # before the worker ever saw srv's real key
    f = _start(tmp_path, agents, ("--world-db", str(db)), lambda: SQLiteKV(db), attacker_first=True)
    made = run_cli("farm", "token", "create", "alice", *f.world, "--state-dir", tmp_path / "srv")
    assert made.returncode == 0, made.stderr
    auth = {"Authorization": f"Bearer {made.stdout.strip()}"}
    with httpx.Client(base_url=api_url(f.srv), timeout=30) as c:
        r = c.post("/api/v1/reqs/", content=json.dumps({"Priority": 3}), headers=auth)
        assert r.status_code == 201, r.text
        rid = r.json()["ReqID"]
        r = c.post(f"/api/v1/reqs/{rid}/acquire_worker?wait=20", headers=auth)
        assert r.status_code == 200, r.text  # sealed to srv's real key: srv opens it
    item = f.get(export_key("srv", "wk1", "farm.access", str(rid)))
    assert item is not None
    payload = json.loads(item[0])["payload"]
    with pytest.raises(KeyError_):
        mallory.unseal(base64.b64decode(payload))


# -- 6. the worker's record deleted ------------------------------------------------------------
@pytest.mark.slow
def test_a_deleted_worker_record_comes_back(farm: Farm) -> None:
    f = farm

    async def delete(kv: KV, key: str) -> None:
        await kv.delete(key)

    f.call(lambda kv: delete(kv, worker_key(f.uuid)))
    wait_for(lambda: f.get(worker_key(f.uuid)) is not None, what="the worker record back")
    workers = farm_call(f.tmp / "world.sqlite", lambda x: x.workers(), f.kv)
    assert [w.uuid for w in workers] == [f.uuid]  # listed again, and trusted
    assert workers[0].state == model.IDLE  # as it was
    # (the leader may see the alive key missing meanwhile and make the worker FAILED:
    # that key is liveness, not trust; it is put back all the same)
    f.call(lambda kv: delete(kv, f"{ALIVE}{f.uuid}"))
    wait_for(lambda: f.get(f"{ALIVE}{f.uuid}") is not None, what="the alive key back")
    f.no_effect()


# -- 6b. the worker's alive key forged ----------------------------------------------------------
@pytest.mark.slow
def test_a_forged_alive_key_is_put_back_and_keeps_no_dead_worker_alive(
    tmp_path: Path, agents: Any
) -> None:
    """`farm/alive/<uuid>` is signed by the worker's host: one written by anyone else
    is put back by the live worker at once, and keeps no dead worker from FAILED
    (nor sends its acquires to the attacker's servers)."""
    db = tmp_path / "world.sqlite"
    world = ("--world-db", str(db))
    f = _start(tmp_path, agents, world, lambda: SQLiteKV(db), srv_flags=("--farm-alive-grace", "1"))
    key = f"{ALIVE}{f.uuid}"
    mallory = HostKeys(tmp_path / "mallory")
    forged = seal(mallory, "wk1", key, msgspec.json.encode({"servers": ["mallory"]}))
    # on a live worker: its agent puts its own back at once
    f.put((key, forged))

    def put_back() -> bool:
        got = f.get(key)
        return got is not None and got[0] != forged

    wait_for(put_back, what="the alive key put back by the worker")
    wait_for(
        lambda: "changed by someone else: put back" in f.wk.log.read_text(),
        what="the worker's warning",
    )
    f.no_effect()
    # the worker's agent stops (its lease ends, its alive key with it); the forged
    # key (signed by another key, and one with no signature) keeps it from nothing
    assert f.wk.stop() == 0
    wait_for(lambda: f.get(key) is None, what="the alive key gone with the worker's lease")
    rev = f.put((key, forged))
    wait_refused(f.srv, key, rev, "the forged alive key")
    wait_for(lambda: f.worker().state == model.FAILED, what="the dead worker FAILED")
    rev = f.put((key, b'{"servers": []}'))
    wait_refused(f.srv, key, rev, "an unsigned alive key")
    assert f.worker().state == model.FAILED
    assert "Traceback" not in f.srv.log.read_text()


@pytest.mark.slow
def test_a_deleted_request_is_put_back_by_the_leader(farm: Farm) -> None:
    """The farm never deletes a request: one that vanishes was deleted by someone
    else, and the leader puts it back as it last verified it."""
    f = farm
    db = f.tmp / "world.sqlite"
    # a request no worker could ever take: the leader makes it INVALID (so it saw it)
    rid = farm_call(db, lambda x: x.new_request(ADMIN, priority=2, caps={"board": "x"}), f.kv)

    def state() -> str:
        return farm_call(db, lambda x: x.request(ADMIN, rid), f.kv).state

    wait_for(lambda: state() == model.INVALID, what="the request INVALID")

    async def delete(kv: KV) -> None:
        await kv.delete(req_key(rid))

    f.call(delete)
    # (the leader learns of the delete from sqlite's notifier, or at worst from its
    # 30 s poll behind it: a loaded machine has been seen past the default 15 s)
    wait_for(lambda: f.get(req_key(rid)) is not None, timeout=45, what="the request put back")
    assert state() == model.INVALID
    f.no_effect()


def test_a_farm_server_named_without_a_key_needs_an_explicit_pin(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(GRAPH)
    base = ("run", g, "--world-db", tmp_path / "w.sqlite", "--worker", "--state-dir")
    r = run_cli(*base, tmp_path / "wk", "--farm-server", "srv", "--hostname", "wk")
    assert r.returncode == 2, r.stderr
    assert "--farm-server srv=KEY" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli(*base, tmp_path / "wk", "--farm-server", "srv=nokey", "--hostname", "wk")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1
    assert "--farm-server" in r.stderr


# -- 7. fuzz ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_fuzzed_farm_records_have_no_effect(farm: Farm) -> None:
    f = farm
    rng = random.Random(22)
    srv = HostKeys(f.tmp / "srv")
    mallory = HostKeys(f.tmp / "mallory")
    wkey = worker_key(f.uuid)
    others = [f"00000000-0000-4000-8000-{i:012d}" for i in range(3)]
    term = f.term()
    batches = []
    for _ in range(300):
        rid = 1000 + rng.randrange(50)
        rkey = req_key(rid)
        frag = f.exec_fragment()
        kind = rng.randrange(7)
        req = _request(rid, f.uuid, frag)
        run = _running(f, rid)
        prev = rng.randrange(0, 10_000)
        if kind == 0:  # garbage
            items = [(rng.choice([rkey, wkey, worker_key(rng.choice(others))]), rng.randbytes(40))]
        elif kind == 1:  # valid JSON, unsigned
            items = [(rkey, req), (wkey, run)]
        elif kind == 2:  # signed by a key that is no farm server's, claiming srv or wk1
            who = rng.choice(["srv", "wk1", "mallory"])
            items = [
                (rkey, seal(mallory, who, rkey, req, term=term, prev=prev)),
                (wkey, seal(mallory, who, wkey, run, term=term, prev=prev)),
            ]
        elif kind == 3:  # srv's own signature, of a stale term
            stale = rng.randrange(1, term)
            items = [
                (rkey, seal(srv, "srv", rkey, req, term=stale)),
                (wkey, seal(srv, "srv", wkey, run, term=stale, prev=prev)),
            ]
        elif kind == 4:  # a mismatched request: another worker's, WAITING, or another id
            bad = rng.choice(
                [
                    _request(rid, others[0], frag),
                    _request(rid, f.uuid, frag, model.WAITING),
                    _request(rid + 1, f.uuid, frag),
                ]
            )
            stale = rng.randrange(1, term)
            items = [
                (rkey, seal(srv, "srv", rkey, bad, term=stale)),
                (wkey, seal(srv, "srv", wkey, run, term=stale, prev=prev)),
            ]
        elif kind == 5:  # a real signature over other bytes (tampered)
            env = json.loads(seal(srv, "srv", wkey, run, term=term, prev=prev))
            env["body"] = run.decode().replace('"RUNNING"', '"RUNNING" ')
            items = [(rkey, req), (wkey, json.dumps(env).encode())]
        else:  # an envelope moved from another key
            items = [(wkey, seal(srv, "srv", worker_key(others[1]), run, term=term, prev=prev))]
        batches.append(items)
    last = 0
    for items in batches:
        last = f.put(*items)
    # the last write to the worker's record was refused, and the record restored
    wait_for(
        lambda: (
            any(
                f"(revision {r})" in x
                for r in range(last - 3, last + 1)
                for x in refusals(f.wk, wkey)
            )
            or (f.get(wkey) or (b"", 0))[1] > last
        ),
        what="the worker through the fuzz",
    )
    wait_for(lambda: f.worker().state == model.IDLE, what="the worker's record restored")
    f.no_effect()
    # and it still serves a genuine job (the fuzz broke nothing)
    rid = farm_call(f.tmp / "world.sqlite", lambda x: x.new_request(ADMIN, priority=1), f.kv)
    wait_for(
        lambda: f.keys.exists() and f"evergraph-job-{rid}" in f.keys.read_text(),
        what="a genuine job after the fuzz",
    )
    assert not f.marker.exists()


def test_a_record_of_a_host_not_yet_known_is_checked_again(tmp_path: Path) -> None:
    """A worker's registration reaches the API server before its `hostkeys/` record:
    refused for now, and trusted once the key is known (a refusal is not kept)."""
    from evergraph.farm.service import Farm as Service
    from evergraph.farm.signed import FarmTrust
    from evergraph.world.memory import MemoryKV, MemoryStore

    known: dict[str, str] = {}
    wk = HostKeys(tmp_path / "wk1")
    trust = FarmTrust(HostKeys(tmp_path / "srv"), "srv", host_key=known.get)
    uuid = "00000000-0000-4000-8000-000000000001"
    w = model.register_worker(
        uuid=uuid, caps={"hostname": "wk1"}, address="127.0.0.1", port=22, username="t", now=0.0
    )

    async def main() -> tuple[list[model.Worker], list[model.Worker]]:
        kv = MemoryKV(MemoryStore())
        await kv.put(worker_key(uuid), seal(wk, "wk1", worker_key(uuid), encode(w)))
        farm = Service(kv, trust=trust)
        before = await farm.workers()
        known["wk1"] = wk.verify
        return before, await farm.workers()

    before, after = asyncio.run(main())
    assert before == []
    assert [x.uuid for x in after] == [uuid]


# -- the worker's replay mark kept across restarts -----------------------------------------------
@pytest.mark.parametrize("kept", [True, False], ids=["mark-kept", "control-no-state-dir"])
def test_a_restarted_worker_refuses_its_record_older_than_it_saw(
    tmp_path: Path, kept: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker keeps the newest version of its record it saw (per World) in its
    state dir: an older signed version put back while it was down is refused after
    its restart. (Without a state dir, the control: it is taken.)"""
    import logging

    from evergraph.cluster.exports import HostKeyBook, Publisher
    from evergraph.cluster.pins import Pins
    from evergraph.farm.host import WorkerHost
    from evergraph.farm.signed import FarmTrust
    from evergraph.world.memory import MemoryKV, MemoryStore

    uuid = "5f0c0e8a-1111-4222-8333-944445555666"
    key = worker_key(uuid)
    skeys, wkeys = HostKeys(tmp_path / "srv"), HostKeys(tmp_path / "wk1")
    strust = FarmTrust(skeys, "srv")
    state = tmp_path / "wk1-state" if kept else None

    def worker(kv: KV) -> WorkerHost:
        book = HostKeyBook(kv, Pins(tmp_path / "wk1"), "wk1")
        return WorkerHost(
            kv,
            uuid=uuid,
            host="wk1",
            caps={"hostname": "wk1"},
            groups=[],
            address="127.0.0.1",
            port=22,
            username="t",
            lease=lambda: 0,
            publisher=Publisher(kv, wkeys, "wk1", book, lambda: 0),
            key_servers={"srv"},
            trust=FarmTrust(wkeys, "wk1", {"srv": skeys.verify}),
            state_dir=state,
        )

    async def server_sets(kv: KV, state_name: str) -> bytes:
        item = await kv.get(key)
        assert item is not None
        w = msgspec.json.decode(msgspec.json.decode(item.value)["body"])
        w["state"] = state_name
        value = strust.seal(key, msgspec.json.encode(w), prev=item.mod_revision)
        await kv.put(key, value)
        return value

    async def main() -> None:
        kv = MemoryKV(MemoryStore())
        w1 = worker(kv)
        await w1.register()
        task = asyncio.create_task(w1._follow_record())
        await server_sets(kv, model.IDLE)
        old = await server_sets(kv, model.MAINTENANCE)
        await server_sets(kv, model.IDLE)
        high = (await kv.get(key)).mod_revision  # type: ignore[union-attr]
        while w1._high != high:
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if w1._marks is not None:
            w1._marks.flush()
        # the worker is down; the attacker puts back the older version
        await kv.put(key, old)
        w2 = worker(kv)
        assert w2._high == (high if kept else 0)
        with caplog.at_level(logging.WARNING, "evergraph.farm"):
            task = asyncio.create_task(w2._follow_record())
            for _ in range(100):
                await asyncio.sleep(0.01)
                if "older than a version already seen" in caplog.text or w2._last:
                    break
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        refused = "older than a version already seen" in caplog.text
        assert refused == kept

    asyncio.run(main())
