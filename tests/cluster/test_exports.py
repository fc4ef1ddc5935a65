"""Exported resources between real agents sharing one sqlite World on this host."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import Agent, run_cli, wait_for


def world_value(db: Path, prefix: str) -> list[tuple[str, bytes]]:
    """The records under `prefix` (not the exporters' indexes)."""
    with sqlite3.connect(db) as c:
        return [
            (k, bytes(v))
            for k, v in c.execute("SELECT key, value FROM kv WHERE key LIKE ?", (prefix + "%",))
            if not k.endswith("/index")
        ]


def test_directed_export_is_applied_by_its_target_only(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    db = tmp_path / "world.sqlite"
    target = tmp_path / "on-b" / "from-a.conf"
    seen_by_c = tmp_path / "on-c" / "from-a.conf"
    a_graph, b_graph, c_graph = (tmp_path / f"{h}.yaml" for h in "abc")

    def export(content: str) -> None:
        a_graph.write_text(
            "graph: a\nresources:\n  file:\n"
            f"  - name: {target}\n    content: {json.dumps(content)}\n"
            "    meta: {export: [hostb], hidden: true}\n"
        )

    export("secret-token-1\n")
    b_graph.write_text(
        "graph: b\nresources:\n  noop:\n  - name: b\ncollect:\n"
        "- {kind: file, filter: {host: hosta}}\n"
    )
    c_graph.write_text("graph: c\nresources:\n  noop:\n  - name: c\ncollect:\n- {kind: file}\n")
    common = ("--world-db", str(db))
    b: Agent = agents(b_graph, tmp_path / "sb", "--hostname", "hostb", *common)
    b.wait_converged()  # B's keys are in the World before A seals to them
    c: Agent = agents(c_graph, tmp_path / "sc", "--hostname", "hostc", *common)
    c.wait_converged()
    a: Agent = agents(a_graph, tmp_path / "sa", "--hostname", "hosta", *common)
    a.wait_converged()
    wait_for(
        lambda: target.exists() and target.read_text() == "secret-token-1\n",
        what="export applied on B",
    )
    # the record is sealed: the plaintext is nowhere in the World
    records = world_value(db, "exported/")
    assert [k for k, _ in records] == [
        f"exported/hostb/hosta/file/{str(target).replace('/', '%2F')}"
    ]
    assert b"secret-token-1" not in records[0][1]
    # a change propagates
    export("secret-token-2\n")
    wait_for(lambda: target.read_text() == "secret-token-2\n", what="changed export applied")
    # withdrawal: the resource leaves B's graph (the file stays, as with any removed resource)
    a_graph.write_text("graph: a\nresources:\n  noop:\n  - name: a\n")
    wait_for(lambda: world_value(db, "exported/") == [], what="export withdrawn")
    wait_for(lambda: "collected exports changed" in b.log.read_text(), what="B swapped")
    # C collected nothing, and applied nothing
    assert not seen_by_c.exists()
    assert "file[" not in c.log.read_text()
    for ag in (a, b, c):
        assert ag.stop() == 0


def test_forged_and_garbage_records_are_rejected(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    db = tmp_path / "world.sqlite"
    out = tmp_path / "forged"
    g = tmp_path / "b.yaml"
    g.write_text("graph: b\nresources:\n  noop:\n  - name: b\ncollect:\n- {kind: file}\n")
    b: Agent = agents(g, tmp_path / "sb", "--hostname", "hostb", "--world-db", str(db))
    b.wait_converged()
    key = f"exported/hostb/mallory/file/{str(out).replace('/', '%2F')}"
    r = run_cli(
        "world",
        "put",
        "--world-db",
        db,
        "--state-dir",
        tmp_path / "cli",
        key + "-2",
        "garbage \xff {",
    )
    assert r.returncode == 0, r.stderr
    forged = (
        '{"v":1,"src":"mallory","to":"hostb","kind":"file","name":"' + str(out) + '",'
        '"sealed":true,"payload":"AAAA","sig":"AAAA"}'
    )
    r = run_cli("world", "put", "--world-db", db, "--state-dir", tmp_path / "cli", key, forged)
    assert r.returncode == 0, r.stderr
    # mallory's key is unknown: both records wait for it, nothing is applied
    wait_for(
        lambda: b.log.read_text().count("waits for the key of its exporter mallory") >= 2,
        what="both waiting for mallory's key",
    )
    # once mallory has a key, the garbage and the bad signature are refused
    from evergraph.cluster.hostkeys import HostKeys

    mk = HostKeys(tmp_path / "mallory")
    rec = json.dumps({"host": "mallory", "public": mk.public, "verify": mk.verify})
    r = run_cli("world", "put", "--world-db", db, "hostkeys/mallory", rec)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: b.log.read_text().count("rejected export") >= 2, what="both rejected")
    log = b.log.read_text()
    assert "not an export record" in log
    assert "bad signature: not signed by 'mallory'" in log
    assert not out.exists()
    assert b.proc.poll() is None  # still running
    assert b.stop() == 0


@pytest.mark.slow
def test_members_register_and_a_killed_agent_vanishes_within_its_ttl(
    tmp_path: Path, agents
) -> None:  # type: ignore[no-untyped-def]
    db = tmp_path / "world.sqlite"
    g = tmp_path / "g.yaml"
    g.write_text("graph: m\nresources:\n  noop:\n  - name: m\n")
    a: Agent = agents(g, tmp_path / "sa", "--hostname", "alpha", "--world-db", str(db))
    b: Agent = agents(g, tmp_path / "sb", "--hostname", "beta", "--world-db", str(db))
    a.wait_converged()
    b.wait_converged()

    def members() -> list[str]:
        r = run_cli("members", "--world-db", db, "--state-dir", tmp_path / "cli")
        assert r.returncode == 0, r.stderr
        return [line.split("\t")[0] for line in r.stdout.splitlines()]

    assert members() == ["alpha", "beta"]
    os.kill(a.proc.pid, signal.SIGKILL)  # no goodbye: only the lease's expiry removes it
    a.proc.wait()
    # within the default TTL (10 s) plus a sweep
    wait_for(lambda: members() == ["beta"], timeout=12, what="alpha's record expired")
    # a clean stop marks the record stopped; it (and the exports) expire with the
    # lease, so a restart within the TTL takes them back without a flap
    assert b.stop() == 0
    r = run_cli("members", "--world-db", db)
    assert [line.split("\t")[:2] for line in r.stdout.splitlines()] == [["beta", "stopped"]]
