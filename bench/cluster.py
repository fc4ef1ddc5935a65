"""Benchmark: N agents on a 3-member etcd (issue 15, item 1).

A real 3-member etcd on loopback and N agents as real processes, each with its
own hostname, state dir and — so that N "hosts" on one machine do not share the
files they manage — its own mount namespace, where a per-host directory is
bind-mounted over the one path every graph names (`SRV`). One more agent,
`hub`, exports a file to every host (fan-out) and collects one file from each
(fan-in).

Measured: start-up (all members), idle RSS and CPU per agent, fan-out of a
file to all N (apply, change, withdraw), fan-in (the hub holds all N) and the
hub's CPU per changed export, churn (kill -9 and restart 10 %), one signed
deploy reaching all N, and an etcd member killed during a fan-out change.

`python -m bench.cluster N` runs it alone; `scripts/bench --only cluster` runs
N = 10, 30, 100 (`--quick`: 10). `tests/cluster/test_cluster_scale.py` runs N = 5 and
asserts the correctness flags only.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import EVERGRAPH, percentile, spawn, table, temp_dir

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _rss_mib(pid: int) -> float:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20


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


@dataclass
class Host:
    name: str
    dir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def srv(self) -> Path:
        return self.dir / "srv"

    @property
    def graph(self) -> Path:
        return self.dir / "graph.yaml"


@dataclass
class Cluster:
    base: Path
    n: int
    urls: list[str] = field(default_factory=list)
    etcd: list[Any] = field(default_factory=list)
    hosts: list[Host] = field(default_factory=list)
    hub: Host | None = None

    @property
    def srv(self) -> Path:
        return self.base / "srv"  # each host's own srv/ is mounted here, in its namespace

    # -- etcd ------------------------------------------------------------------
    def start_etcd(self) -> None:
        from evergraph.world.etcd_server import EtcdServer

        self.etcd = EtcdServer.cluster(3, self.base / "etcd")
        EtcdServer.start_all(self.etcd)
        _wait(lambda: any(m.is_leader() for m in self.etcd), 30, "an etcd leader")
        self.urls = [m.client_url for m in self.etcd]

    def world(self, prefix: str) -> list[tuple[str, bytes]]:
        from evergraph.world.etcd import EtcdKV

        async def main() -> list[tuple[str, bytes]]:
            async with EtcdKV(self.urls) as kv:
                items, _ = await kv.range(prefix)
                return [(i.key, i.value) for i in items]

        return asyncio.run(main())

    # -- agents ----------------------------------------------------------------
    def make_hosts(self) -> None:
        self.srv.mkdir(parents=True, exist_ok=True)
        self.hub = Host("hub", self.base / "hub")
        self.hosts = [Host(f"h{i:03d}", self.base / f"h{i:03d}") for i in range(self.n)]
        for h in (self.hub, *self.hosts):
            (h.srv / "in").mkdir(parents=True, exist_ok=True)
        for h in self.hosts:
            self.write_member_graph(h, "v1")
        self.write_hub_graph("f1")

    def write_member_graph(self, h: Host, version: str) -> None:
        # exports one file to the hub (fan-in), collects what the hub sends (fan-out)
        h.graph.write_text(
            f"graph: {h.name}\nresources:\n  file:\n"
            f"  - name: {self.srv}/in/{h.name}.txt\n"
            f'    content: "{h.name} {version}\\n"\n'
            f"    meta: {{export: [hub], hidden: true}}\n"
            f"collect:\n- {{kind: file, filter: {{host: hub}}}}\n"
        )

    def write_hub_graph(self, fanout: str | None) -> None:
        assert self.hub is not None
        res = (
            f'  file:\n  - name: {self.srv}/fanout.txt\n    content: "{fanout}\\n"\n'
            f"    meta: {{export: ['*'], hidden: true}}\n"
            if fanout
            else "  {}\n"
        )
        self.hub.graph.write_text(
            f"graph: hub\nresources:\n{res}collect:\n- {{kind: file}}\n".replace(
                "resources:\n  {}\n", "resources: {}\n"
            )
        )

    def start(self, h: Host, *extra: str, graph: bool = True) -> None:
        argv = [
            EVERGRAPH, "run", *([str(h.graph)] if graph else []),
            "--hostname", h.name, "--state-dir", str(h.dir / "state"),
            "--seeds", ",".join(self.urls), "--graphviz", str(h.dir / "graph.dot"),
            *extra,
        ]  # fmt: skip
        # a mount namespace of its own: its srv/ is what every graph calls SRV
        wrapper = [
            "unshare", "-m", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" "$1" && shift && exec "$@"', str(h.srv), str(self.srv),
            *argv,
        ]  # fmt: skip
        log = open(h.dir / "agent.log", "ab")  # noqa: SIM115 (the child keeps it)
        try:
            h.proc = spawn(wrapper, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        finally:
            log.close()

    def stop(self, h: Host, sig: int = signal.SIGTERM) -> None:
        if h.proc is None:
            return
        try:
            h.proc.send_signal(sig)
            h.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            h.proc.kill()
            h.proc.wait()
        h.proc = None

    def members(self) -> set[str]:
        """The member names (empty while a read fails: 100 agents starting on 2 cores
        can make the driver's own connect time out; it asks again)."""
        from evergraph.world.kv import WorldError

        try:
            return {k.removeprefix("members/") for k, _ in self.world("members/")}
        except WorldError:
            return set()

    def why_not_members(self, want: set[str]) -> str:
        """For a start-up that timed out: who is missing, alive or not, and the end of
        the first few missing agents' logs."""
        missing = sorted(want - self.members())
        lines = [f"{len(missing)} not members: {' '.join(missing[:20])}"]
        by_name = {h.name: h for h in (*self.hosts, *([self.hub] if self.hub else []))}
        for name in missing[:3]:
            h = by_name[name]
            rc = h.proc.poll() if h.proc is not None else None
            log = (_read(h.dir / "agent.log") or "").splitlines()[-8:]
            lines.append(f"-- {name} ({'exited ' + str(rc) if rc is not None else 'running'}):")
            lines.extend(log)
        return "\n".join(lines)

    def all_have(self, hosts: Iterable[Host], rel: str, content: str | None) -> Callable[[], bool]:
        hs = list(hosts)
        return lambda: all(_read(h.srv / rel) == content for h in hs)

    def in_graph(self, hosts: Iterable[Host], needle: str, present: bool) -> Callable[[], bool]:
        hs = list(hosts)
        return lambda: all((needle in (_read(h.dir / "graph.dot") or "")) == present for h in hs)

    def close(self) -> None:
        for h in (*self.hosts, *([self.hub] if self.hub else [])):
            self.stop(h)
        for m in self.etcd:
            m.stop()


def run_cluster(n: int, base: Path, idle_s: float = 5.0) -> dict[str, Any]:
    """One full round at N; returns the figures and the correctness flags."""
    c = Cluster(base, n)
    out: dict[str, Any] = {"n": n, "ok": {}}
    ok = out["ok"]
    try:
        c.start_etcd()
        c.make_hosts()
        assert c.hub is not None
        hub, hosts = c.hub, c.hosts
        # -- start-up: every agent a member, and the first fan-out applied ----------
        t0 = time.perf_counter()
        c.start(hub)
        for h in hosts:
            c.start(h)
        want = {h.name for h in (hub, *hosts)}
        try:
            out["startup_s"] = _wait(lambda: c.members() >= want, 60 + 2 * n, "all members", 0.1)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{c.why_not_members(want)}") from None
        _wait(c.all_have(hosts, "fanout.txt", "f1\n"), 60 + 2 * n, "first fan-out")
        out["first_fanout_s"] = time.perf_counter() - t0
        # -- fan-in: the hub holds all N ---------------------------------------------
        inbox = [hub.srv / "in" / f"{h.name}.txt" for h in hosts]
        _wait(lambda: all(_read(p) is not None for p in inbox), 60 + n, "fan-in")
        out["fanin_s"] = time.perf_counter() - t0
        ok["fanin_complete"] = all(
            _read(p) == f"{h.name} v1\n" for p, h in zip(inbox, hosts, strict=True)
        )
        # -- idle: no polling -----------------------------------------------------------
        time.sleep(1.0)  # let the start-up settle (measuring, not synchronising)
        pids = [h.proc.pid for h in (hub, *hosts) if h.proc is not None]
        cpu0 = {p: _cpu_seconds(p) for p in pids}
        time.sleep(idle_s)
        idle = [(_cpu_seconds(p) - cpu0[p]) / idle_s * 100 for p in pids]
        rss = [_rss_mib(p) for p in pids]
        out["idle_cpu_pct"] = {"median": percentile(idle, 50), "max": max(idle)}
        out["rss_mib"] = {"median": percentile(rss, 50), "max": max(rss)}
        # -- fan-out: change, then withdraw -------------------------------------------
        per_host: dict[str, float] = {}
        c.write_hub_graph("f2")
        t0 = time.perf_counter()
        pending = {h.name: h for h in hosts}
        deadline = t0 + 60 + n
        while pending and time.perf_counter() < deadline:
            for name, h in list(pending.items()):
                if _read(h.srv / "fanout.txt") == "f2\n":
                    per_host[name] = time.perf_counter() - t0
                    del pending[name]
            time.sleep(0.002)
        ok["fanout_reached_all"] = not pending
        lat = sorted(per_host.values())
        out["fanout_change_s"] = {
            "p50": percentile(lat, 50),
            "p99": percentile(lat, 99),
            "max": lat[-1] if lat else None,
        }
        c.write_hub_graph(None)
        out["fanout_withdraw_s"] = _wait(
            c.in_graph(hosts, "fanout.txt", False), 60 + n, "withdrawal"
        )
        c.write_hub_graph("f3")
        _wait(c.all_have(hosts, "fanout.txt", "f3\n"), 60 + n, "fan-out f3")
        # -- fan-in: the hub's CPU per change (one record read, not N) ----------------
        changes = min(10, n)
        hub_pid = hub.proc.pid if hub.proc else 0
        cpu0_hub = _cpu_seconds(hub_pid)
        t0 = time.perf_counter()
        for h in hosts[:changes]:
            c.write_member_graph(h, "v2")
            _wait(lambda h=h: _read(hub.srv / "in" / f"{h.name}.txt") == f"{h.name} v2\n",
                  30, "a fan-in change")  # fmt: skip
        out["fanin_change_s"] = (time.perf_counter() - t0) / changes
        out["hub_cpu_ms_per_change"] = (_cpu_seconds(hub_pid) - cpu0_hub) / changes * 1000
        # -- churn: kill -9 10 %, restart with --replace --------------------------------
        churned = hosts[: max(1, n // 10)]
        for h in churned:
            c.stop(h, signal.SIGKILL)
            (h.srv / "fanout.txt").unlink(missing_ok=True)  # must be re-applied
        t0 = time.perf_counter()
        for h in churned:
            c.start(h, "--replace")
        _wait(c.all_have(churned, "fanout.txt", "f3\n"), 60 + n, "churned hosts re-applied")
        out["churn_recover_s"] = time.perf_counter() - t0
        # nothing stale past the TTL: members and the hub's exports are exactly the hosts
        time.sleep(11.0)  # one member TTL (10 s): what a killed lease held is gone by now
        ok["members_exact_after_churn"] = c.members() == want
        hub_keys = {k.split("/")[2] for k, _ in c.world("exported/hub/")}
        ok["exports_exact_after_churn"] = hub_keys == {h.name for h in hosts}
        ok["fanin_after_churn"] = all(
            _read(hub.srv / "in" / f"{h.name}.txt") is not None for h in hosts
        )
        # -- an etcd member killed during a fan-out change -------------------------------
        leader = next((m for m in c.etcd if m.is_leader()), c.etcd[0])
        c.write_hub_graph("f4")
        leader.kill()
        t0 = time.perf_counter()
        try:
            _wait(c.all_have(hosts, "fanout.txt", "f4\n"), 60 + n, "fan-out past a dead leader")
            ok["fanout_survived_etcd_kill"] = True
        except TimeoutError:
            ok["fanout_survived_etcd_kill"] = False
        out["fanout_during_etcd_kill_s"] = time.perf_counter() - t0
        leader.start()
        c.write_hub_graph("f5")
        _wait(c.all_have(hosts, "fanout.txt", "f5\n"), 60 + n, "fan-out after the restart")
        # -- deploy: every agent restarted to follow deploys; one signed deploy -----------
        for h in hosts:
            c.stop(h)
        for h in hosts:
            c.start(h, graph=False)
        # timed from the deploy, not from the agents' start-up: wait until all are up
        _wait(lambda: c.members() >= want, 60 + 2 * n, "agents following deploys", 0.1)
        site = base / "site"
        site.mkdir()
        (site / "main.yaml").write_text(
            f"graph: site\nresources:\n  file:\n  - name: {c.srv}/deployed.txt\n"
            f'    content: "deploy 1\\n"\n'
        )
        t0 = time.perf_counter()
        r = subprocess.run(
            [EVERGRAPH, "deploy", str(site / "main.yaml"), "--no-git",
             "--state-dir", str(hub.dir / "state"), "--seeds", ",".join(c.urls)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"deploy failed: {r.stderr.strip()}")
        _wait(c.all_have(hosts, "deployed.txt", "deploy 1\n"), 60 + 2 * n, "the deploy")
        out["deploy_s"] = time.perf_counter() - t0
        ok["deploy_reached_all"] = True
        ok["no_agent_died"] = all(h.proc is not None and h.proc.poll() is None for h in hosts)
    finally:
        c.close()
    return out


def _fmt(x: float | None, unit: str = "s") -> str:
    if x is None:
        return "-"
    if unit == "s":
        return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"
    return f"{x:.1f} {unit}"


def run(quick: bool) -> tuple[list[dict[str, Any]], str]:
    sizes = [10] if quick else [10, 30, 100]
    results = []
    for n in sizes:
        with temp_dir("/dev/shm") as tmp:
            # each N in a fresh process (its etcd and agents): `python -m bench.cluster N`
            p = subprocess.run(
                [sys.executable, "-m", "bench.cluster", str(n), str(tmp)],
                capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            if p.returncode != 0:
                raise RuntimeError(f"cluster N={n} failed:\n{p.stderr[-3000:]}")
            results.append(json.loads(p.stdout.strip().splitlines()[-1]))
    rows = []
    for r in results:
        rows.append(
            [
                str(r["n"]),
                _fmt(r["startup_s"]),
                f"{r['rss_mib']['median']:.0f} / {r['rss_mib']['max']:.0f} MiB",
                f"{r['idle_cpu_pct']['median']:.2f} / {r['idle_cpu_pct']['max']:.2f} %",
                f"{_fmt(r['fanout_change_s']['p50'])} / {_fmt(r['fanout_change_s']['p99'])}"
                f" / {_fmt(r['fanout_change_s']['max'])}",
                _fmt(r["fanout_withdraw_s"]),
                _fmt(r["fanin_s"]),
                f"{r['hub_cpu_ms_per_change']:.1f} ms",
                _fmt(r["churn_recover_s"]),
                _fmt(r["deploy_s"]),
                _fmt(r["fanout_during_etcd_kill_s"]),
                "yes"
                if all(r["ok"].values())
                else "NO: " + ",".join(k for k, v in r["ok"].items() if not v),
            ]
        )
    text = table(
        "N agents on a 3-member etcd (loopback; each agent in its own mount namespace)",
        ["N", "start-up", "RSS med/max", "idle CPU med/max", "fan-out p50/p99/max",
         "withdraw", "fan-in all", "hub CPU/change", "churn 10%", "deploy", "etcd kill",
         "correct"],
        rows,
    )  # fmt: skip
    return results, text


def main() -> None:
    n = int(sys.argv[1])
    base = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    if base is None:
        with temp_dir("/dev/shm") as tmp:
            print(json.dumps(run_cluster(n, tmp)))
    else:
        print(json.dumps(run_cluster(n, base)))


if __name__ == "__main__":
    if not shutil.which("unshare"):
        raise SystemExit("bench.cluster needs unshare (util-linux)")
    main()
