"""The etcd World beyond the shared contract: restarts, compaction on resume,
failover in a 3-member cluster, TLS, auth, and the errors users see.

Every test runs real etcd processes (Debian's etcd-server) with data on
/dev/shm; each server is stopped by PID in a finalizer, also on failure.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aetcd import rpc

from evergraph.world._etcd_link import _grpc_status_tasks, _prefix_range
from evergraph.world.etcd import EtcdKV
from evergraph.world.etcd_server import FAST_TIMING, EtcdServer, ServerTLS, free_port
from evergraph.world.kv import Compacted, Event, WorldError
from tests.conftest import wait_for
from tests.kit.machine import MACHINE_WIDE
from tests.kit.pki import make_pki

pytestmark = [
    MACHINE_WIDE,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server not installed"),
]


def run(body: Callable[[], Awaitable[None]], timeout: float = 60) -> None:
    async def main() -> None:
        await asyncio.wait_for(body(), timeout)

    asyncio.run(main())


async def next_batch(it: AsyncIterator[list[Event]], timeout: float = 10) -> list[Event]:
    return await asyncio.wait_for(it.__anext__(), timeout)


async def async_wait_for(pred: Callable[[], bool], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def one_line_without_grpc_internals(msg: str) -> bool:
    internals = ("grpc", "ipv4:", "debug_error_string", "Traceback", "SSL_ERROR", "StatusCode")
    return "\n" not in msg and not any(w in msg for w in internals)


# -- pure -----------------------------------------------------------------------------
def test_prefix_range_covers_exactly_the_prefix() -> None:
    assert _prefix_range("a/") == (b"a/", b"a0")
    assert _prefix_range("") == (b"\0", b"\0")  # every key
    assert _prefix_range("\U0010ffff") == (b"\xf4\x8f\xbf\xbf", b"\xf4\x8f\xbf\xc0")


def test_bad_endpoints_and_options_are_refused_at_once(tmp_path: Path) -> None:
    async def body() -> None:
        with pytest.raises(WorldError, match="bad etcd endpoint 'ftp://h:1'"):
            EtcdKV(["ftp://h:1"])
        with pytest.raises(WorldError, match="needs both cert and key"):
            EtcdKV(["https://h:1"], cert=tmp_path / "c.pem")
        with pytest.raises(WorldError, match=r"cannot read the etcd CA certificate .*nope"):
            EtcdKV(["https://h:1"], ca=tmp_path / "nope")

    run(body)


def test_replacement_is_judged_against_what_was_seen_before_the_call() -> None:
    """Answers' headers (real protobuf headers, no server needed): concurrent calls
    may answer out of order, so only a revision lower than what was seen before a
    call started means a replaced World; answers to calls of an older epoch
    (the old World's) count for nothing."""

    async def body() -> None:
        kv = EtcdKV(["http://127.0.0.1:1"])
        ep = kv._endpoints[0]

        def header(cluster_id: int, revision: int) -> Any:
            return rpc.ResponseHeader(cluster_id=cluster_id, revision=revision)

        assert (kv.world_id, kv.epoch) == ("", 0)
        kv._observe(ep, header(0xAB, 10), 0, 0)
        assert (kv.world_id, kv.epoch) == ("ab", 0)
        kv._observe(ep, header(0xAB, 9), 0, 0)  # asked before revision 10 was seen
        kv._observe(ep, header(0xAB, 9), 10, 0, revision=False)  # not linearizable
        assert kv.epoch == 0
        kv._observe(ep, header(0xAB, 3), 10, 0)  # asked after: the World went back
        assert (kv.world_id, kv.epoch) == ("ab", 1)
        kv._observe(ep, header(0xCD, 50), 3, 0)  # an answer from before that: ignored
        assert (kv.world_id, kv.epoch) == ("ab", 1)
        kv._observe(ep, header(0xCD, 50), 3, 1)  # another cluster now
        assert (kv.world_id, kv.epoch) == ("cd", 2)
        assert kv._why == f"etcd at {ep.url}: cluster id ab -> cd"
        await kv.close()

    run(body)


# -- unreachable, and the server's own errors ------------------------------------------
def test_unreachable_endpoints_fail_fast_with_one_line() -> None:
    p1, p2 = free_port(), free_port()  # nothing listens there

    async def body() -> None:
        one = EtcdKV([f"http://127.0.0.1:{p1}"], timeout=0.5)
        t0 = time.monotonic()
        with pytest.raises(WorldError) as e:
            await one.get("k")
        assert time.monotonic() - t0 < 3
        assert str(e.value) == f"etcd at http://127.0.0.1:{p1} is not reachable: connection refused"
        await one.close()
        two = EtcdKV([f"127.0.0.1:{p1}", f"http://127.0.0.1:{p2}"], timeout=0.5)
        with pytest.raises(WorldError) as e:
            await two.put("k", b"v")
        assert str(e.value) == (
            f"etcd is not reachable at any endpoint: http://127.0.0.1:{p1}: connection refused;"
            f" http://127.0.0.1:{p2}: connection refused"
        )
        await two.close()
        with pytest.raises(WorldError, match="connection is closed"):
            await two.get("k")

    run(body)


class _Unanswered:
    """A loopback port whose TCP connects never complete: it listens with a full
    accept queue and never accepts, so the kernel drops further SYNs (what an
    overloaded host, or a firewall that drops, looks like to a client)."""

    def __init__(self) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(0)
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self.queued: list[socket.socket] = []
        for _ in range(3):  # fill the queue (0 means 1 on Linux)
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(self.srv.getsockname())
            self.queued.append(c)

    def close(self) -> None:
        for c in self.queued:
            c.close()
        self.srv.close()


def test_a_connect_that_times_out_is_retried_and_not_called_tls(
    shm: Path, servers: list[EtcdServer]
) -> None:
    """grpc's "tcp handshaker shutdown" (the connect ran out of time: 100 agents starting
    on 2 cores) was taken for a TLS failure: fatal at once, so agents exited at start
    instead of trying again or another member."""
    dead = _Unanswered()
    server = EtcdServer.single(shm / "e")
    servers.append(server)
    server.start()

    async def body() -> None:
        alone = EtcdKV([dead.url], timeout=1.0)
        with pytest.raises(WorldError) as e:
            await alone.get("k")
        assert str(e.value) == (
            f"etcd at {dead.url} is not reachable: no connection in time"
            " (a busy host, or a port that drops connections)"
        )
        await alone.close()
        # with a member that answers, the client gets there, whichever it tries first
        for first in (0, 1):
            kv = EtcdKV([dead.url, server.client_url], timeout=10.0)
            kv._current = first
            await kv.put("k", b"v")
            got = await kv.get("k")
            assert got is not None
            assert got.value == b"v"
            await kv.close()

    try:
        run(body)
    finally:
        dead.close()


def test_server_start_errors_say_what_is_wrong(shm: Path, servers: list[EtcdServer]) -> None:
    missing = EtcdServer(shm / "a", binary="etcd-is-not-here")
    with pytest.raises(WorldError, match=r"^etcd is not installed: apt-get install etcd-server$"):
        missing.start()

    with socket.socket() as taken:  # another service owns the client port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = EtcdServer(shm / "b", client_port=port, peer_port=free_port())
        servers.append(busy)
        with pytest.raises(WorldError, match=f"client port 127.0.0.1:{port} is already in use"):
            busy.start()

    # free when checked, but etcd binds it twice: the error comes from etcd's log
    p = free_port()
    twice = EtcdServer(shm / "c", client_port=p, peer_port=p)
    servers.append(twice)
    with pytest.raises(WorldError, match=f"port 127.0.0.1:{p} is already in use"):
        twice.start()

    # etcd exits at once: its last log lines are in the message
    bad = EtcdServer.single(shm / "d", tls=ServerTLS(shm / "no.pem", shm / "no-key.pem", shm))
    servers.append(bad)
    with pytest.raises(WorldError) as e:
        bad.start()
    assert str(e.value).startswith("etcd default exited with status")
    assert f"open {shm}/no.pem: no such file or directory" in str(e.value)
    assert not bad.running


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (this sandbox's init does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_etcd_exits_when_the_process_that_started_it_dies(shm: Path) -> None:
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from evergraph.world.etcd_server import EtcdServer\n"
        f"s = EtcdServer.single(Path({str(shm / 'data')!r}))\n"
        "s.start()\n"
        "print(s.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    pid = 0
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    ) as agent:
        try:
            assert agent.stdout is not None
            pid = int(agent.stdout.readline())
            assert not _exited(pid)
            agent.kill()  # a crash: no chance to stop etcd itself
            agent.wait()
            wait_for(lambda: _exited(pid), 10, "etcd to exit after its parent died")
        finally:
            agent.kill()
            if pid and not _exited(pid):
                os.kill(pid, signal.SIGKILL)


def test_embedded_keeps_its_data_across_restarts(shm: Path, servers: list[EtcdServer]) -> None:
    assert (EtcdServer.embedded(shm).client_port, EtcdServer.embedded(shm).peer_port) == (
        2379,
        2380,
    )
    server = EtcdServer.embedded(shm / "etcd", client_port=free_port(), peer_port=free_port())
    servers.append(server)
    server.start()

    async def put() -> None:
        async with EtcdKV([server.client_url]) as kv:
            await kv.put("kept", b"yes")

    async def get() -> None:
        async with EtcdKV([server.client_url]) as kv:
            got = await kv.get("kept")
            assert got is not None
            assert got.value == b"yes"

    run(put)
    server.stop()
    assert not server.running
    server.start()
    run(get)


# -- watch supervision -------------------------------------------------------------------
def test_watch_survives_a_server_restart(
    shm: Path, servers: list[EtcdServer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="evergraph.world")
    server = EtcdServer.single(shm / "data")
    servers.append(server)
    server.start()

    def logged(text: str) -> Callable[[], bool]:
        return lambda: any(text in r.getMessage() for r in caplog.records)

    async def take(it: AsyncIterator[list[Event]], n: int) -> list[list[Event]]:
        return [await next_batch(it, 30) for _ in range(n)]

    async def body() -> None:
        async with EtcdKV([server.client_url]) as a, EtcdKV([server.client_url]) as b:
            r0 = await a.put("other", b"x")
            it = b.watch("r/", r0 + 1)
            await a.put("r/1", b"1")
            assert [e.key for e in await next_batch(it)] == ["r/1"]
            r2 = await a.put("r/2", b"2")  # written, not yet taken from the watch
            pid = server.pid
            server.stop()
            # the watcher notices, and keeps trying while the server is down
            batches = asyncio.ensure_future(take(it, 3))
            await async_wait_for(logged("world: watch of 'r/' lost at"))
            server.start()  # same data dir, same ports
            assert server.pid != pid
            r3 = await a.put("r/3", b"3")  # the writer reconnects as well
            await a.delete_prefix("r/")
            got = await batches
            assert [[(e.type, e.key) for e in batch] for batch in got] == [
                [("put", "r/2")],
                [("put", "r/3")],
                [("delete", "r/1"), ("delete", "r/2"), ("delete", "r/3")],
            ]
            assert [got[0][0].revision, got[1][0].revision] == [r2, r3]
            assert logged("world: watch of 'r/' resumed at")()
            # and nothing twice: the next batch is the next write
            r5 = await a.put("r/end", b"")
            assert [(e.key, e.revision) for e in await next_batch(it)] == [("r/end", r5)]

    run(body)


def test_watch_resuming_at_a_compacted_revision_raises(
    shm: Path, servers: list[EtcdServer]
) -> None:
    server = EtcdServer.single(shm / "data")
    servers.append(server)
    server.start()

    async def body() -> None:
        async with EtcdKV([server.client_url]) as a, EtcdKV([server.client_url]) as b:
            r1 = await a.put("c/1", b"1")
            it = b.watch("c/", r1)
            assert [e.key for e in await next_batch(it)] == ["c/1"]
            server.stop()  # the stream breaks while the watcher waits at r1 + 1
            server.start()
            await a.put("c/2", b"2")
            r3 = await a.put("c/3", b"3")
            await a.compact(r3)
            with pytest.raises(Compacted) as e:
                await next_batch(it)
            assert e.value.revision == r1 + 1
            assert e.value.compact_revision == r3 - 1  # history now starts at r3
            # a fresh watch from the compaction point works
            assert [e.key for e in await next_batch(b.watch("c/", r3))] == ["c/3"]

    run(body)


def test_closing_leaves_no_grpc_work_for_the_next_event_loop(
    shm: Path, servers: list[EtcdServer]
) -> None:
    # gRPC finishes cancelled calls a moment later; if asyncio.run ended first, the
    # next loop would get their completions ("Event loop is closed")
    server = EtcdServer.single(shm / "data")
    servers.append(server)
    server.start()

    async def body() -> None:
        kv = EtcdKV([server.client_url])
        rev = await kv.put("k", b"1")
        dropped = kv.watch("k", rev)
        await next_batch(dropped)
        del dropped  # asyncio closes the generator in a task: its call is cancelled
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await next_batch(kv.watch("k", rev))  # left open: close() cancels it
        await kv.close()
        assert _grpc_status_tasks() == 0

    run(body)


@pytest.mark.slow
def test_cluster_keeps_working_when_its_leader_dies(shm: Path, servers: list[EtcdServer]) -> None:
    members = EtcdServer.cluster(3, shm)
    servers.extend(members)
    EtcdServer.start_all(members)
    found: list[EtcdServer] = []  # the leader as seen when it was found (it may move)
    wait_for(lambda: found.extend(m for m in members if m.is_leader()) or found, what="a leader")
    leader = found[0]
    survivors = [m for m in members if m is not leader]
    # the leader first: both clients talk to it until it dies
    urls = [leader.client_url] + [m.client_url for m in survivors]

    async def body() -> None:
        async with EtcdKV(urls) as a, EtcdKV(urls) as b:
            r0 = await a.put("c/0", b"0")
            it = b.watch("c/", r0)
            assert [e.key for e in await next_batch(it)] == ["c/0"]
            leader.kill()
            revs = [await a.put(f"c/{i}", str(i).encode()) for i in range(1, 6)]
            got = [await next_batch(it) for _ in range(5)]
            assert [(e.key, e.revision) for batch in got for e in batch] == [
                (f"c/{i}", rev) for i, rev in zip(range(1, 6), revs, strict=True)
            ]
            kv = await b.get("c/5")
            assert kv is not None
            assert await b.cas("c/5", b"x", expect=kv.mod_revision) is True
            lease = await b.grant(5)
            await b.keepalive(lease)

    run(body)
    wait_for(lambda: any(m.is_leader() for m in survivors), what="a new leader")


# -- TLS and auth ------------------------------------------------------------------------
def test_tls_only_etcd_needs_our_ca_and_a_client_certificate(
    shm: Path, servers: list[EtcdServer]
) -> None:
    pki = make_pki(shm / "pki")
    other = make_pki(shm / "other", "someone else's CA")
    tls = ServerTLS(pki / "server.pem", pki / "server-key.pem", pki / "ca.pem", True)
    server = EtcdServer.single(shm / "data", tls=tls)
    servers.append(server)
    server.start()
    url = server.client_url
    assert url.startswith("https://127.0.0.1:")
    client = {"cert": pki / "client.pem", "key": pki / "client-key.pem"}

    async def refused(kv: EtcdKV, *expected: str) -> None:
        with pytest.raises(WorldError) as e:
            await kv.get("t")
        msg = str(e.value)
        assert one_line_without_grpc_internals(msg), msg
        for text in expected:
            assert text in msg
        # a watch gives up too, rather than retrying a TLS failure forever
        with pytest.raises(WorldError):
            await next_batch(kv.watch("t", 1))
        await kv.close()

    async def body() -> None:
        async with EtcdKV([url], ca=pki / "ca.pem", **client) as good:
            rev = await good.put("t", b"1")
            it = good.watch("t", rev)
            assert [e.value for e in await next_batch(it)] == [b"1"]
        not_trusted = (
            f"etcd at {url} is not reachable: TLS handshake failed:"
            " the server's certificate is not trusted (is the CA given with --etcd-ca"
        )
        await refused(EtcdKV([url], timeout=1, **client), not_trusted)
        await refused(EtcdKV([url], ca=other / "ca.pem", timeout=1, **client), not_trusted)
        await refused(
            EtcdKV([url], ca=pki / "ca.pem", timeout=1),
            "TLS handshake failed: the server refused our client certificate",
            "--etcd-cert",
        )
        plain = EtcdKV([url.replace("https:", "http:")], timeout=0.5)
        with pytest.raises(WorldError, match=r"does it only speak TLS\? then use https://"):
            await plain.get("t")
        await plain.close()

    run(body)


@pytest.mark.slow
def test_user_and_password_and_an_expiring_token(shm: Path, servers: list[EtcdServer]) -> None:
    # tokens expire after 1 s unused; a cheap bcrypt keeps `user add` fast
    server = EtcdServer(
        shm / "data", timing=FAST_TIMING, extra_args=["--auth-token-ttl=1", "--bcrypt-cost=4"]
    )
    servers.append(server)
    server.start()
    ctl = ["etcdctl", f"--endpoints={server.client_url}"]
    for args in (
        ["user", "add", "root", "--new-user-password=s3cret", "--interactive=false"],
        ["user", "grant-role", "root", "root"],
        ["auth", "enable"],
    ):
        r = subprocess.run(
            ctl + args, capture_output=True, text=True, env={"ETCDCTL_API": "3"}, timeout=30
        )
        assert r.returncode == 0, r.stderr

    async def body() -> None:
        url = server.client_url
        anonymous = EtcdKV([url], timeout=1)
        with pytest.raises(WorldError) as e:
            await anonymous.put("k", b"v")
        assert str(e.value) == (
            f"etcd at {url} refused to put 'k': user name is empty"
            " (auth is enabled: give --etcd-user and --etcd-password)"
        )
        await anonymous.close()
        wrong = EtcdKV([url], user="root", password="guess", timeout=1)
        with pytest.raises(WorldError) as e:
            await wrong.get("k")
        assert str(e.value) == (
            f"etcd at {url} refused to let user 'root' in: authentication failed,"
            " invalid user ID or password (check --etcd-user/--etcd-password)"
        )
        await wrong.close()
        async with EtcdKV([url], user="root", password="s3cret") as kv:
            rev = await kv.put("k", b"1")
            it = kv.watch("k", rev)
            assert [e.value for e in await next_batch(it)] == [b"1"]
            # what is under test is the token's expiry: nothing to observe but time
            await asyncio.sleep(2.5)
            await kv.put("k", b"2")  # a new token, transparently
            assert [e.value for e in await next_batch(it)] == [b"2"]

    run(body)


def test_clients_start_at_a_random_member_of_their_seeds() -> None:
    """Agents given the same seeds spread over the members (etcd's clients balance
    so); before, every one connected to the first seed and loaded it alone."""
    ports = [free_port() for _ in range(3)]

    async def body() -> None:
        firsts = set()
        for _ in range(40):
            kv = EtcdKV([f"http://127.0.0.1:{p}" for p in ports], timeout=0.5)
            firsts.add(kv._endpoint().url)
            await kv.close()
        assert len(firsts) > 1  # all 40 on one member: (1/3)^39 by chance

    run(body)
