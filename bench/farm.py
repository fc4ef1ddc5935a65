"""Benchmark: the farm (issue 12).

1. Matching over a real etcd (single member on /dev/shm): 50 workers simulated as
   World clients in this process, one elected matcher (`FarmLeader`). Throughput:
   20 simulated users in a closed loop (create a request, wait until it is IN
   PROGRESS, close it) for N/2 requests, saturating the farm. Latency: the other
   N/2 requests arrive at RATE per second (below capacity, as a live farm runs),
   each closed once started; request -> IN PROGRESS p50/p99 (target p99 <= 100 ms).
2. Leader failover: the leading matcher dies (its tasks cancelled, its lease
   revoked, as a crashed agent's would be after its TTL); the time until a waiting
   request is matched by the next leader.
3. HTTP: one agent with `--http` on a sqlite World; sequential create
   (`POST /api/v1/reqs/`) and list (`POST /api/v1/reqs/list`) requests per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import (
    EVERGRAPH,
    fmt_s,
    percentile,
    spawn,
    stop,
    table,
    temp_dir_until_exit,
    yes_no,
)

TARGET_MATCH_P99_S = 0.100
USERS = 20
WORKERS = 50
#: new requests per second in the latency phase
RATE = 50


async def _matching(kv_factory: Any, n: int) -> dict[str, Any]:
    import tempfile
    from pathlib import Path

    from evergraph.cluster.election import Election, election_key
    from evergraph.cluster.hostkeys import HostKeys
    from evergraph.farm import model
    from evergraph.farm.leader import FarmLeader
    from evergraph.farm.service import ALIVE, Farm, encode, worker_key
    from evergraph.farm.signed import FarmTrust
    from evergraph.farm.tokens import User

    # the farm servers (candidates, the users' API server) pin one another's key
    keys = HostKeys(Path(tempfile.mkdtemp(prefix="farm-bench-")))
    servers = dict.fromkeys(("m0", "m1", "api"), keys.verify)
    kv = kv_factory()
    farm = Farm(kv, trust=FarmTrust(keys, "api", servers))
    for i in range(WORKERS):
        uuid = f"00000000-0000-4000-8000-{i:012d}"
        w = model.register_worker(
            uuid=uuid, caps={"slot": str(i)}, address="127.0.0.1", port=22, username="t", now=0
        )
        idle = encode(model.complete_prepare(model.set_state(w, "IDLE")))
        await kv.put(worker_key(uuid), farm.trust.seal(worker_key(uuid), idle))
        await kv.put(f"{ALIVE}{uuid}", b"1")
    tasks: dict[str, list[asyncio.Task[Any]]] = {}
    clients = []

    def candidate(name: str) -> None:
        ckv = kv_factory()
        clients.append(ckv)
        e = Election(ckv, "farm", name, ttl=5.0)
        leader = FarmLeader(ckv, e, FarmTrust(keys, name, servers))
        tasks[name] = [asyncio.create_task(e.run()), asyncio.create_task(leader.run())]

    candidate("m0")
    candidate("m1")
    user = User(name="bench")
    latencies: list[float] = []
    left = [n]

    async def one_user() -> None:
        ukv = kv_factory()
        clients.append(ukv)
        ufarm = Farm(ukv, trust=farm.trust)
        while left[0] > 0:
            left[0] -= 1
            t0 = time.perf_counter()
            rid = await ufarm.new_request(user, priority=8)
            req = await ufarm.wait_started(user, rid, 30)
            latencies.append(time.perf_counter() - t0)
            assert req.state == model.IN_PROGRESS, req.state
            await ufarm.close_request(user, rid)

    # throughput: saturated, USERS users in a closed loop
    left[0] = n // 2
    started = time.perf_counter()
    await asyncio.gather(*(one_user() for _ in range(USERS)))
    took = time.perf_counter() - started
    throughput = (n // 2) / took
    # latency: open loop, one new request every 1/RATE s (below capacity)
    latencies.clear()

    async def one_request() -> None:
        t0 = time.perf_counter()
        rid = await farm.new_request(user, priority=8)
        req = await farm.wait_started(user, rid, 30)
        latencies.append(time.perf_counter() - t0)
        assert req.state == model.IN_PROGRESS, req.state
        await farm.close_request(user, rid)

    async with asyncio.TaskGroup() as tg:
        for _ in range(n - n // 2):
            tg.create_task(one_request())
            await asyncio.sleep(1 / RATE)  # the arrival process being measured

    # failover: kill the leader, then time one request until it is matched
    item = await kv.get(election_key("farm"))
    assert item is not None
    leader = item.value.decode()
    t0 = time.perf_counter()
    for t in tasks.pop(leader):
        t.cancel()
    await kv.revoke(item.lease)
    rid = await farm.new_request(user, priority=1)
    req = await farm.wait_started(user, rid, 30)
    failover = time.perf_counter() - t0
    assert req.state == model.IN_PROGRESS
    for ts in tasks.values():
        for t in ts:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
    for c in clients:
        await c.close()
    await kv.close()
    return {
        "requests": n,
        "matched_per_s": throughput,
        "p50": percentile(latencies, 50),
        "p99": percentile(latencies, 99),
        "failover_s": failover,
    }


def _http(quick: bool) -> dict[str, Any]:
    d = temp_dir_until_exit("/var/tmp")
    g = d / "g.yaml"
    g.write_text("graph: g\nresources:\n  noop:\n  - name: n\n")
    db = d / "world.sqlite"
    log = d / "srv.log"
    agent = spawn(
        [
            EVERGRAPH,
            "run",
            str(g),
            "--state-dir",
            str(d / "srv"),
            "--world-db",
            str(db),
            "--hostname",
            "srv",
            "--http",
            "127.0.0.1:0",
        ],
        stdout=open(log, "wb"),  # noqa: SIM115
        stderr=-2,
    )
    try:
        import subprocess

        token = subprocess.run(
            [
                EVERGRAPH,
                "farm",
                "token",
                "create",
                "bench",
                "--world-db",
                str(db),
                "--state-dir",
                str(d / "srv"),  # signed by the API server's key: the one it trusts
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        deadline = time.monotonic() + 30
        url = None
        while url is None and time.monotonic() < deadline:
            m = re.search(r"HTTP API on (http://\S+)", log.read_text())
            url = m[1] if m else None
            time.sleep(0.05)
        assert url, "the agent never listened"
        from evergraph.http.client import FarmClient

        n = 100 if quick else 500
        with FarmClient(url, token) as c:
            t0 = time.perf_counter()
            for _ in range(n):
                c.new_request(8)
            create = n / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(n):
                c.requests()
            listing = n / (time.perf_counter() - t0)
        return {"n": n, "create_per_s": create, "list_per_s": listing, "list_size": n}
    finally:
        stop(agent)


def run(quick: bool) -> tuple[dict[str, Any], str]:
    res: dict[str, Any] = {}
    rows = []
    if shutil.which("etcd"):
        from evergraph.world.etcd import EtcdKV
        from evergraph.world.etcd_server import EtcdServer

        server = EtcdServer.single(Path(temp_dir_until_exit("/dev/shm")))
        server.start()
        try:
            url = server.client_url
            m = asyncio.run(_matching(lambda: EtcdKV([url]), 200 if quick else 1000))
        finally:
            server.stop()
        res["matching_etcd"] = m
        rows.append(
            [
                "etcd",
                f"{m['requests']:,}",
                str(WORKERS),
                f"{m['matched_per_s']:,.0f}",
                fmt_s(m["p50"]),
                fmt_s(m["p99"]),
                fmt_s(TARGET_MATCH_P99_S),
                yes_no(m["p99"] <= TARGET_MATCH_P99_S),
                fmt_s(m["failover_s"]),
            ]
        )
    text = table(
        f"Farm matching on {WORKERS} workers, one elected matcher: matched/s saturated by "
        f"{USERS} users in a closed loop; latency create -> IN PROGRESS at {RATE} "
        "requests/s; failover = leader killed -> next request matched",
        [
            "world",
            "requests",
            "workers",
            "matched/s",
            "p50",
            "p99",
            "target p99",
            "met",
            "failover",
        ],
        rows,
    )
    h = _http(quick)
    res["http"] = h
    text += "\n\n" + table(
        "Farm HTTP API (one agent, sqlite World, sequential, one client)",
        ["route", "requests", "per second"],
        [
            ["POST /api/v1/reqs/ (create)", str(h["n"]), f"{h['create_per_s']:,.0f}"],
            [
                f"POST /api/v1/reqs/list ({h['list_size']} items)",
                str(h["n"]),
                f"{h['list_per_s']:,.0f}",
            ],
        ],
    )
    return res, text
