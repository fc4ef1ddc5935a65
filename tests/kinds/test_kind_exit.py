"""exit: the agent exits with the code once the graph reaches the resource (its
parents clean), on a real `evergraph run` that would otherwise watch for ever; added
live by a graph change; held back by a failing parent; under noop only reported; bad
input (exit 2), the parent not applied."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from evergraph.testing.kinds import graph_error
from tests.conftest import EVERGRAPH, Agent, wait_for
from tests.kit.kinds import refused_end_to_end


def write(g: Path, body: str, edges: str = "") -> Path:
    g.write_text("graph: x\nresources:\n" + body + edges)
    return g


def run(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EVERGRAPH, "run", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


EDGE = "edges:\n- from: {kind: file, name: F}\n  to: {kind: exit, name: done}\n"


def test_exits_with_the_code_once_its_parent_is_clean(tmp_path: Path) -> None:
    f = tmp_path / "made"
    g = write(
        tmp_path / "g.yaml",
        f"  file:\n  - {{name: {f}, content: x}}\n"
        "  exit:\n  - {name: done, code: 7, message: all set}\n",
        EDGE.replace("F", str(f)),
    )
    r = run(g, "--state-dir", tmp_path / "s")  # watching: only the exit ends it
    assert r.returncode == 7, r.stderr
    assert f.read_text() == "x"  # the parent ran first
    assert "exit[done]: all set" in r.stderr
    assert "exit[done]: asks to exit with status 7: stopping" in r.stderr
    assert r.stderr.index(f"file[{f}]: applied") < r.stderr.index("exit[done]: all set")


def test_added_to_a_running_graph(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    g = write(tmp_path / "g.yaml", "  noop:\n  - {name: n}\n")
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    write(g, "  noop:\n  - {name: n}\n  exit:\n  - {name: e, code: 4}\n")
    wait_for(lambda: agent.proc.poll() is not None, what="the agent exits")
    assert agent.stop() == 4


def test_a_failing_parent_holds_it_back(tmp_path: Path) -> None:
    g = write(
        tmp_path / "g.yaml",
        "  exec:\n  - {name: bad, cmd: 'false'}\n  exit:\n  - {name: done, code: 7}\n",
        "edges:\n- from: {kind: exec, name: bad}\n  to: {kind: exit, name: done}\n",
    )
    r = run(g, "--state-dir", tmp_path / "s", "--max-runtime", "1")
    assert r.returncode == 1, r.stderr  # the failure's status: exit was never reached
    assert "asks to exit" not in r.stderr


def test_noop_only_reports_it(tmp_path: Path) -> None:
    g = write(tmp_path / "g.yaml", "  exit:\n  - {name: done, code: 9}\n")
    r = run(g, "--state-dir", tmp_path / "s", "--noop", "--converged-exit")
    assert r.returncode == 3, r.stderr  # would change
    assert "exit[done]: would change" in r.stderr
    assert "asks to exit" not in r.stderr


BAD_INPUT = [
    ("  exit:\n  - {name: e, code: 126}\n", "exit[e].code: 126 is not between 0 and 125"),
    ("  exit:\n  - {name: e, code: -1}\n", "exit[e].code: -1 is not between 0 and 125"),
    ("  exit:\n  - {name: e, code: '3'}\n", "exit[e].code"),
    ("  exit:\n  - {name: e, message: [a]}\n", "exit[e].message"),
    ("  exit:\n  - {name: e, meta: {reverse: true}}\n", "exit resources cannot be reversed"),
]


@pytest.mark.parametrize(("body", "needle"), BAD_INPUT)
def test_bad_input_exit_2_nothing_applied(tmp_path: Path, body: str, needle: str) -> None:
    f = tmp_path / "made"
    g = write(tmp_path / "g.yaml", f"  file:\n  - {{name: {f}, content: x}}\n" + body)
    assert needle in graph_error(g)  # as `evergraph check` loads it, in process
    if (body, needle) == BAD_INPUT[0]:  # and one of them end to end: exit 2
        refused_end_to_end(g, needle, tmp_path / "s")
    assert not f.exists()
