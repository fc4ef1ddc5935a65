"""Benchmark: a simulated World of N hosts on a 3-member etcd (issue 15, item 2).

One process (the simulator, `python -m bench.world10k simulate BASE`) plays N
hosts: for each it writes what an agent writes — `hostkeys/<h>`, a lease of
10 s, `members/<h>` and one directed, sealed and signed file export to
`collector` under that lease — with the library's own record builders, then
keeps all N leases alive every TTL/3 as `Membership` does (a pool of workers
over a few shared `EtcdKV` clients, one keep-alive call per lease; or, mode
`stream`, many leases multiplexed on a few keep-alive streams), recording each
round's duration and every lease that expired (re-granted as agents do).

One real agent, `collector` (`evergraph run` of a graph that collects every
file and has no resources of its own), collects the N exports directed at it.

Measured: the time to write N hosts; the keep-alive rounds (duration, calls/s,
expiries) and what they cost etcd (CPU, RSS, db size per member); the
collector's initial sync (start to all N files on disk), its RSS and idle CPU;
one change -> one read (latency, the collector's CPU, and how many range reads
and watch events etcd served for it); a follow resync after compaction (collector
stopped, 100 exports changed, etcd compacted and every member restarted, the
collector continued: time until all 100 are on disk, and its log saying it
re-read); and whether any lease expired (members/ counted at the end).

`python -m bench.world10k [N] [--mode calls|stream] [--keepalive-only]` runs one
size alone (default 10,000, leases kept as agents keep theirs: a call each;
`stream`: many leases on one keep-alive stream, as etcd's Go client does, which
one Python process can sustain at 10,000). `scripts/bench --only world10k` runs
N = 1,000 (calls), 10,000 (stream) and 5,000 (calls, keep-alives only: where one
process stops keeping up); `--quick`: N = 1,000 (calls) alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import EVERGRAPH, PYTHON, REPO, percentile, spawn, stop, table, temp_dir

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
TTL = 10.0  # the agents' member lease (cluster/members.py DEFAULT_TTL)
COLLECTOR = "collector"
#: the simulator's shared etcd clients (writes; keep-alives in "calls" mode), its
#: keep-alive streams ("stream" mode), and how many calls it has in flight: writes
#: are held to a few so that joining hosts do not starve the keep-alives of those
#: already written; 64 keep-alive calls is the best rate of EtcdKV here (256:
#: half of it), one stream is answered one keep-alive at a time by etcd
CLIENTS = 4
STREAMS = 16
WRITERS = 16
KEEPERS = {"calls": 64, "stream": 256}


# -- /proc and etcd's metrics ---------------------------------------------------------
def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _rss_mib(pid: int) -> float:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20


def _metrics(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of etcd's Prometheus counters/gauges whose name is in `names` (the
    client URL serves /metrics too), labels summed over."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


RANGES = "etcd_debugging_mvcc_range_total"
SENT = "etcd_network_client_grpc_sent_bytes_total"
DB = "etcd_mvcc_db_total_size_in_bytes"
EVENTS = "etcd_debugging_mvcc_events_total"  # watch events sent


def _delta(a: list[dict[str, float]], b: list[dict[str, float]], name: str) -> list[float]:
    """Each member's growth of counter `name` between two readings."""
    return [y[name] - x[name] for x, y in zip(a, b, strict=True)]


def _wait(pred: Callable[[], bool], timeout: float, what: str, every: float = 0.005) -> float:
    """Seconds until `pred()` holds (polled every `every` s); raises on timeout."""
    t0 = time.perf_counter()
    while not pred():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s")
        time.sleep(every)
    return time.perf_counter() - t0


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


# -- hosts, as the simulator and the driver both know them -------------------------------
def host_name(i: int) -> str:
    return f"h{i:05d}"


def host_keys(name: str) -> Any:
    """The key pairs of simulated host `name`: made from its name, so the driver
    (which changes exports) and the simulator (which wrote them) agree without
    sharing files. A HostKeys without a state dir: only what records need."""
    import nacl.public
    import nacl.signing

    from evergraph.cluster.hostkeys import HostKeys

    keys = HostKeys.__new__(HostKeys)
    seed = hashlib.sha256(f"world10k/{name}".encode()).digest()
    keys.box_key = nacl.public.PrivateKey(hashlib.sha256(b"box" + seed).digest())
    keys.sign_key = nacl.signing.SigningKey(hashlib.sha256(b"sign" + seed).digest())
    return keys


def export_of(base: Path, name: str, keys: Any, to_public: str, version: str) -> tuple[str, bytes]:
    """(key, record) of host `name`'s one file export to the collector."""
    from evergraph.cluster.exports import export_key, make_record

    path = str(base / "in" / f"{name}.txt")
    params = {"name": path, "content": f"{name} {version}\n"}
    seq = time.time_ns() // 1000
    record = make_record(keys, name, COLLECTOR, "file", path, params, to_public, seq)
    return export_key(COLLECTOR, name, "file", path), record


def export_ops(
    base: Path, name: str, keys: Any, to_public: str, version: str, lease: int
) -> list[Any]:
    """What an agent writes in one txn for its one export: the record and its index
    (which names the record's sequence: no replay)."""
    from evergraph.cluster.exports import entry_name, index_key, make_index, record_digest
    from evergraph.world.kv import Put

    key, record = export_of(base, name, keys, to_public, version)
    seq = json.loads(record)["seq"]
    entry = (seq, record_digest(record))
    index = make_index(keys, name, COLLECTOR, seq + 1, {entry_name(key): entry})
    return [Put(key, record, lease), Put(index_key(COLLECTOR, name), index, lease)]


# -- the simulator (a child process) ---------------------------------------------------
@dataclass
class SimHost:
    name: str
    keys: Any
    kv: Any
    #: what keeps its lease alive: the EtcdKV (one call each) or a LeaseStream
    keeper: Any = None
    lease: int = 0
    last_ok: float = 0.0


class LeaseStream:
    """Keep-alives of many leases multiplexed on ONE LeaseKeepAlive stream (what
    etcd's Go client does for all leases of a process), on a channel of its own.
    `EtcdKV.keepalive` opens a stream per call, which is right for an agent's one
    lease and costs ~0.5 ms of Python per call: the simulator's first wall."""

    def __init__(self, urls: list[str]) -> None:
        self.targets = [u.split("://", 1)[-1] for u in urls]
        self.current = 0
        self.channel: Any = None
        self.call: Any = None
        self.reader: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()
        self.waiting: dict[int, list[asyncio.Future[int]]] = {}

    async def _open(self) -> Any:
        import grpc.aio
        from aetcd import rpc

        if self.call is None:
            if self.channel is not None:
                await self.channel.close()
            self.channel = grpc.aio.insecure_channel(self.targets[self.current])
            self.call = rpc.LeaseStub(self.channel).LeaseKeepAlive()
            self.reader = asyncio.create_task(self._read(self.call))
        return self.call

    async def _read(self, call: Any) -> None:
        import grpc.aio

        why = "the stream ended"
        try:
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    break
                futs = self.waiting.get(int(resp.ID))
                if futs:
                    fut = futs.pop(0)
                    if not fut.done():
                        fut.set_result(int(resp.TTL))
        except grpc.aio.AioRpcError as e:
            why = str(e.details())
        if self.call is call:  # broken: the next keep-alive opens one on the next member
            self.call = None
            self.current = (self.current + 1) % len(self.targets)
        for futs in self.waiting.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(ConnectionError(why))
        self.waiting.clear()

    async def keepalive(self, lease: int) -> None:
        from evergraph.world.kv import LeaseExpired, WorldError

        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(lease, []).append(fut)
        try:
            from aetcd import rpc

            async with self.lock:  # one write at a time on a stream
                call = await self._open()
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease))
            ttl = await asyncio.wait_for(fut, 5.0)
        except Exception as e:  # any broken stream: one WorldError
            if self.call is not None and self.reader is not None and self.reader.done():
                self.call = None
            raise WorldError(f"keep-alive of lease {lease:x}: {e!r}") from None
        if ttl <= 0:
            raise LeaseExpired(f"lease {lease:x} expired")

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(BaseException):
                await self.reader
        if self.channel is not None:
            await self.channel.close()


@dataclass
class Sim:
    base: Path
    urls: list[str]
    n: int
    to_public: str
    #: "calls": EtcdKV.keepalive per lease (as agents do); "stream": LeaseStream
    mode: str = "calls"
    stats: dict[str, Any] = field(default_factory=dict)

    def save(self) -> None:
        tmp = self.base / "sim-stats.json.tmp"
        tmp.write_text(json.dumps(self.stats))
        tmp.replace(self.base / "sim-stats.json")

    async def write_host(self, h: SimHost, rejoin: bool = False) -> None:
        """What an agent writes on joining: its member record under a fresh lease,
        its host keys (no lease), its exports under the lease. `rejoin`: after its
        lease expired (as Membership re-grants and re-puts; the keys stay)."""
        import msgspec

        from evergraph.cluster.exports import publish_hostkeys
        from evergraph.cluster.members import Member, member_key

        h.lease = await h.kv.grant(TTL)
        m = Member(
            host=h.name,
            address="127.0.0.1",
            public=h.keys.public,
            verify=h.keys.verify,
            version="sim",
            started=time.time(),
            pid=os.getpid(),
            timestamp=time.time(),
        )
        await h.kv.put(member_key(h.name), msgspec.json.encode(m), lease=h.lease)
        if not rejoin:
            await publish_hostkeys(h.kv, h.keys, h.name)
        await h.kv.txn([], export_ops(self.base, h.name, h.keys, self.to_public, "v1", h.lease))
        h.last_ok = time.monotonic()

    async def pool(self, hosts: list[SimHost], fn: Callable[[SimHost], Any], width: int) -> None:
        it = iter(hosts)

        async def worker() -> None:
            for h in it:
                await fn(h)

        await asyncio.gather(*(worker() for _ in range(width)))

    async def main(self) -> None:
        from evergraph.world.etcd import EtcdKV

        kvs = [EtcdKV(self.urls, timeout=30.0) for _ in range(CLIENTS)]
        streams = [LeaseStream(self.urls) for _ in range(STREAMS)]
        keepers = streams if self.mode == "stream" else kvs
        self.stats.update(phase="writing", rounds=[], expired=0, errors=0, error_text="")
        try:
            t0 = time.perf_counter()
            hosts = [
                SimHost(
                    host_name(i),
                    host_keys(host_name(i)),
                    kvs[i % CLIENTS],
                    keepers[i % len(keepers)],
                )
                for i in range(self.n)
            ]
            self.stats["keys_s"] = time.perf_counter() - t0
            written: list[SimHost] = []

            async def write(h: SimHost) -> None:
                await self.write_host(h)
                written.append(h)

            # the leases are kept alive from the first one on, as agents do
            async with asyncio.TaskGroup() as tg:
                keeper = tg.create_task(self.keep_alive(written))
                t0 = time.perf_counter()
                await self.pool(hosts, write, WRITERS)
                self.stats["write_s"] = time.perf_counter() - t0
                self.stats["phase"] = "keeping"
                self.save()
                await keeper
        finally:
            for kv in (*kvs, *streams):
                await kv.close()

    async def keep_alive(self, hosts: list[SimHost]) -> None:
        """Every TTL/3, one keep-alive per lease (as Membership does), a round at a
        time over the hosts written so far; a round that takes longer than TTL/3
        delays the next one."""
        from evergraph.world.kv import LeaseExpired, WorldError

        period = TTL / 3
        rounds: list[dict[str, Any]] = self.stats["rounds"]
        nxt = time.monotonic()
        while True:
            nxt += period
            wait = nxt - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            else:
                nxt = time.monotonic()  # late: no catching up in a burst
            phase = self.stats["phase"]
            t0 = time.monotonic()
            worst = 0.0
            expired = errors = 0

            async def one(h: SimHost) -> None:
                nonlocal worst, expired, errors
                try:
                    await h.keeper.keepalive(h.lease)
                except LeaseExpired:
                    expired += 1
                    with contextlib.suppress(WorldError):
                        await self.write_host(h, rejoin=True)
                    return
                except WorldError as e:
                    errors += 1
                    self.stats["error_text"] = str(e)
                    return
                now = time.monotonic()
                worst = max(worst, now - h.last_ok)
                h.last_ok = now

            batch = list(hosts)
            await self.pool(batch, one, KEEPERS[self.mode])
            took = time.monotonic() - t0
            rounds.append(
                {
                    "at": time.time(),
                    "phase": phase,
                    "hosts": len(batch),
                    "s": took,
                    "max_gap_s": worst,
                    "expired": expired,
                    "errors": errors,
                }
            )
            del rounds[:-200]
            self.stats["expired"] += expired
            self.stats["errors"] += errors
            self.save()


def simulate(base: Path) -> None:
    cfg = json.loads((base / "sim.json").read_text())
    sim = Sim(base, cfg["urls"], cfg["n"], cfg["to_public"], cfg["mode"])
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(sim.main())


# -- the driver ------------------------------------------------------------------------
class World:
    """The driver's side: etcd, the simulator and the collector, all ours to stop."""

    def __init__(self, base: Path, n: int, mode: str) -> None:
        self.base, self.n, self.mode = base, n, mode
        self.etcd: list[Any] = []
        self.urls: list[str] = []
        self.sim: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.state = base / "collector" / "state"
        self.log = base / "collector" / "agent.log"
        self.inbox = base / "in"
        self.to_public = ""

    def start_etcd(self) -> None:
        from evergraph.world.etcd_server import EtcdServer

        self.etcd = EtcdServer.cluster(3, self.base / "etcd")
        EtcdServer.start_all(self.etcd)
        _wait(lambda: any(m.is_leader() for m in self.etcd), 30, "an etcd leader")
        self.urls = [m.client_url for m in self.etcd]

    def kv_call(self, fn: Callable[[Any], Any]) -> Any:
        from evergraph.world.etcd import EtcdKV

        async def main() -> Any:
            async with EtcdKV(self.urls, timeout=30.0) as kv:
                return await fn(kv)

        return asyncio.run(main())

    def count(self, prefix: str) -> int:
        async def fn(kv: Any) -> int:
            items, _ = await kv.range(prefix)
            return len(items)

        return int(self.kv_call(fn))

    def etcd_metrics(self, *names: str) -> list[dict[str, float]]:
        return [_metrics(m.client_url, names) for m in self.etcd]

    def sim_stats(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.base / "sim-stats.json").read_text()))
        except (OSError, ValueError):
            return {}

    def start_sim(self) -> None:
        from evergraph.cluster.hostkeys import HostKeys

        # the collector's keys, made now in its state dir: the exports are sealed to them
        self.to_public = HostKeys(self.state).public
        self.inbox.mkdir()
        cfg = {"urls": self.urls, "n": self.n, "to_public": self.to_public, "mode": self.mode}
        (self.base / "sim.json").write_text(json.dumps(cfg))
        log = open(self.base / "sim.log", "ab")  # noqa: SIM115 (the child keeps it)
        try:
            self.sim = spawn(
                [PYTHON, "-m", "bench.world10k", "simulate", str(self.base)],
                cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
        finally:
            log.close()

    def sim_alive(self) -> bool:
        if self.sim is None or self.sim.poll() is not None:
            tail = _read(self.base / "sim.log") or ""
            raise RuntimeError(f"the simulator died:\n{tail[-2000:]}")
        return True

    def agent_alive(self) -> bool:
        if self.agent is None or self.agent.poll() is not None:
            tail = _read(self.log) or ""
            raise RuntimeError(f"the collector died:\n{tail[-3000:]}")
        return True

    def start_agent(self) -> None:
        graph = self.base / "collector" / "graph.yaml"
        graph.write_text(f"graph: {COLLECTOR}\nresources: {{}}\ncollect:\n- {{kind: file}}\n")
        log = open(self.log, "ab")  # noqa: SIM115 (the child keeps it)
        try:
            self.agent = spawn(
                [EVERGRAPH, "run", str(graph), "--hostname", COLLECTOR,
                 "--seeds", ",".join(self.urls), "--state-dir", str(self.state)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
        finally:
            log.close()

    def inbox_count(self) -> int:
        with os.scandir(self.inbox) as it:
            return sum(1 for e in it if e.name.endswith(".txt"))

    def change(self, names: list[str], version: str) -> tuple[float, int]:
        """Write new export records of `names` (under their current leases); returns
        (perf_counter when the first put started, the last revision)."""

        async def fn(kv: Any) -> tuple[float, int]:
            todo = []
            for name in names:
                key, _ = export_of(self.base, name, host_keys(name), self.to_public, version)
                cur = await kv.get(key)
                lease = cur.lease if cur is not None else 0
                todo.append(
                    export_ops(self.base, name, host_keys(name), self.to_public, version, lease)
                )
            t0 = time.perf_counter()
            rev = 0
            for ops in todo:
                rev = await kv.txn([], ops)
            return t0, rev

        t0, rev = self.kv_call(fn)
        return float(t0), int(rev)

    def close(self) -> None:
        for p in (self.agent, self.sim):
            if p is not None:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGCONT)  # a stopped process cannot die of SIGTERM
                stop(p, grace=10)
        for m in self.etcd:
            m.stop()


def _cpu_pct(pids: list[int], seconds: float) -> list[float]:
    before = [_cpu_seconds(p) for p in pids]
    time.sleep(seconds)
    return [(_cpu_seconds(p) - b) / seconds * 100 for p, b in zip(pids, before, strict=True)]


def run_world(
    n: int, base: Path, mode: str = "calls", quick: bool = False, keepalive_only: bool = False
) -> dict[str, Any]:
    """One round at N; returns the figures (and what broke, if something did).
    `mode`: how the simulator keeps leases alive (see Sim.mode); `keepalive_only`:
    stop after the keep-alive figures (no collector)."""
    w = World(base, n, mode)
    out: dict[str, Any] = {
        "n": n, "mode": mode, "ok": {}, "load_before": os.getloadavg()[0]
    }  # fmt: skip
    ok = out["ok"]
    steady = 10.0 if quick else 30.0
    try:
        w.start_etcd()
        etcd_pids = [int(m.pid) for m in w.etcd]
        # -- N hosts written, then kept alive ------------------------------------------
        w.start_sim()
        _wait(lambda: w.sim_alive() and w.sim_stats().get("phase") == "keeping",
              120 + n / 20, "the simulator's N hosts", 0.2)  # fmt: skip
        st = w.sim_stats()
        out["keys_s"], out["write_s"] = st["keys_s"], st["write_s"]
        out["write_hosts_per_s"] = n / st["write_s"]
        assert w.sim is not None
        pids = [*etcd_pids, w.sim.pid]

        def steady_rounds() -> list[dict[str, Any]]:
            rs = w.sim_stats().get("rounds", [])
            return [r for r in rs if r["phase"] == "keeping" and r["hosts"] == n]

        def rounds_done(k: int) -> Callable[[], bool]:
            return lambda: w.sim_alive() and len(steady_rounds()) >= k

        # rounds 2-4 (the first overlaps the writes' tail), however long they take
        _wait(rounds_done(1), 120, "a first keep-alive round", 0.05)
        m0 = w.etcd_metrics(RANGES, SENT)
        c0 = [_cpu_seconds(p) for p in pids]
        t0 = time.perf_counter()
        _wait(rounds_done(4), 360, "three keep-alive rounds", 0.05)
        took = time.perf_counter() - t0
        cpu = [(_cpu_seconds(p) - c) / took * 100 for p, c in zip(pids, c0, strict=True)]
        m1 = w.etcd_metrics(RANGES, SENT, DB)
        out["ka_etcd_cpu_pct"] = cpu[:3]
        out["ka_sim_cpu_pct"] = cpu[3]
        out["ka_etcd_rss_mib"] = [_rss_mib(p) for p in etcd_pids]
        out["ka_etcd_sent_kib_s"] = [d / took / 1024 for d in _delta(m0, m1, SENT)]
        out["db_mib"] = [m[DB] / 2**20 for m in m1]
        out["leader"] = next((i for i, m in enumerate(w.etcd) if m.is_leader()), -1)
        rounds = steady_rounds()[1:4]
        durs = [r["s"] for r in rounds]
        out["ka_round_s"] = {"p50": percentile(durs, 50), "max": max(durs), "rounds": len(durs)}
        out["ka_calls_per_s"] = n / percentile(durs, 50)
        out["ka_max_gap_s"] = max(r["max_gap_s"] for r in rounds)
        out["ka_expired_writing"] = sum(
            r["expired"] for r in w.sim_stats()["rounds"] if r["phase"] == "writing"
        )
        out["ka_needed_calls_per_s"] = n / (TTL / 3)
        if keepalive_only:
            st = w.sim_stats()
            out["expired"], out["ka_errors"] = st["expired"], st["errors"]
            out["ka_error_text"] = st.get("error_text", "")
            out["ka_max_gap_all_s"] = max(r["max_gap_s"] for r in st["rounds"])
            out["members"] = w.count("members/")
            ok["no_lease_expired"] = out["expired"] == 0 and out["members"] == n
            return out
        # -- the collector: initial sync -------------------------------------------------
        t0 = time.perf_counter()
        w.start_agent()
        assert w.agent is not None
        apid = w.agent.pid
        peak = 0.0

        def synced() -> bool:
            nonlocal peak
            w.agent_alive()
            w.sim_alive()
            peak = max(peak, _rss_mib(apid))
            return w.inbox_count() >= n

        _wait(synced, 300 + n / 5, "the collector's N files", 0.05)
        out["sync_s"] = time.perf_counter() - t0
        out["sync_cpu_s"] = _cpu_seconds(apid)
        out["sync_peak_rss_mib"] = peak
        ok["all_collected"] = all(
            _read(w.inbox / f"{host_name(i)}.txt") == f"{host_name(i)} v1\n" for i in range(n)
        )
        time.sleep(2.0)  # let the first convergence's tail settle (measuring)
        m0 = w.etcd_metrics(RANGES, SENT)
        cpu = _cpu_pct([apid, *etcd_pids], steady)
        m1 = w.etcd_metrics(RANGES, SENT)
        out["agent_rss_mib"] = _rss_mib(apid)
        out["agent_idle_cpu_pct"] = cpu[0]
        out["idle_etcd_cpu_pct"] = cpu[1:]
        out["idle_ranges"] = sum(_delta(m0, m1, RANGES))

        async def exported_size(kv: Any) -> int:
            items, _ = await kv.range("exported/")
            return sum(len(i.key) + len(i.value) for i in items)

        # what every agent's Publisher reads every 30 s (RECHECK): all of exported/
        out["exported_mib"] = w.kv_call(exported_size) / 2**20
        out["etcd_rss_mib"] = [_rss_mib(p) for p in etcd_pids]
        # -- one change -> one read ------------------------------------------------------
        trials = 10
        lat: list[float] = []
        cpu_change: list[float] = []
        ranges = events = 0.0
        for k in range(trials):
            name = host_name((k * 7919) % n)
            path = w.inbox / f"{name}.txt"
            want = f"{name} c{k}\n"
            c0 = _cpu_seconds(apid)
            a = w.etcd_metrics(RANGES, EVENTS)
            t_put, _ = w.change([name], f"c{k}")
            _wait(lambda p=path, s=want: w.agent_alive() and _read(p) == s, 60, "one change", 0.001)
            lat.append(time.perf_counter() - t_put)
            time.sleep(0.5)  # the agent's work after the file (status, swap tail)
            cpu_change.append(_cpu_seconds(apid) - c0)
            b = w.etcd_metrics(RANGES, EVENTS)
            ranges += sum(_delta(a, b, RANGES))
            events += sum(_delta(a, b, EVENTS))
        idle_rate = out["agent_idle_cpu_pct"] / 100
        out["change_s"] = {"p50": percentile(lat, 50), "max": max(lat)}
        out["change_cpu_ms"] = percentile(cpu_change, 50) * 1000
        out["change_cpu_ms_net"] = max(0.0, percentile(cpu_change, 50) - idle_rate * 0.5) * 1000
        # the driver's own get (1) per change; a re-list would add ranges of N records
        out["change_ranges"] = ranges / trials - 1
        out["change_events"] = events / trials
        # -- a follow resync after compaction ---------------------------------------------
        touched = [host_name((k * 104729) % n) for k in range(min(100, n))]
        touched = list(dict.fromkeys(touched))
        offset = w.log.stat().st_size
        os.kill(apid, signal.SIGSTOP)
        try:
            # the members restarted first, one at a time (quorum stays): every stream
            # of the collector breaks before the changes, which would otherwise wait
            # in its socket buffer and reach it without a resync
            t0 = time.perf_counter()
            for m in w.etcd:
                m.stop()
                m.start(timeout=60)
            _, rev = w.change(touched, "r1")

            async def compact(kv: Any) -> None:
                await kv.compact(rev)

            w.kv_call(compact)
            out["etcd_restarts_s"] = time.perf_counter() - t0
            etcd_pids = [int(m.pid) for m in w.etcd]
        finally:
            os.kill(apid, signal.SIGCONT)
        t0 = time.perf_counter()
        paths = [(w.inbox / f"{h}.txt", f"{h} r1\n") for h in touched]
        _wait(lambda: w.agent_alive() and all(_read(p) == s for p, s in paths),
              120 + n / 50, "the resync", 0.01)  # fmt: skip
        out["resync_s"] = time.perf_counter() - t0
        text = (_read(w.log) or "")[offset:]
        ok["resynced_after_compaction"] = (
            f"follow exported/{COLLECTOR}/: revision" in text and "is compacted" in text
        )
        out["resync_log"] = [ln for ln in text.splitlines() if "compacted" in ln][:4]
        # -- leases: none lost ------------------------------------------------------------
        time.sleep(TTL / 3)  # a round after the restarts (measuring)
        st = w.sim_stats()
        out["expired"], out["ka_errors"] = st["expired"], st["errors"]
        out["ka_error_text"] = st.get("error_text", "")
        all_rounds = st["rounds"]
        out["ka_round_max_s"] = max(r["s"] for r in all_rounds)
        out["ka_max_gap_all_s"] = max(r["max_gap_s"] for r in all_rounds)
        out["members"] = w.count("members/")
        ok["no_lease_expired"] = out["expired"] == 0 and out["members"] == n + 1
        ok["collector_alive"] = w.agent.poll() is None
        out["etcd_rss_end_mib"] = [_rss_mib(p) for p in etcd_pids]
    finally:
        w.close()
    return out


# -- output ----------------------------------------------------------------------------
def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _each(xs: list[float], fmt: str) -> str:
    return " / ".join(format(x, fmt) for x in xs)


MODES = {"calls": "a call per lease", "stream": "one stream"}


def render(results: list[dict[str, Any]]) -> str:
    def cell(r: dict[str, Any], fn: Callable[[dict[str, Any]], str]) -> str:
        try:
            return fn(r)
        except KeyError:
            return "-"  # a keep-alive-only run

    def ok(r: dict[str, Any]) -> str:
        bad = [k for k, v in r["ok"].items() if not v]
        return "yes" if not bad else "NO: " + ", ".join(bad)

    lines: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("keep-alives by", lambda r: MODES[r["mode"]]),
        ("hosts written (hostkeys, lease, member, export)",
         lambda r: f"{_s(r['write_s'])} ({r['write_hosts_per_s']:,.0f}/s)"),
        ("keep-alive round p50 / max (every 3.33 s)",
         lambda r: f"{_s(r['ka_round_s']['p50'])} / {_s(r['ka_round_s']['max'])}"),
        ("keep-alives/s needed / achieved",
         lambda r: f"{r['ka_needed_calls_per_s']:,.0f} / {r['ka_calls_per_s']:,.0f}"),
        ("longest gap between a lease's keep-alives", lambda r: _s(r["ka_max_gap_all_s"])),
        ("simulator CPU (one asyncio loop)", lambda r: f"{r['ka_sim_cpu_pct']:.0f} %"),
        ("etcd CPU m0 / m1 / m2 (keep-alives)",
         lambda r: _each(r["ka_etcd_cpu_pct"], ".0f") + " %"),
        ("etcd RSS m0 / m1 / m2", lambda r: _each(r["ka_etcd_rss_mib"], ".0f") + " MiB"),
        ("etcd sent to clients m0 / m1 / m2",
         lambda r: _each(r["ka_etcd_sent_kib_s"], ".0f") + " KiB/s"),
        ("etcd leader", lambda r: f"m{r['leader']}"),
        ("etcd db size; all of exported/",
         lambda r: f"{max(r['db_mib']):.1f} MiB; {r['exported_mib']:.1f} MiB"),
        ("collector initial sync (start -> N files)",
         lambda r: f"{_s(r['sync_s'])} ({r['sync_cpu_s']:.0f} s CPU)"),
        ("collector RSS after sync (peak)",
         lambda r: f"{r['agent_rss_mib']:.0f} MiB ({r['sync_peak_rss_mib']:.0f})"),
        ("collector idle CPU; range reads while idle",
         lambda r: f"{r['agent_idle_cpu_pct']:.1f} %; {r['idle_ranges']:.0f}"),
        ("one change: latency p50 / max",
         lambda r: f"{_s(r['change_s']['p50'])} / {_s(r['change_s']['max'])}"),
        ("one change: collector CPU", lambda r: f"{r['change_cpu_ms']:.0f} ms"),
        ("one change: etcd range reads / watch events sent",
         lambda r: f"{r['change_ranges']:.1f} / {r['change_events']:.1f}"),
        ("restart 3 etcd, 100 changes, compact (stopped)", lambda r: _s(r["etcd_restarts_s"])),
        ("resync: 100 changes on disk after SIGCONT", lambda r: _s(r["resync_s"])),
        ("leases expired / keep-alive errors", lambda r: f"{r['expired']:,} / {r['ka_errors']}"),
        ("members/ at the end", lambda r: f"{r['members']:,}"),
        ("correct", ok),
    ]  # fmt: skip
    rows = [[label, *(cell(r, fn) for r in results)] for label, fn in lines]
    return table(
        "A simulated World on a 3-member etcd (one simulator process, one collector agent)",
        ["", *(f"N={r['n']:,}" for r in results)],
        rows,
    )


def _one(n: int, mode: str, quick: bool, keepalive_only: bool) -> dict[str, Any]:
    with temp_dir("/dev/shm") as tmp:
        # in a fresh process (its etcd, simulator and collector)
        argv = [PYTHON, "-m", "bench.world10k", str(n), str(tmp), "--mode", mode]
        argv += ["--quick"] if quick else []
        argv += ["--keepalive-only"] if keepalive_only else []
        p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"world10k N={n} failed:\n{p.stderr[-3000:]}")
        return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def run(quick: bool) -> tuple[list[dict[str, Any]], str]:
    """--quick: N=1,000 keeping leases as agents do (a call per lease). Full: that;
    N=10,000 keeping leases on shared streams (everything else measured at that
    size); and N=5,000 as agents do, keep-alives only: past the wall of one
    process keeping leases a call each, so leases expire there."""
    if quick:
        results = [_one(1000, "calls", True, False)]
    else:
        results = [
            _one(1000, "calls", False, False),
            _one(10000, "stream", False, False),
            _one(5000, "calls", False, True),
        ]
    return results, render(results)


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["simulate"]:
        simulate(Path(args[1]))
        return
    flags = {a for a in args if a in ("--quick", "--keepalive-only")}
    mode = "calls"
    if "--mode" in args:
        i = args.index("--mode")
        mode = args[i + 1]
        del args[i : i + 2]
    if mode not in ("calls", "stream"):
        raise SystemExit("bench.world10k: --mode is calls or stream")
    args = [a for a in args if a not in flags]
    n = int(args[0]) if args else 10000
    kw = {"mode": mode, "quick": "--quick" in flags, "keepalive_only": "--keepalive-only" in flags}
    if len(args) > 1:
        result = run_world(n, Path(args[1]), **kw)  # type: ignore[arg-type]
    else:
        from bench.common import cleanup_all

        try:
            with temp_dir("/dev/shm") as tmp:
                result = run_world(n, tmp, **kw)  # type: ignore[arg-type]
        finally:
            cleanup_all()
    print(render([result]), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
