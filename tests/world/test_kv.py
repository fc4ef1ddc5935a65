"""kv: a World key written, read, sent, watched; bad parameters."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import Agent, run_cli, wait_for


def world(tmp_path: Path, *args: str) -> str:
    r = run_cli("world", *args, "--state-dir", tmp_path / "s")
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_kv_writes_repairs_and_sends(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "motd"
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: kv\nresources:\n  kv:\n"
        "  - {name: owned, value: '42'}\n"
        "  - {name: motd, readonly: true}\n"  # sends what others store
        "  - {name: ver, value: '1.0', mapped: true}\n"
        f"  file:\n  - {{name: {out}}}\n"
        "edges:\n- {from: {kind: kv, name: motd, send: value}, to: {kind: file, name: "
        f"{out}, recv: content}}}}\n"
    )
    world(tmp_path, "put", "kv/motd", "hello")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "--hostname", "h1")
    assert r.returncode == 0, r.stderr
    assert world(tmp_path, "get", "kv/owned") == "42\n"
    assert world(tmp_path, "get", "kv/ver/h1") == "1.0\n"
    assert out.read_text() == "hello"
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "--hostname", "h1")
    assert ": applied" not in r.stderr  # second run clean

    agent: Agent = agents(g, tmp_path / "s", "--hostname", "h1")
    agent.wait_converged()
    world(tmp_path, "put", "kv/owned", "7")  # drift by another writer: repaired
    wait_for(lambda: world(tmp_path, "get", "kv/owned") == "42\n", what="kv repaired")
    world(tmp_path, "put", "kv/motd", "changed")  # a read key: its value flows on
    wait_for(lambda: out.read_text() == "changed", what="received value applied")
    assert agent.stop() == 0


def test_skiplessthan_keeps_a_larger_value(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text("graph: kv\nresources:\n  kv:\n  - {name: gen, value: '5', skiplessthan: true}\n")
    world(tmp_path, "put", "kv/gen", "9")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 0, r.stderr
    assert world(tmp_path, "get", "kv/gen") == "9\n"
    world(tmp_path, "put", "kv/gen", "3")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert world(tmp_path, "get", "kv/gen") == "5\n"


def test_bad_kv_params(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    for body, where in [
        ("{name: x, key: /abs}", "kv[x].key"),
        ("{name: y, value: abc, skiplessthan: true}", "kv[y].value"),
    ]:
        g.write_text(f"graph: kv\nresources:\n  kv:\n  - {body}\n")
        r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
        assert r.returncode == 2
        assert where in r.stderr
    # nothing was written: bad input did not even create the state dir (and a
    # read-only command does not create an empty World to answer from)
    r = run_cli("world", "get", "kv/x", "--state-dir", tmp_path / "s")
    assert r.returncode == 2
    assert "no such state directory" in r.stderr
