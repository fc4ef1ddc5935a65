"""password: generated once, kept sealed across restarts, sent, rotated on refresh, never shown."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from evergraph.cluster.hostkeys import HostKeys
from evergraph.testing.kinds import graph_error
from tests.conftest import Agent, run_cli, wait_for


def graph(tmp_path: Path, params: str = "", trigger: bool = False) -> Path:
    """password[p] -> file[f].content; with `trigger`, file[t] notifies p."""
    saved = tmp_path / "sec" / "p.sealed"
    out = tmp_path / "out.txt"
    extra = f"  - {{name: t, path: {tmp_path / 'trigger'}, content: 'on'}}\n" if trigger else ""
    notify = (
        "- from: {kind: file, name: t}\n  to: {kind: password, name: p}\n  notify: true\n"
        if trigger
        else ""
    )
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: pw\nresources:\n  password:\n"
        f"  - {{name: p, {params or f'saved: {saved}'}}}\n"
        f"  file:\n  - {{name: f, path: {out}, mode: '0600'}}\n{extra}"
        "edges:\n"
        "- from: {kind: password, name: p, send: password}\n"
        "  to: {kind: file, name: f, recv: content}\n" + notify
    )
    return g


def run_once(g: Path, state: Path, *extra: str) -> tuple[int, str]:
    r = run_cli("run", g, "--state-dir", state, "--converged-exit", "-vv", *extra)
    return r.returncode, r.stderr


def opened(state: Path, sealed: Path) -> str:
    """The password in a sealed file, opened with the agent's host key."""
    return HostKeys(state).open_local(sealed.read_bytes()).decode()


def test_timeline_generate_keep_repair_and_never_show(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    g, state = graph(tmp_path), tmp_path / "s"
    saved, out = tmp_path / "sec" / "p.sealed", tmp_path / "out.txt"
    # from scratch: generated, sent into the file, saved sealed
    rc, err = run_once(g, state)
    assert rc == 0, err
    password = out.read_text()
    assert len(password) == 64
    assert password.isascii()
    assert password.isalnum()
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert password.encode() not in saved.read_bytes()
    assert opened(state, saved) == password
    assert "password[p]: applied" in err
    # a restart keeps it and is clean
    rc, err = run_once(g, state)
    assert rc == 0, err
    assert ": applied" not in err
    assert out.read_text() == password
    # drift while the agent runs: a deleted saved file is written back with the same password
    agent: Agent = agents(g, state, "-vv")
    agent.wait_converged()
    saved.unlink()
    wait_for(saved.exists, what="saved file written back")
    assert opened(state, saved) == password
    assert out.read_text() == password
    # a mode loosened by hand is tightened again
    saved.chmod(0o644)
    wait_for(lambda: stat.S_IMODE(saved.stat().st_mode) == 0o600, what="mode 0600 again")
    assert agent.stop() == 0
    log = agent.log.read_text()
    assert "was missing: wrote it back" in log
    assert "file[f]: received content=<secret>" in log
    # never shown: not in any log, nor in `graph` or `check` output
    assert password not in log
    assert password not in err
    for cmd in (("graph", g), ("graph", g, "--format", "json"), ("check", g)):
        r = run_cli(*cmd)
        assert r.returncode == 0, r.stderr
        assert password not in r.stdout + r.stderr


def test_tampered_saved_file_is_replaced_by_a_new_password(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    g, state = graph(tmp_path), tmp_path / "s"
    saved, out = tmp_path / "sec" / "p.sealed", tmp_path / "out.txt"
    agent: Agent = agents(g, state, "-vv")
    agent.wait_converged()
    first = out.read_text()
    # sealed with another host's key: valid format, but not ours
    other = HostKeys(tmp_path / "elsewhere").seal_local(b"A" * 64)
    saved.write_bytes(other)
    wait_for(lambda: out.read_text() != first, what="a new password after tampering")
    second = out.read_text()
    assert len(second) == 64
    wait_for(lambda: opened(state, saved) == second, what="the new password saved")
    # plain garbage too
    saved.write_text("not a sealed password at all\n")
    wait_for(lambda: out.read_text() != second, what="a new password after garbage")
    third = out.read_text()
    wait_for(lambda: opened(state, saved) == third, what="the third password saved")
    assert agent.stop() == 0
    log = agent.log.read_text()
    assert log.count("does not open with this host's key") == 2
    for p in (first, second, third, "A" * 64):
        assert p not in log


def test_refresh_generates_a_new_password(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    g, state = graph(tmp_path, trigger=True), tmp_path / "s"
    saved, out, trigger = tmp_path / "sec" / "p.sealed", tmp_path / "out.txt", tmp_path / "trigger"
    agent: Agent = agents(g, state, "-vv")
    agent.wait_converged()
    first = out.read_text()
    # the trigger file drifts; its repair notifies the password, which rotates
    trigger.write_text("changed by hand")
    wait_for(lambda: out.read_text() != first, what="a new password after a refresh")
    second = out.read_text()
    assert len(second) == 64
    wait_for(lambda: opened(state, saved) == second, what="the new password saved")
    assert agent.stop() == 0
    log = agent.log.read_text()
    assert "password[p]: refreshed: generated a new password" in log
    assert first not in log
    assert second not in log
    # after the restart the rotated one is kept
    rc, err = run_once(g, state)
    assert rc == 0, err
    assert out.read_text() == second


def test_without_saved_it_lives_sealed_in_the_state_dir(tmp_path: Path) -> None:
    g, state = graph(tmp_path, params="length: 8"), tmp_path / "s"
    out = tmp_path / "out.txt"
    rc, err = run_once(g, state)
    assert rc == 0, err
    password = out.read_text()
    assert len(password) == 8
    sealed = state / "vertices" / "password" / "p" / "password.sealed"
    assert stat.S_IMODE(sealed.stat().st_mode) == 0o600
    assert password.encode() not in sealed.read_bytes()
    assert opened(state, sealed) == password
    rc, err = run_once(g, state)
    assert rc == 0, err
    assert ": applied" not in err
    assert out.read_text() == password
    # a new length is a new password
    g.write_text(g.read_text().replace("length: 8", "length: 12"))
    rc, err = run_once(g, state)
    assert rc == 0, err
    assert len(out.read_text()) == 12


def test_noop_generates_and_writes_nothing(tmp_path: Path) -> None:
    g, state = graph(tmp_path), tmp_path / "s"
    rc, err = run_once(g, state, "--noop")
    assert rc == 3, err  # something would change
    assert "password[p]: would change (noop)" in err
    assert not (tmp_path / "sec").exists()
    assert not (tmp_path / "out.txt").exists()


BAD_PARAMS = [
    ("length: 3", "password[p].length: 3 is not between 8 and 4096"),
    ("length: 5000", "password[p].length: 5000 is not between 8 and 4096"),
    ("length: many", "password[p].length: expected int"),
    ("saved: rel/p.sealed", "password[p].saved: 'rel/p.sealed' is not an absolute path"),
    ("saved: /tmp/dir/", "password[p].saved: '/tmp/dir/' names a directory"),
]


@pytest.mark.parametrize(("params", "needle"), BAD_PARAMS)
def test_bad_parameters_are_load_errors(tmp_path: Path, params: str, needle: str) -> None:
    g, state = graph(tmp_path, params=params), tmp_path / "s"
    err = graph_error(g)  # as `evergraph check` loads it, in process
    assert needle in err
    if (params, needle) != BAD_PARAMS[0]:
        return  # one of them end to end: exit 2, nothing changed
    rc, err = run_once(g, state)
    assert rc == 2
    assert needle in err
    assert "Traceback" not in err
    assert not state.exists()
    assert not (tmp_path / "out.txt").exists()
