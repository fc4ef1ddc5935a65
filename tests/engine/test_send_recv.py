"""send/recv edges: values flow from a sender to a receiver's parameter."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Agent, run_cli, wait_for


def graph(tmp_path: Path, extra: str = "") -> str:
    src, trigger, out = tmp_path / "src", tmp_path / "trigger", tmp_path / "out.txt"
    return f"""graph: sr
resources:
  exec:
  - name: build
    cmd: "cat {src}"
    watchcmd: "tail -n0 -F {trigger}"
  file:
  - name: out
    path: {out}
    mode: "0600"
{extra}edges:
- from: {{kind: exec, name: build, send: stdout}}
  to: {{kind: file, name: out, recv: content}}
"""


def test_stdout_becomes_content_and_follows_changes(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "src").write_text("v1\n")
    (tmp_path / "trigger").write_text("")
    out = tmp_path / "out.txt"
    g = tmp_path / "g.yaml"
    g.write_text(graph(tmp_path))
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    assert out.read_text() == "v1\n"
    # a new value is sent, the receiver re-validated and re-applied
    (tmp_path / "src").write_text("v2\n")
    with open(tmp_path / "trigger", "a") as fh:
        fh.write("x\n")
    wait_for(lambda: out.read_text() == "v2\n", what="new value received")
    # drift of the receiver is repaired to the received value, not the YAML one
    out.write_text("drift\n")
    wait_for(lambda: out.read_text() == "v2\n", what="drift repaired to received value")
    mtime = out.stat().st_mtime_ns
    converged = agent.converged_count()
    # a swap that leaves both unchanged keeps the receiver with its value
    g.write_text(graph(tmp_path, extra="  noop:\n  - name: extra\n"))
    agent.wait_converged(count=converged + 1)
    assert out.read_text() == "v2\n"
    assert out.stat().st_mtime_ns == mtime
    assert agent.stop() == 0


BAD_EDGES = {
    "type-mismatch": (
        "{kind: exec, name: b, send: stdout}",
        "{kind: exec, name: c, recv: env}",
        "exec[b].stdout -> exec[c].env: type mismatch: exec.stdout is str, exec.env takes",
    ),
    "unknown-send": (
        "{kind: exec, name: b, send: stdot}",
        "{kind: exec, name: c, recv: cmd}",
        "exec sends no 'stdot' (it sends: output, stderr, stdout)",
    ),
    "unknown-recv": (
        "{kind: exec, name: b, send: stdout}",
        "{kind: exec, name: c, recv: comand}",
        "exec has no parameter 'comand'",
    ),
    "one-sided": (
        "{kind: exec, name: b, send: stdout}",
        "{kind: exec, name: c}",
        "needs both `from.send:` and `to.recv:`",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_EDGES))
def test_bad_send_recv_edges_are_load_errors(tmp_path: Path, case: str) -> None:
    frm, to, needle = BAD_EDGES[case]
    marker = tmp_path / "ran"
    g = tmp_path / "g.yaml"
    g.write_text(
        f"""graph: bad
resources:
  exec:
  - {{name: b, cmd: "touch {marker}"}}
  - {{name: c, cmd: "touch {marker}"}}
edges:
- from: {frm}
  to: {to}
"""
    )
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 2
    assert f"{g}:7:" in r.stderr, r.stderr
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not marker.exists()
