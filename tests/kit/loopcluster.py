"""Agents that carry etcd members on loopback (one machine, no namespaces): plain
http URLs on 127.0.0.1, a port block per agent (client P, peer P+1, join P+2),
fast raft timing; the `evergraph cluster` commands run against a member."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from evergraph.world.etcd_server import free_port
from tests.conftest import EVERGRAPH, Agent, wait_for
from tests.kit.http import api_url

#: an empty graph: the agents only carry the World
GRAPH = "resources: []\n"


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_block() -> int:
    """A client port P with P+1 (peer) and P+2 (join) free too."""
    while True:
        p = free_port()
        if p + 2 < 65536 and _free(p + 1) and _free(p + 2):
            return p


def cli(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EVERGRAPH, *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


class LoopMember:
    """`run --etcd embedded --http 127.0.0.1:0` as host `name`, on its own ports."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.name = name
        self.state = tmp / name
        self.graph = tmp / "graph.yaml"
        tmp.mkdir(parents=True, exist_ok=True)
        self.graph.write_text(GRAPH)
        port = port_block()
        self.client_url = f"http://127.0.0.1:{port}"
        self.peer_url = f"http://127.0.0.1:{port + 1}"
        self.agent: Agent | None = None

    def argv(self, seeds: Sequence[LoopMember] = (), token: Path | None = None) -> list[str]:
        a = [
            "--etcd",
            "embedded",
            "--hostname",
            self.name,
            "--etcd-client-url",
            self.client_url,
            "--etcd-peer-url",
            self.peer_url,
            "--etcd-member-timeout",
            "2",
            "--http",
            "127.0.0.1:0",
            "-v",
        ]
        if seeds:
            a += ["--seeds", ",".join(s.client_url for s in seeds)]
        if token is not None:
            a += ["--join-token-file", str(token)]
        return a

    def start(self, seeds: Sequence[LoopMember] = (), token: Path | None = None) -> LoopMember:
        self.agent = Agent(self.graph, self.state, *self.argv(seeds, token))
        return self

    def log(self) -> str:
        return (self.state / "agent.log").read_text(errors="replace")

    def cluster(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`evergraph cluster ARGS --state-dir` this member's."""
        return cli("cluster", *args, "--state-dir", self.state)

    def rows(self) -> list[dict[str, Any]]:
        r = self.cluster("--json")
        return list(json.loads(r.stdout)) if r.returncode == 0 else []

    def roles(self) -> dict[str, str]:
        return {r["name"]: r["role"] for r in self.rows()}

    def token(self, path: Path) -> Path:
        r = self.cluster("token")
        assert r.returncode == 0, r.stderr
        path.write_text(r.stdout)
        return path

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of its /metrics: name -> value."""
        assert self.agent is not None
        r = httpx.get(api_url(self.agent) + "/metrics", timeout=10)
        assert r.status_code == 200
        return {
            s.name: s.value
            for fam in text_string_to_metric_families(r.text)
            for s in fam.samples
            if not s.labels
        }

    def kill9(self) -> None:
        assert self.agent is not None
        os.kill(self.agent.proc.pid, signal.SIGKILL)
        self.agent.proc.wait()

    def stop(self) -> None:
        if self.agent is not None:
            self.agent.stop()


def wait_roles(m: LoopMember, want: dict[str, str], timeout: float = 60) -> None:
    """Until `evergraph cluster` on `m` lists exactly these names in these roles."""
    seen: list[dict[str, str]] = []

    def ok() -> bool:
        if m.agent is not None and m.agent.proc.poll() is not None:
            raise AssertionError(f"{m.name} exited early:\n{m.log()[-3000:]}")
        seen[:] = [m.roles()]
        return seen[0] == want

    try:
        wait_for(ok, timeout, f"roles {want}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen {seen}\n{m.log()[-3000:]}") from None


@contextlib.contextmanager
def loop_members(tmp: Path) -> Iterator[Callable[[str], LoopMember]]:
    """`make(name)`: a LoopMember (not started); every one is stopped at the end.
    (The caller sets EVERGRAPH_ETCD_TIMING=fast in the environment the agents get.)"""
    made: list[LoopMember] = []

    def make(name: str) -> LoopMember:
        m = LoopMember(tmp, name)
        made.append(m)
        return m

    try:
        yield make
    finally:
        for m in made:  # SIGTERM to all first: they stop side by side
            if m.agent is not None and m.agent.proc.poll() is None:
                m.agent.proc.send_signal(signal.SIGTERM)
        for m in made:
            m.stop()
