"""Agents that carry etcd members, on the hosts of a NetBed (tests/kit/netbed.py):
start, stop, kill -9, ask the cluster what it looks like, make tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.kit.netbed import NetBed, NetHost

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

    def __init__(self, bed: NetBed, h: NetHost, timeout: float = 3.0) -> None:
        self.bed = bed
        self.h = h
        self.timeout = timeout
        self.log = bed.tmp / f"{h.name}.log"
        self.graph = bed.tmp / "graph.yaml"
        self.graph.write_text(GRAPH)
        self.proc: subprocess.Popen[bytes] | None = None

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
        self.proc = self.h.spawn(*self.argv(seeds, token, *extra), log=self.log, env=env())

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
