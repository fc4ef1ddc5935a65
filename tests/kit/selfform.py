"""Agents that carry etcd members, on the hosts of a NetBed (tests/kit/netbed.py):
start, stop, kill -9, restart, ask the cluster what it looks like, make tokens;
a cluster formed the way the tests form it (`formed`, `settled`); the counter
writer (tests/kit/cluster_client.py) and what its journal must show."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.kit.machine import ONE_CLUSTER
from tests.kit.netbed import NetBed, NetHost

#: what every multi-host cluster test module carries: it needs root, namespaces,
#: nftables and etcd; it is slow; and it runs one at a time per machine
#: how long a cluster test may wait for its turn (ONE_CLUSTER): every other cluster
#: test of this suite and of one more suite beside it; pytest-timeout counts the wait
LOCK_WAIT = 1800


def cluster_timeout(seconds: float) -> pytest.MarkDecorator:
    """A cluster test's own time-out, plus the wait for its turn."""
    return pytest.mark.timeout(seconds + LOCK_WAIT)


CLUSTER_TEST = [
    cluster_timeout(120),
    pytest.mark.skipif(
        os.geteuid() != 0
        or not all(map(shutil.which, ("ip", "nsenter", "unshare", "nft", "etcd"))),
        reason="needs root, ip, nsenter, unshare, nft and etcd",
    ),
    pytest.mark.slow,
    ONE_CLUSTER,
]

#: an empty graph: the agents only carry the World
GRAPH = "resources: []\n"
EVERGRAPH = (sys.executable, "-m", "evergraph.cli.main")


def env() -> dict[str, str]:
    e = {**os.environ, "EVERGRAPH_ETCD_TIMING": "fast", "PYTHONUNBUFFERED": "1"}
    e.pop("EVERGRAPH_JOIN_TOKEN", None)
    return e


def client_url(h: NetHost) -> str:
    return f"https://{h.addr}:2379"


def peer_url(h: NetHost) -> str:
    return f"https://{h.addr}:2380"


class Member:
    """An agent with `--etcd embedded` on host `h`."""

    def __init__(
        self, bed: NetBed, h: NetHost, timeout: float = 3.0, graph: str | None = None
    ) -> None:
        """`graph`: the text of this agent's own graph (default: the empty one, shared)."""
        self.bed = bed
        self.h = h
        self.timeout = timeout
        self.log = bed.tmp / f"{h.name}.log"
        if graph is None:
            self.graph = bed.tmp / "graph.yaml"
            self.graph.write_text(GRAPH)
        else:
            self.graph = bed.tmp / f"{h.name}.yaml"
            self.set_graph(graph)
        self.proc: subprocess.Popen[bytes] | None = None
        self._last: tuple[Sequence[NetHost], Path | None, tuple[str, ...]] = ((), None, ())

    def set_graph(self, text: str) -> None:
        """Replace this agent's graph as editors do (a new file renamed over it)."""
        tmp = self.graph.with_name(f".{self.graph.name}.tmp")
        tmp.write_text(text)
        tmp.replace(self.graph)

    def argv(
        self, seeds: Sequence[NetHost] = (), token: Path | None = None, *extra: str
    ) -> list[str]:
        a = [
            *EVERGRAPH,
            "run",
            str(self.graph),
            "--etcd",
            "embedded",
            "--hostname",
            self.h.name,
            "--state-dir",
            str(self.h.state_dir),
            "--etcd-client-url",
            client_url(self.h),
            "--etcd-peer-url",
            peer_url(self.h),
            "--etcd-member-timeout",
            str(self.timeout),
            "-v",
        ]
        if seeds:
            a += ["--seeds", ",".join(client_url(s) for s in seeds)]
        if token is not None:
            a += ["--join-token-file", str(token)]
        return a + list(extra)

    def start(self, seeds: Sequence[NetHost] = (), token: Path | None = None, *extra: str) -> None:
        self._last = (seeds, token, extra)
        self.proc = self.h.spawn(*self.argv(seeds, token, *extra), log=self.log, env=env())

    def restart(self) -> None:
        """Start again with the arguments of the last start."""
        seeds, token, extra = self._last
        self.start(seeds, token, *extra)

    def kill9(self) -> None:
        assert self.proc is not None
        self.h.kill9(self.proc)
        self.proc = None

    def stop(self, timeout: float = 90) -> int:
        assert self.proc is not None
        self.proc.terminate()
        code = self.proc.wait(timeout)
        self.proc = None
        return code

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.h.run(
            *EVERGRAPH,
            "cluster",
            "--state-dir",
            str(self.h.state_dir),
            *args,
            env=env(),
            check=check,
        )

    def rows(self) -> list[dict[str, Any]]:
        r = self.cli("--json", check=False)
        if r.returncode != 0:
            return []
        return list(json.loads(r.stdout))

    def token(self, path: Path, *args: str) -> Path:
        path.write_text(self.cli("token", *args).stdout)
        return path

    def tls(self) -> list[str]:
        d = self.h.state_dir / "cluster"
        return [
            "--etcd-ca",
            str(d / "ca.crt"),
            "--etcd-cert",
            str(d / "node.crt"),
            "--etcd-key",
            str(d / "node.key"),
        ]

    def world(
        self, *args: str, seeds: list[NetHost], check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.h.run(
            *EVERGRAPH,
            "world",
            *args,
            "--seeds",
            ",".join(client_url(s) for s in seeds),
            *self.tls(),
            env=env(),
            check=check,
        )


def roles(rows: list[dict[str, Any]]) -> dict[str, str]:
    return {r["name"]: r["role"] for r in rows}


def wait_until(
    pred: Callable[[], object], timeout: float, what: str, members: Sequence[Member] = ()
) -> float:
    """Poll `pred` (each call asks the cluster: itself a wait) until true; the seconds
    it took. On time-out, the members' last log lines in the error."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            tails = "\n".join(
                f"--- {m.h.name}:\n" + "\n".join(m.text().splitlines()[-15:]) for m in members
            )
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{tails}")
        time.sleep(0.2)
    return time.monotonic() - t0


def formed(bed: NetBed, n: int, graphs: dict[str, str] | None = None) -> tuple[list[Member], Path]:
    """h0 forms the cluster; a token; the others start at the same instant.
    `graphs`: the graph text of some hosts, by name (the others: the empty graph)."""
    graphs = graphs or {}
    members = [Member(bed, h, graph=graphs.get(h.name)) for h in bed.hosts[:n]]
    seed = members[0]
    seed.start()
    wait_until(lambda: roles(seed.rows()) == {"h0": "voter"}, 60, "the seed's cluster", [seed])
    token = seed.token(bed.tmp / "join.token")
    for m in members[1:]:
        m.start([bed.hosts[0]], token)
    return members, token


def settled(
    members: Sequence[Member], voters: int, standbys: int, ask: Member | None = None
) -> Callable[[], bool]:
    """True when `ask` (default: the first member) lists exactly `members`, with
    `voters` healthy voters and `standbys` standbys (no learner)."""
    names = {m.h.name for m in members}
    asker = ask or members[0]

    def ok() -> bool:
        rows = asker.rows()
        r = roles(rows)
        return (
            set(r) == names
            and sum(1 for v in r.values() if v == "voter") == voters
            and sum(1 for v in r.values() if v == "standby") == standbys
            and all(row["healthy"] for row in rows if row["role"] == "voter")
        )

    return ok


def leader(rows: list[dict[str, Any]]) -> str | None:
    return next((r["name"] for r in rows if r["leader"]), None)


def with_role(rows: list[dict[str, Any]], role: str) -> list[str]:
    return sorted(r["name"] for r in rows if r["role"] == role)


def all_client_urls(bed: NetBed) -> str:
    return ",".join(client_url(h) for h in bed.hosts)


def client_argv(h: NetHost, command: str, *args: str) -> list[str]:
    """tests/kit/cluster_client.py inside `h`, with `h`'s TLS files, every host's URL."""
    return [
        sys.executable,
        "-m",
        "tests.kit.cluster_client",
        command,
        "--tls",
        str(h.state_dir / "cluster"),
        "--endpoints",
        all_client_urls(h.bed),
        *args,
    ]


def world_put_raw(h: NetHost, items: Sequence[tuple[str, bytes]]) -> None:
    """Write `items` to the cluster's World as a client holding `h`'s TLS files."""
    body = json.dumps([[k, base64.b64encode(v).decode()] for k, v in items])
    r = subprocess.run(
        h._enter(tuple(client_argv(h, "put"))),
        input=body,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


class CounterWriter:
    """The counter writer (tests/kit/cluster_client.py `count`) on host `h`."""

    def __init__(self, h: NetHost, every: float = 0.02) -> None:
        self.h = h
        self.every = every
        self.journal = h.bed.tmp / f"counter-{h.name}.jsonl"
        self.log = h.bed.tmp / f"counter-{h.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = client_argv(
            self.h, "count", "--journal", str(self.journal), "--every", str(self.every)
        )
        self.proc = self.h.spawn(*argv, log=self.log, env=env())

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        code = self.proc.wait(60)
        self.proc = None
        assert code == 0, f"the writer exited {code}: {self.log.read_text(errors='replace')}"

    def records(self) -> list[dict[str, Any]]:
        try:
            text = self.journal.read_text()
        except FileNotFoundError:
            return []
        # the last line may be half written while the writer runs
        return [json.loads(ln) for ln in text.splitlines() if ln.endswith("}")]

    def acks(self) -> int:
        return sum(1 for r in self.records() if "ack" in r)

    def grew(self, by: int) -> Callable[[], bool]:
        """A condition: `by` more acknowledged writes than now."""
        target = self.acks() + by
        return lambda: self.acks() >= target

    def read(self, since: int = 0) -> dict[str, Any]:
        argv = client_argv(self.h, "read", "--since", str(since))
        r = self.h.run(*argv, env=env(), timeout=90)
        return dict(json.loads(r.stdout))

    def verify(self) -> CounterReport:
        """Once stopped: every acknowledged increment is in the counter's history,
        each applied once; the report of what the writer saw."""
        assert self.proc is None, "stop the writer first"
        recs = self.records()
        assert recs, "the writer journalled nothing"
        assert recs[-1].get("event") == "stop", "the writer did not end cleanly"
        odd = [r for r in recs if "odd" in r]
        assert not odd, f"the counter went where the writer never put it: {odd[:5]}"
        acks = [(r["ack"], r["rev"], r["t"]) for r in recs if "ack" in r]
        assert acks, "no write was acknowledged"
        values = [a[0] for a in acks]
        assert values == sorted(set(values)), "acknowledged values repeat or go back"
        landed = [r["landed"] for r in recs if "landed" in r]
        applied = sorted(values + landed)
        assert applied == list(range(1, applied[-1] + 1)), (
            "the values known applied are not 1, 2, 3, ... each once"
        )
        last = applied[-1]
        got = self.read(since=acks[0][1])
        final = got["value"]
        # An unacknowledged write in flight when the writer stopped (its outcome
        # unknown: a txn whose connection broke) may have landed: final = last + 1
        # then, and only for a value the writer did try to write.
        tried = {r["v"] for r in recs if r.get("op") == "txn"}
        assert final == last or (final == last + 1 and final in tried), (
            f"final counter {final}, last acknowledged or found applied {last}"
        )
        # etcd's own history of the key: each value once, in order, and every
        # acknowledged write at the revision the writer was told
        history = got["history"]
        assert [v for v, _ in history] == list(range(values[0], final + 1)), (
            f"the counter's history is not each value once from {values[0]} to {final}"
        )
        at = {v: rev for v, rev in history}
        wrong = [(v, rev) for v, rev, _ in acks if at.get(v) != rev]
        assert not wrong, f"acknowledged writes not in the history as acknowledged: {wrong[:5]}"
        gaps = [b[2] - a[2] for a, b in itertools.pairwise(acks)]
        return CounterReport(
            acks=len(acks),
            landed=len(landed),
            errors=sum(1 for r in recs if "err" in r),
            final=final,
            max_gap=max(gaps, default=0.0),
        )


@dataclass(frozen=True)
class CounterReport:
    acks: int
    landed: int
    errors: int
    final: int
    #: the longest time between two acknowledged writes (s)
    max_gap: float
