"""`run --noop --converged-exit` answers "would anything change?" by its exit status:
0 nothing would, 3 something would, 1 a resource failed (2 stays bad input)."""

from __future__ import annotations

from pathlib import Path

import evergraph
from tests.conftest import run_cli


def graph(tmp_path: Path, body: str) -> Path:
    g = tmp_path / "g.yaml"
    g.write_text(f"graph: g\nresources:\n{body}")
    return g


def run(g: Path, state: Path, *extra: str) -> tuple[int, str]:
    r = run_cli("run", g, "--state-dir", state, *extra)
    return r.returncode, r.stderr


def test_noop_exits_3_while_something_would_change_then_0(tmp_path: Path) -> None:
    f, state = tmp_path / "f", tmp_path / "s"
    g = graph(tmp_path, f'  file:\n  - {{name: f, path: {f}, content: "x\\n"}}\n')
    rc, err = run(g, state, "--noop", "--converged-exit")
    assert rc == 3, err
    assert "file[f]: would change (noop)" in err
    assert not f.exists()
    rc, err = run(g, state, "--noop", "--no-watch")  # --no-watch exits once converged too
    assert rc == 3, err
    rc, err = run(g, state, "--converged-exit")  # a real run that changes: 0
    assert rc == 0, err
    assert f.read_text() == "x\n"
    rc, err = run(g, state, "--noop", "--converged-exit")
    assert rc == 0, err
    assert "would change (noop)" not in err
    f.write_text("drift\n")
    rc, err = run(g, state, "--noop", "--converged-exit")
    assert rc == 3, err


def test_a_failure_is_1_even_when_something_would_change(tmp_path: Path) -> None:
    g = graph(
        tmp_path,
        f"  file:\n  - {{name: ok, path: {tmp_path}/ok, content: x}}\n"
        f"  - {{name: bad, path: {tmp_path}/bad, owner: no-such-user-egtest}}\n",
    )
    rc, err = run(g, tmp_path / "s", "--noop", "--converged-exit")
    assert rc == 1, err
    assert "no such user 'no-such-user-egtest'" in err


def test_bad_input_stays_2(tmp_path: Path) -> None:
    g = graph(tmp_path, "  file:\n  - {name: f, path: relative}\n")
    rc, err = run(g, tmp_path / "s", "--noop", "--converged-exit")
    assert rc == 2, err


def test_a_watching_noop_agent_does_not_exit_3(tmp_path: Path) -> None:
    """3 answers a one-shot question; a watching noop agent that is stopped (here by
    --max-runtime) exits 0 like any other."""
    g = graph(tmp_path, f"  file:\n  - {{name: f, path: {tmp_path}/f, content: x}}\n")
    rc, err = run(g, tmp_path / "s", "--noop", "--max-runtime", "0.3")
    assert rc == 0, err
    assert "file[f]: would change (noop)" in err


def test_help_documents_the_status() -> None:
    r = run_cli("run", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "3 with --noop and --converged-exit (or --no-watch): something would change" in text
    assert "with --noop, 3 if something would change" in text


def test_the_python_api_returns_it_too(tmp_path: Path) -> None:
    g = graph(tmp_path, f"  file:\n  - {{name: f, path: {tmp_path}/f, content: x}}\n")
    state = tmp_path / "s"
    common = {"state_dir": state, "converged_exit": True, "world": None, "handle_signals": False}
    assert evergraph.run(g, noop=True, **common) == 3  # type: ignore[arg-type]
    assert evergraph.run(g, **common) == 0  # type: ignore[arg-type]
    assert evergraph.run(g, noop=True, **common) == 0  # type: ignore[arg-type]
