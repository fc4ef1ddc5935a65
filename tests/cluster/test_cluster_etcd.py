"""Three etcd members and three agents on loopback: exports across a real cluster."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from evergraph.world.etcd import EtcdKV
from evergraph.world.etcd_server import EtcdServer
from tests.conftest import REPO, Agent, run_cli, wait_for

pytestmark = pytest.mark.slow


def raw(urls: list[str], prefix: str) -> list[tuple[str, bytes]]:
    async def main() -> list[tuple[str, bytes]]:
        async with EtcdKV(urls) as kv:
            items, _ = await kv.range(prefix)
            return [(i.key, i.value) for i in items]

    return asyncio.run(main())


def test_exports_across_three_etcd_members_and_three_agents(
    tmp_path: Path, shm: Path, servers: list[EtcdServer], agents
) -> None:  # type: ignore[no-untyped-def]
    members = EtcdServer.cluster(3, shm)
    servers.extend(members)
    EtcdServer.start_all(members)
    wait_for(lambda: any(m.is_leader() for m in members), what="an etcd leader")
    urls = [m.client_url for m in members]
    seeds = ("--seeds", ",".join(urls))
    target, at_c = tmp_path / "b" / "app.conf", tmp_path / "c" / "app.conf"
    ga, gb, gc = (tmp_path / f"{h}.yaml" for h in "abc")

    def export(content: str) -> None:
        ga.write_text(
            f"graph: a\nresources:\n  file:\n  - name: {target}\n"
            f"    content: {json.dumps(content)}\n    meta: {{export: [hostb], hidden: true}}\n"
        )

    gb.write_text("graph: b\nresources: {}\ncollect:\n- {kind: file, filter: {host: hosta}}\n")
    gc.write_text("graph: c\nresources: {}\ncollect:\n- {kind: file}\n")
    export("v1-plaintext-marker\n")
    b: Agent = agents(gb, tmp_path / "sb", "--hostname", "hostb", *seeds)
    c: Agent = agents(gc, tmp_path / "sc", "--hostname", "hostc", *seeds)
    b.wait_converged()
    c.wait_converged()
    a: Agent = agents(ga, tmp_path / "sa", "--hostname", "hosta", *seeds)
    a.wait_converged()
    wait_for(
        lambda: target.exists() and target.read_text() == "v1-plaintext-marker\n", what="B applied"
    )
    records = [r for r in raw(urls, "exported/") if not r[0].endswith("/index")]
    assert len(records) == 1
    assert b"v1-plaintext-marker" not in records[0][1]  # sealed to B

    # one etcd member dies (the leader, the hardest case): exports keep flowing
    leader = next(m for m in members if m.is_leader())
    leader.kill()
    export("v2\n")
    wait_for(lambda: target.read_text() == "v2\n", timeout=30, what="change through 2 members")

    # withdrawal
    ga.write_text("graph: a\nresources: {}\n")
    live = [m.client_url for m in members if m is not leader]
    wait_for(lambda: raw(live, "exported/") == [], timeout=30, what="export withdrawn")
    assert not at_c.exists()

    # a killed agent's member record expires within its TTL (10 s)
    assert {k for k, _ in raw(live, "members/")} == {
        "members/hosta",
        "members/hostb",
        "members/hostc",
    }
    os.kill(a.proc.pid, signal.SIGKILL)
    a.proc.wait()
    wait_for(
        lambda: {k for k, _ in raw(live, "members/")} == {"members/hostb", "members/hostc"},
        timeout=15,
        what="hosta's record expired",
    )
    r = run_cli("members", "--seeds", ",".join(live))
    assert r.returncode == 0, r.stderr
    assert [ln.split("\t")[0] for ln in r.stdout.splitlines()] == ["hostb", "hostc"]
    for ag in (b, c):
        assert ag.stop() == 0


def test_run_with_embedded_etcd_starts_and_stops_it(tmp_path: Path) -> None:
    state = tmp_path / "s"
    r = run_cli(
        "run",
        REPO / "examples" / "hello.yaml",
        "--state-dir",
        state,
        "--etcd",
        "embedded",
        "--converged-exit",
    )
    assert r.returncode == 0, r.stderr
    assert (state / "etcd").is_dir()  # its data lives under the state dir
    mine = [
        p
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and str(state / "etcd").encode() in _cmdline(p)
    ]
    assert mine == []  # stopped with the agent


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""
