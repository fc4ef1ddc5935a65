"""value: holds any YAML value and sends it over send/recv edges, chained through
another value into a real file's content; the file follows a changed value on a live
graph swap and is repaired from the value after drift; a value of the wrong type for
its receiver fails that receiver (exit 1) naming the parameter; bad input (exit 2),
nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from evergraph.testing.kinds import graph_error
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.kinds import refused_end_to_end


def graph(g: Path, out: Path, any_: str) -> Path:
    g.write_text(
        f"""graph: v
resources:
  value:
  - {{name: src, any: {any_}}}
  - {{name: relay}}
  file:
  - {{name: {out}}}
edges:
- from: {{kind: value, name: src, send: any}}
  to: {{kind: value, name: relay, recv: any}}
- from: {{kind: value, name: relay, send: any}}
  to: {{kind: file, name: {out}, recv: content}}
"""
    )
    return g


def test_value_flows_to_a_file_and_follows_changes(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out.txt"
    g = graph(tmp_path / "g.yaml", out, '"v1\\n"')
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    assert out.read_text() == "v1\n"
    # the graph changes live: the new value is sent on down the chain
    graph(g, out, '"v2\\n"')
    wait_for(lambda: out.read_text() == "v2\n", what="the file follows the value")
    # drift of the receiver: repaired with the value it received
    out.write_text("drift\n")
    wait_for(lambda: out.read_text() == "v2\n", what="repaired from the received value")
    assert agent.stop() == 0
    log = agent.log.read_text()
    assert "value[relay]: received any='v2\\n'" in log, log
    # re-check: all clean (value never changes anything itself)
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 0, r.stderr
    assert ": applied" not in r.stderr


def test_any_value_types_pass_through_a_chain(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    # a mapping through the relay, then on to a text parameter: refused when it arrives
    g = graph(tmp_path / "g.yaml", out, "{a: [1, 2]}")
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 1
    assert f"file[{out}]: received content: Expected `str | null`, got `object`" in r.stderr
    assert "value[relay]: received any={'a': [1, 2]}" in r.stderr
    assert not out.exists()


BAD_INPUT = [
    ("  value:\n  - {name: v, value: 1}\n", "value[v].value: unknown parameter"),
    ("  value:\n  - {name: v, any: 1, meta: {reverse: true}}\n", "value resources cannot be"),
    (
        "  value:\n  - {name: v, any: 1}\n  file:\n  - {name: F}\n"
        "edges:\n- from: {kind: value, name: v, send: value}\n"
        "  to: {kind: file, name: F, recv: content}\n",
        "value sends no 'value' (it sends: any)",
    ),
]


@pytest.mark.parametrize(("body", "needle"), BAD_INPUT)
def test_bad_input_exit_2_nothing_written(tmp_path: Path, body: str, needle: str) -> None:
    g = tmp_path / "g.yaml"
    g.write_text("graph: v\nresources:\n" + body.replace("F", str(tmp_path / "out")))
    assert needle in graph_error(g)  # as `evergraph check` loads it, in process
    if (body, needle) == BAD_INPUT[0]:  # and one of them end to end: exit 2
        refused_end_to_end(g, needle, tmp_path / "s")
    assert not (tmp_path / "out").exists()
