"""Benchmark: farm failover with real agents (issue 22).

Three agents serve the farm (`--http`, so each is a candidate for the `farm`
election) and one is a worker, on one sqlite World. Each trial kills the leading
agent with SIGKILL (no clean stop: its election lease must expire), creates a
request at once and times it until the next leader has matched it (IN PROGRESS),
then closes it and restarts the killed agent (`--replace`) for the next trial.
Reported: kill -> assignment, and leader key gone (its lease expired, as this
process's World client sees it) -> assignment, p50/p99 over the trials.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import EVERGRAPH, fmt_s, percentile, spawn, stop, table, temp_dir_until_exit

TRIALS = 20
#: the election lease (`--farm-election-ttl`): failover cannot beat it (the
#: environment's EVERGRAPH_BENCH_FAILOVER_TTL, e.g. 10 for the default's figures)
TTL = float(os.environ.get("EVERGRAPH_BENCH_FAILOVER_TTL", "3"))
SERVERS = ("m0", "m1", "m2")


class _Farm:
    def __init__(self, d: Path) -> None:
        self.d = d
        self.db = d / "world.sqlite"
        self.graph = d / "g.yaml"
        self.graph.write_text("graph: g\nresources:\n  noop:\n  - name: n\n")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *extra: str) -> None:
        status = self.d / f"{name}.status"
        status.unlink(missing_ok=True)
        log = open(self.d / f"{name}.log", "ab")  # noqa: SIM115
        self.procs[name] = spawn(
            [
                EVERGRAPH,
                "run",
                str(self.graph),
                "--state-dir",
                str(self.d / name),
                "--world-db",
                str(self.db),
                "--hostname",
                name,
                "--converged-timeout",
                "0.1",
                "--converged-status-file",
                str(status),
                *extra,
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        log.close()

    def identity(self, name: str) -> str:
        """`name`'s host key (`PUBLIC:VERIFY`), made in its state dir if none yet."""
        from evergraph.cluster.hostkeys import HostKeys, identity

        keys = HostKeys(self.d / name)
        return identity(keys.public, keys.verify)

    def pins(self, *names: str) -> list[str]:
        """`--farm-server NAME=KEY` for each of `names` (the farm's records are signed:
        servers pin each other, the worker pins them all)."""
        return [a for n in names for a in ("--farm-server", f"{n}={self.identity(n)}")]

    def server(self, name: str) -> None:
        others = self.pins(*(n for n in SERVERS if n != name))
        flags = ("--http", "127.0.0.1:0", "--farm-election-ttl", str(TTL), "--replace")
        self.start(name, *flags, *others)

    def wait_up(self, name: str, timeout: float = 60) -> None:
        status = self.d / f"{name}.status"
        deadline = time.monotonic() + timeout
        while not (status.exists() and "true" in status.read_text()):
            if time.monotonic() > deadline or self.procs[name].poll() is not None:
                tail = (self.d / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"agent {name} did not come up:\n{tail}")
            time.sleep(0.02)  # polling a file another process writes

    def close(self) -> None:
        for p in self.procs.values():
            stop(p)


async def _trials(f: _Farm, n: int) -> dict[str, Any]:
    from evergraph.cluster.election import election_key
    from evergraph.cluster.hostkeys import HostKeys
    from evergraph.cluster.pins import Pins
    from evergraph.farm import model
    from evergraph.farm.service import Farm
    from evergraph.farm.signed import FarmTrust
    from evergraph.farm.tokens import User
    from evergraph.world.follow import Tombstone, watch_one
    from evergraph.world.sqlite import SQLiteKV

    admin = User(name="bench", admin=True)
    kv = SQLiteKV(f.db)
    # this client writes as m0 would (its key), trusting the other servers as m0 does
    # and the worker's key as m0 pinned it
    pins = Pins(f.d / "m0")

    def host_key(host: str) -> str | None:
        pin = pins.get(host)
        return pin.verify if pin is not None else None

    servers = {n: f.identity(n).split(":")[1] for n in SERVERS if n != "m0"}
    farm = Farm(kv, trust=FarmTrust(HostKeys(f.d / "m0"), "m0", servers, host_key))
    try:
        [w] = await _workers(farm)
        await farm.set_state(admin, w, model.IDLE)
        async with asyncio.timeout(30):
            while (await farm.worker(w)).state != model.IDLE:
                await asyncio.sleep(0.02)  # the leader completes PREPARE -> IDLE
        kill_to_match: list[float] = []
        gone_to_match: list[float] = []
        for _ in range(n):
            item = await kv.get(election_key("farm"))
            while item is None:
                await asyncio.sleep(0.02)  # a leader is being elected
                item = await kv.get(election_key("farm"))
            leader = item.value.decode()

            async def gone(lease: int = item.lease) -> float:
                key = election_key("farm")
                async with contextlib.aclosing(watch_one(kv, key)) as snaps:
                    async for snap in snaps:
                        if isinstance(snap, Tombstone) or snap.lease != lease:
                            return time.perf_counter()
                raise AssertionError("unreachable")

            watcher = asyncio.create_task(gone())
            await asyncio.sleep(0.05)  # the watch reads the key first
            t0 = time.perf_counter()
            os.kill(f.procs[leader].pid, signal.SIGKILL)
            f.procs[leader].wait()
            rid = await farm.new_request(admin, priority=1)
            req = await farm.wait_started(admin, rid, 60)
            t1 = time.perf_counter()
            assert req.state == model.IN_PROGRESS, req.state
            t_gone = await watcher
            kill_to_match.append(t1 - t0)
            gone_to_match.append(t1 - t_gone)
            await farm.close_request(admin, rid)
            f.server(leader)
            await asyncio.to_thread(f.wait_up, leader)
        return {
            "trials": n,
            "ttl_s": TTL,
            "kill_p50": percentile(kill_to_match, 50),
            "kill_p99": percentile(kill_to_match, 99),
            "gone_p50": percentile(gone_to_match, 50),
            "gone_p99": percentile(gone_to_match, 99),
            "gone_max": max(gone_to_match),
        }
    finally:
        await kv.close()


async def _workers(farm: Any) -> list[str]:
    async with asyncio.timeout(30):
        while not (ws := await farm.workers()):
            await asyncio.sleep(0.02)  # the worker agent registers
    return [w.uuid for w in ws]


def run(quick: bool) -> tuple[dict[str, Any], str]:
    d = temp_dir_until_exit("/var/tmp")
    f = _Farm(d)
    try:
        for name in SERVERS:
            f.server(name)
        f.start("wk", "--worker", *f.pins(*SERVERS))
        for name in (*SERVERS, "wk"):
            f.wait_up(name)
        res = asyncio.run(_trials(f, 5 if quick else TRIALS))
    finally:
        f.close()
    text = table(
        f"Farm failover with real agents on a sqlite World: the leading matcher's agent "
        f"killed (SIGKILL) {res['trials']} times, election lease {TTL:g} s; a request "
        "created at the kill, timed until matched by the next leader",
        ["from", "p50", "p99", "target"],
        [
            ["kill -9", fmt_s(res["kill_p50"]), fmt_s(res["kill_p99"]), "<= ttl + 2 s"],
            [
                "leader key gone (lease expired)",
                fmt_s(res["gone_p50"]),
                fmt_s(res["gone_p99"]),
                "<= 2 s",
            ],
        ],
    )
    return res, text


if __name__ == "__main__":
    import sys

    r, t = run("--quick" in sys.argv)
    print(t)
