"""A World replaced under running agents is rebuilt in full, and an agent's member
record defends itself (issue 22, items 5, 3 and 6 for members, 10 for caps).

Real agents as subprocesses, a real etcd on loopback, the real sqlite file:

- etcd wiped (stopped, data dir deleted, restarted on the same port): members,
  host keys and exports come back;
- etcd replaced under the same cluster id, its revision already ahead, while an
  agent is suspended: the World's id record tells, and the agent rebuilds;
- `world.sqlite` deleted and recreated by another agent (whose first lease has
  the id the running agent's had): the running agent is back in `members`;
- a sqlite backup restored in place (same file, same World id, the revision
  going back): noticed, and the exporter's records are written anew;
- a record the agent did not write (forged, deleted, an old copy of its own)
  never stops it: it restores its own and logs an alarm; only a real second
  agent is refused, and `--replace` is logged on both sides.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nacl.signing
import pytest

from evergraph.world.etcd import EtcdKV
from evergraph.world.etcd_server import FAST_TIMING, EtcdServer, free_port
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.agents import ExportPair, exited, noop_graph
from tests.kit.worldfile import member, query, record

AgentFactory = Callable[..., Agent]

etcd_only = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed")


def etcd_raw(url: str, prefix: str) -> dict[str, tuple[bytes, int]]:
    """key -> (value, lease) of every key under `prefix` in the etcd World."""

    async def main() -> dict[str, tuple[bytes, int]]:
        async with EtcdKV([url]) as kv:
            items, _ = await kv.range(prefix)
            return {i.key: (i.value, i.lease) for i in items}

    return asyncio.run(main())


def etcd_put_many(url: str, n: int) -> None:
    async def main() -> None:
        async with EtcdKV([url]) as kv:
            for i in range(n):
                await kv.put(f"filler/{i}", b"x")

    asyncio.run(main())


def etcd_revision(url: str) -> int:
    async def main() -> int:
        async with EtcdKV([url]) as kv:
            return (await kv.range("\0"))[1]

    return asyncio.run(main())


def logged(agent: Agent, text: str) -> Callable[[], bool]:
    return lambda: text in agent.log.read_text()


def pair_keys(p: ExportPair) -> set[str]:
    return {
        "members/hosta",
        "members/hostb",
        "hostkeys/hosta",
        "hostkeys/hostb",
        p.key,
    }


# -- item 5: a replaced World is rebuilt in full -----------------------------------------


@etcd_only
@pytest.mark.slow
def test_etcd_wiped_under_running_agents_members_hostkeys_and_exports_come_back(
    tmp_path: Path, shm: Path, servers: list[EtcdServer], agents: AgentFactory
) -> None:
    data = shm / "etcd"
    server = EtcdServer.single(data)
    servers.append(server)
    server.start()
    url = server.client_url
    p = ExportPair(tmp_path, agents, ("--seeds", url))
    want = pair_keys(p)
    assert want <= set(etcd_raw(url, ""))
    old_id = etcd_raw(url, "world/").get("world/id", (b"",))[0]
    server.stop()
    shutil.rmtree(data)  # wiped: a new, empty World on the same port
    server.start()
    wait_for(
        lambda: {*want, "world/id"} <= set(etcd_raw(url, "")),
        timeout=20,
        what=f"{sorted(want)} and a new world/id back in the new World",
    )
    now = etcd_raw(url, "")
    assert now["world/id"][0] != old_id
    # under fresh leases: the member record and the export share A's new lease
    assert now["members/hosta"][1] != 0
    assert now[p.key][1] == now["members/hosta"][1]
    assert now["hostkeys/hosta"][1] == 0  # host keys outlive their agent
    # and the export still flows: a change made after the wipe reaches B
    p.export("v2\n")
    p.wait_content("v2\n", timeout=20)
    for a in (p.a, p.b):
        wait_for(logged(a, "the World was replaced"), what="the replacement in the log")
        assert not exited(a)
    assert p.a.stop() == 0
    assert p.b.stop() == 0


@etcd_only
@pytest.mark.slow
def test_etcd_replaced_under_the_same_cluster_id_while_an_agent_is_suspended(
    tmp_path: Path, shm: Path, servers: list[EtcdServer], agents: AgentFactory
) -> None:
    """The new cluster has the same name, peer URL and token (so the same cluster
    id) and a revision already past what the suspended agent saw: only the World's
    id record can tell."""
    client, peer = free_port(), free_port()

    def etcd(data: Path, client_port: int) -> EtcdServer:
        s = EtcdServer(data, client_port=client_port, peer_port=peer, timing=FAST_TIMING)
        servers.append(s)
        return s

    first = etcd(shm / "w0", client)
    first.start()
    url = first.client_url
    p = ExportPair(tmp_path, agents, ("--seeds", url))
    want = pair_keys(p)
    rev = etcd_revision(url)
    os.kill(p.b.proc.pid, signal.SIGSTOP)
    try:
        first.stop()
        making = etcd(shm / "w1", free_port())
        making.start()
        etcd_put_many(making.client_url, rev + 20)  # the new World is further on
        making.stop()
        second = etcd(shm / "w1", client)
        second.start()
        assert etcd_revision(url) > rev
        # A (running) rebuilds: its lease is unknown there, and world/id is gone
        wait_for(
            lambda: {"members/hosta", "hostkeys/hosta", p.key} <= set(etcd_raw(url, "")),
            timeout=20,
            what="A's records in the new World",
        )
    finally:
        os.kill(p.b.proc.pid, signal.SIGCONT)
    wait_for(
        lambda: want <= set(etcd_raw(url, "")),
        timeout=20,
        what=f"{sorted(want)} in the new World",
    )
    wait_for(logged(p.b, "world/id record"), timeout=20, what="B told by the World's id")
    text = p.b.log.read_text()
    assert "the World was replaced" in text, text
    assert not exited(p.a)
    assert not exited(p.b)
    assert p.a.stop() == 0
    assert p.b.stop() == 0


def _remove_world(db: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{db}{suffix}")


def _grant_in_new_world(db: Path) -> int:
    """Another process makes the World anew and takes its first lease (id 1)."""
    code = (
        "import asyncio, sys\n"
        "from evergraph.world.sqlite import SQLiteKV\n"
        "async def main():\n"
        "    kv = SQLiteKV(sys.argv[1])\n"
        "    print(await kv.grant(120.0))\n"
        "    await kv.close()\n"
        "asyncio.run(main())\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(db)], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    return int(r.stdout)


def test_sqlite_world_recreated_the_agent_comes_back_in_members(
    tmp_path: Path, agents: AgentFactory
) -> None:
    """The new World's first lease may have the id the running agent's had:
    keeping it alive must not pass for keeping our own."""
    db, g = tmp_path / "world.sqlite", noop_graph(tmp_path)
    a = agents(g, tmp_path / "sa", "--hostname", "hosta", "--world-db", str(db))
    a.wait_converged()
    got = record(db, "members/hosta")
    assert got is not None
    assert got[1] == 1
    _remove_world(db)
    foreign = _grant_in_new_world(db)

    def back() -> bool:
        m = member(db, "hosta")
        r = record(db, "members/hosta")
        return m is not None and m["pid"] == a.proc.pid and r is not None and r[1] != foreign

    wait_for(back, timeout=15, what="A back in members under a lease of its own")
    wait_for(lambda: record(db, "hostkeys/hosta") is not None, what="A's host keys back")
    b = agents(g, tmp_path / "sb", "--hostname", "hostb", "--world-db", str(db))
    b.wait_converged()
    r = run_cli("members", "--world-db", db)
    assert [ln.split("\t")[0] for ln in r.stdout.splitlines()] == ["hosta", "hostb"]
    wait_for(logged(a, "the World was replaced"), what="the replacement in A's log")
    assert not exited(a)
    assert a.stop() == 0
    assert b.stop() == 0


def test_sqlite_backup_restored_in_place_is_noticed_and_rebuilt(
    tmp_path: Path, agents: AgentFactory
) -> None:
    """Same file, same World id, the revision going back: the exporter finds its
    records rolled back and writes them anew under a fresh lease."""
    db = tmp_path / "world.sqlite"
    p = ExportPair(tmp_path, agents, ("--world-db", str(db)))
    backup = tmp_path / "backup.sqlite"
    with (
        contextlib.closing(sqlite3.connect(db)) as src,
        contextlib.closing(sqlite3.connect(backup)) as dst,
    ):
        src.backup(dst)
    old = record(db, p.key)
    assert old is not None
    p.export("v2\n")
    p.wait_content("v2\n")
    with (
        contextlib.closing(sqlite3.connect(backup)) as src,
        contextlib.closing(sqlite3.connect(db)) as dst,
    ):
        src.backup(dst)  # restored in place: the same file, the old revision

    def rebuilt() -> bool:
        m, r = record(db, "members/hosta"), record(db, p.key)
        return m is not None and r is not None and r[1] == m[1] != old[1] and r[0] != old[0]

    # well before the publisher's periodic check (30 s) would have noticed
    wait_for(rebuilt, timeout=8, what="A's export written anew under a fresh lease")
    wait_for(logged(p.a, "the World was replaced"), what="A noticed the rollback")
    # whoever saw the revision go back first, the other was told by world/id's epoch
    wait_for(
        lambda: any(logged(x, "revision went back")() for x in (p.a, p.b)),
        what="the revision going back in a log",
    )
    p.wait_content("v2\n", timeout=10)
    assert not exited(p.a)
    assert not exited(p.b)
    assert p.a.stop() == 0
    assert p.b.stop() == 0


# -- items 3 and 6: the member record defends itself ---------------------------------------


def _fake_member(host: str, **extra: Any) -> str:
    other = nacl.signing.SigningKey.generate()
    rec = {
        "host": host,
        "address": "203.0.113.9",
        "verify": base64.b64encode(bytes(other.verify_key)).decode(),
        "pid": 4242,
        "started": 1.0,
        **extra,
    }
    return json.dumps(rec)


def _world_put(tmp_path: Path, db: Path, key: str, value: str) -> None:
    r = run_cli("world", "put", "--world-db", db, "--state-dir", tmp_path / "cli", key, value)
    assert r.returncode == 0, r.stderr


def _mine(db: Path, a: Agent, host: str = "web1", signed: bool = True) -> Callable[[], bool]:
    def ok() -> bool:
        m = member(db, host)
        return m is not None and m["pid"] == a.proc.pid and (bool(m.get("signature")) or not signed)

    return ok


def test_a_forged_or_deleted_member_record_is_restored_and_the_agent_runs_on(
    tmp_path: Path, agents: AgentFactory
) -> None:
    db, g = tmp_path / "world.sqlite", noop_graph(tmp_path)
    a = agents(g, tmp_path / "sa", "--hostname", "web1", "--world-db", str(db))
    a.wait_converged()
    assert _mine(db, a, signed=False)()
    own = record(db, "members/web1")
    assert own is not None
    # another agent's key, not signed by it
    _world_put(tmp_path, db, "members/web1", _fake_member("web1"))
    wait_for(logged(a, "a record not signed by the key it names"), what="the alarm")
    wait_for(_mine(db, a), what="the record restored")
    assert "address 203.0.113.9" in a.log.read_text()
    # deleted
    r = run_cli("world", "del", "--world-db", db, "--state-dir", tmp_path / "cli", "members/web1")
    assert r.returncode == 0, r.stderr
    wait_for(logged(a, "the record was deleted"), what="the deletion alarm")
    wait_for(_mine(db, a), what="the record restored after its deletion")
    # an old copy of its own record, put back (a replay)
    _world_put(tmp_path, db, "members/web1", own[0].decode())
    wait_for(logged(a, "an older record of this agent"), what="the replay alarm")
    wait_for(_mine(db, a), what="the record restored after the replay")
    assert not exited(a)
    assert "taken over" not in a.log.read_text()
    assert a.stop() == 0


def test_an_old_signed_record_of_another_agent_put_back_is_no_takeover(
    tmp_path: Path, agents: AgentFactory
) -> None:
    """A genuine record of another agent (signed by its own key, under a live
    lease) that neither names this agent's key as replaced nor started after it
    (a replay of whoever held the hostname before): restored, the agent runs on."""
    import msgspec

    from evergraph.cluster.hostkeys import HostKeys
    from evergraph.cluster.members import Member, sign_member
    from evergraph.world.sqlite import SQLiteKV

    db, g = tmp_path / "world.sqlite", noop_graph(tmp_path)
    a = agents(g, tmp_path / "sa", "--hostname", "web1", "--world-db", str(db))
    a.wait_converged()
    keys = HostKeys(tmp_path / "earlier")
    old = Member(
        host="web1",
        address="203.0.113.7",
        public=keys.public,
        verify=keys.verify,
        started=1.0,
        pid=77,
        timestamp=2.0,
    )

    async def put_back() -> None:
        kv = SQLiteKV(db)
        try:
            lease = await kv.grant(60.0)
            await kv.put("members/web1", msgspec.json.encode(sign_member(old, keys)), lease=lease)
        finally:
            await kv.close()

    asyncio.run(put_back())
    wait_for(logged(a, "did not take this hostname over"), what="the alarm")
    wait_for(_mine(db, a), what="the record restored")
    assert "address 203.0.113.7, pid 77" in a.log.read_text()
    assert not exited(a)
    assert "taken over" not in a.log.read_text()
    assert a.stop() == 0


def test_a_forged_member_record_present_at_start_is_no_claim(
    tmp_path: Path, agents: AgentFactory
) -> None:
    db, g = tmp_path / "world.sqlite", noop_graph(tmp_path)
    a = agents(g, tmp_path / "sa", "--hostname", "other", "--world-db", str(db))
    a.wait_converged()  # makes the World
    _world_put(tmp_path, db, "members/web1", _fake_member("web1"))
    b = agents(g, tmp_path / "sb", "--hostname", "web1", "--world-db", str(db))
    b.wait_converged()
    assert _mine(db, b)()
    wait_for(logged(b, "not a claim"), what="B's alarm")  # (its log is flushed every 0.1 s)
    # a real second agent is still refused
    r = run_cli("run", g, "--state-dir", tmp_path / "sc", "--hostname", "web1", "--world-db", db)
    assert r.returncode == 2, r.stderr
    assert "is held by another live agent" in r.stderr
    assert _mine(db, b)()
    assert b.stop() == 0
    assert a.stop() == 0


def test_replace_is_logged_on_both_sides(tmp_path: Path, agents: AgentFactory) -> None:
    db, g = tmp_path / "world.sqlite", noop_graph(tmp_path)
    a = agents(g, tmp_path / "sa", "--hostname", "web1", "--world-db", str(db))
    a.wait_converged()
    b = agents(g, tmp_path / "sb", "--hostname", "web1", "--world-db", str(db), "--replace")
    b.wait_converged()
    wait_for(lambda: exited(a), what="the replaced agent exited")
    assert a.proc.returncode == 0, a.log.read_text()
    wait_for(logged(b, "taking hostname"), what="B's log of the takeover")
    assert "was taken over by another agent (address " in a.log.read_text()
    assert f"pid {b.proc.pid}," in a.log.read_text()
    assert "taking hostname 'web1' over (--replace) from another agent" in b.log.read_text()
    assert f"pid {a.proc.pid}," in b.log.read_text()
    now = member(db, "web1")
    assert now is not None
    assert now["pid"] == b.proc.pid
    assert now["replaces"] != ""
    assert now["replaces"] != now["verify"]
    assert b.stop() == 0


# -- item 10: members carry capabilities and groups --------------------------------------


def test_members_show_a_workers_capabilities_and_groups(
    tmp_path: Path, agents: AgentFactory
) -> None:
    db, g = tmp_path / "world.sqlite", noop_graph(tmp_path)
    keys = tmp_path / "home" / "authorized_keys"
    w = agents(
        g,
        tmp_path / "sw",
        "--hostname",
        "wk1",
        "--world-db",
        str(db),
        "--worker",
        "--cap",
        "board=rpi4",
        "--group",
        "lab",
        "--authorized-keys",
        str(keys),
    )
    p = agents(g, tmp_path / "sp", "--hostname", "plain", "--world-db", str(db))
    w.wait_converged()
    p.wait_converged()
    r = run_cli("members", "--world-db", db)
    assert r.returncode == 0, r.stderr
    rows = {ln.split("\t")[0]: ln.split("\t") for ln in r.stdout.splitlines()}
    assert rows["plain"][3] == "-"
    assert rows["plain"][5] == "-"
    assert rows["wk1"][3] == "lab"
    assert "board=rpi4" in rows["wk1"][5].split(",")
    assert "hostname=wk1" in rows["wk1"][5].split(",")
    r = run_cli("members", "--json", "--world-db", db)
    by_host = {m["host"]: m for m in map(json.loads, r.stdout.splitlines())}
    assert by_host["wk1"]["capabilities"]["board"] == "rpi4"
    assert by_host["wk1"]["groups"] == ["lab"]
    assert query(db, "SELECT 1 FROM kv WHERE key = 'world/id'")
    assert w.stop() == 0
    assert p.stop() == 0


# -- scheduler volunteers in a replaced World ---------------------------------------------


def test_a_volunteer_never_keeps_a_lease_of_another_world(tmp_path: Path) -> None:
    """`world.sqlite` recreated, its first leases taken by another process (the ids
    the volunteer had): the volunteer writes its record again under a lease of
    its own, and does not keep the other process's leases alive."""
    from evergraph.cluster.scheduler import Options, Volunteer, volunteer_key
    from evergraph.world.sqlite import SQLiteKV

    db = tmp_path / "world.sqlite"

    async def body() -> None:
        kv = SQLiteKV(db)
        vol = Volunteer(kv, "web", "h1", Options(ttl=2))
        task = asyncio.create_task(vol.run())
        try:
            async with asyncio.timeout(10):
                await vol.volunteered.wait()
            _remove_world(db)
            other = SQLiteKV(db)  # the new World
            try:
                foreign = {await other.grant(2.0) for _ in range(4)}
                assert vol.lease in foreign  # the same id, in another World

                async def mine() -> bool:
                    item = await other.get(volunteer_key("web", "h1"))
                    return item is not None and item.lease not in foreign

                async with asyncio.timeout(10):
                    while not await mine():
                        await asyncio.sleep(0.05)
                assert vol.lease not in foreign
                # the other process's leases expire: nobody keeps them alive for it
                async with asyncio.timeout(10):
                    while True:
                        rows = {r[0] for r in sqlite3.connect(db).execute("SELECT id FROM leases")}
                        if not rows & foreign:
                            break
                        await other.get("x")  # sweeps what expired
                        await asyncio.sleep(0.2)
                assert await mine()
            finally:
                await other.close()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await vol.leave(withdraw=False)
            await kv.close()

    asyncio.run(body())


@etcd_only
@pytest.mark.slow
def test_etcd_wiped_under_a_running_farm_its_worker_is_served_again(
    tmp_path: Path, shm: Path, servers: list[EtcdServer], agents: AgentFactory
) -> None:
    """The farm after a wiped World: the worker's record and alive key come back
    (signed, as it last trusted them), the API server lists it again, and a new
    request is matched to it."""
    from evergraph.farm import model
    from evergraph.farm.tokens import User
    from tests.conftest import host_key
    from tests.kit.farm import farm_call, worker_uuid

    admin = User(name="root", admin=True)
    data = shm / "etcd"
    server = EtcdServer.single(data)
    servers.append(server)
    server.start()
    url = server.client_url
    world = ("--seeds", url)
    g = noop_graph(tmp_path)
    srv = agents(g, tmp_path / "srv", "--hostname", "srv", *world, "--http", "127.0.0.1:0")
    wk = agents(
        g,
        tmp_path / "wk1",
        *("--hostname", "wk1", *world, "--worker"),
        *("--farm-server", f"srv={host_key(tmp_path / 'srv')}"),
    )
    srv.wait_converged()
    wk.wait_converged()
    uuid = worker_uuid(tmp_path / "wk1")
    db = tmp_path / "world.sqlite"  # (farm_call names srv's state dir beside it)

    def call(fn: Callable[[Any], Any]) -> Any:
        return farm_call(db, fn, lambda: EtcdKV([url]))

    def state() -> str:
        try:
            return str(call(lambda f: f.worker(uuid)).state)
        except Exception:  # not (yet) there, or the World down: ask again
            return ""

    wait_for(lambda: state() == model.MAINTENANCE, timeout=20, what="the worker registered")
    call(lambda f: f.set_state(admin, uuid, model.IDLE))
    wait_for(lambda: state() == model.IDLE, timeout=20, what="the worker IDLE")
    server.stop()
    shutil.rmtree(data)  # wiped: a new, empty World on the same port
    server.start()
    wait_for(lambda: state() == model.IDLE, timeout=30, what="the worker listed again, IDLE")
    wait_for(
        lambda: f"farm/alive/{uuid}" in etcd_raw(url, "farm/alive/"),
        timeout=20,
        what="its alive key back, under a lease of the new World",
    )
    rid = call(lambda f: f.new_request(admin, priority=1))
    wait_for(
        lambda: call(lambda f: f.request(admin, rid)).state == model.IN_PROGRESS,
        timeout=20,
        what="a new request matched to the worker",
    )
    for a in (srv, wk):
        assert not exited(a)
    assert wk.stop() == 0
    assert srv.stop() == 0
