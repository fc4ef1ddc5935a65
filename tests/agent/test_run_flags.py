"""`run`'s flags that would do something absurd are refused before anything is
created: one line naming the flag and what is valid, exit 2 (issue 23 item 6)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import EVERGRAPH, REPO

HELLO = REPO / "examples" / "hello.yaml"


def _run(cwd: Path, *args: str, graph: Path = HELLO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EVERGRAPH, "run", str(graph), *(("--converged-exit",) if graph == HELLO else ()), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.parametrize(
    ("args", "flag", "says"),
    [
        (["--state-dir", ""], "--state-dir", "empty"),
        (["--state-dir", "/tmp/" + "a" * 6000], "--state-dir", "at most 4095"),
        (["--state-dir", "/tmp/" + "b" * 300], "--state-dir", "at most 255"),
        (["--converged-status-file", "{tmp}/missing/s"], "--converged-status-file", "create"),
        (["--graphviz", "/tmp/" + "d" * 300 + "/g.dot"], "--graphviz", "at most 255"),
        (["--etcd", "embedded", "--world", "memory"], "--world", "not a memory World"),
        (["--world-db", "/tmp/" + "c" * 6000], "--world-db", "at most 4095"),
        (["--sema", "99999999999"], "--sema", "1000000"),
    ],
)
def test_absurd_run_flags_are_refused(
    tmp_path: Path, args: list[str], flag: str, says: str
) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    state = ["--state-dir", str(tmp_path / "state")] if "--state-dir" not in args else []
    # (a missing directory inside the test's own: an old agent would create it)
    r = _run(work, *state, *(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert r.returncode == 2, r.stderr
    assert flag in r.stderr, r.stderr
    assert says in r.stderr, r.stderr
    # one line (click's own refusals add its usage lines), never a path of 6000 bytes
    if flag != "--sema":
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert len(r.stderr) < 400, r.stderr
    assert list(work.iterdir()) == []  # nothing made in the current directory
    assert not (tmp_path / "state").exists()
    assert not (tmp_path / "missing").exists()


@pytest.mark.slow
def test_max_runtime_holds_while_a_huge_graph_is_still_loading(tmp_path: Path) -> None:
    """900,000 resources take seconds to load and group, in code that cannot be
    interrupted: the run still ends about a second past --max-runtime, cut short
    (exit 1, saying why), not seconds later with status 0."""
    g = tmp_path / "big.yaml"
    with open(g, "w") as f:
        f.write("graph: big\nresources:\n  noop:\n")
        f.writelines(f"  - name: n{i:x}\n" for i in range(900_000))  # (< 16 MiB)
    r = _run(tmp_path, "--state-dir", str(tmp_path / "s"), "--max-runtime", "1", graph=g)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "max runtime of 1" in r.stderr
    assert "exit status 1" in r.stderr
    # cut short while loading: the graph never ran (no timing claim: a loaded
    # machine may take longer to start; what matters is that the load was cut)
    assert "converged" not in r.stderr, r.stderr[-2000:]
    assert "vertices" not in r.stderr, r.stderr[-2000:]
