"""exec: args, guards, donecmd, user/group, watchfiles, and their bad inputs."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

import evergraph.resources  # noqa: F401  (declares the built-in kinds)
from evergraph.engine.build import build
from evergraph.engine.contract import default_registry
from evergraph.testing.kinds import Apply, Start, graph_error, run_steps
from tests.conftest import Agent, run_cli, wait_for


def run_graph(tmp_path: Path, body: str) -> tuple[int, str]:
    g = tmp_path / "g.yaml"
    g.write_text("graph: e\nresources:\n  exec:\n" + body)
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    return r.returncode, r.stderr


def apply(tmp_path: Path, ok: bool, **params: object) -> None:
    """One exec resource started and applied in process: `ok`, it was clean (its
    guard held it); else it ran."""
    res = build(default_registry, "exec", dict(params))
    state = tmp_path / "s" / str(params["name"])
    run_steps(res, [Start(), Apply(ok=ok)], state_dir=state)


def test_args_are_passed_as_they_are(tmp_path: Path) -> None:
    target = tmp_path / "a b; rm -rf nothing"
    apply(tmp_path, False, name="t", cmd="/usr/bin/touch", args=[str(target)])
    assert target.exists()


def test_nifcmd_and_ifcmd_guards_and_donecmd(tmp_path: Path) -> None:
    flag, ran, done = tmp_path / "flag", tmp_path / "ran", tmp_path / "done"
    n = {"name": "n", "shell": "/bin/sh", "cmd": f"echo n >> {ran}", "nifcmd": f"test -e {flag}"}
    n["donecmd"] = f"touch {done}"
    i = {"name": "i", "shell": "/bin/sh", "cmd": f"echo i >> {ran}", "ifcmd": f"test -e {flag}"}
    apply(tmp_path, False, **n)
    apply(tmp_path, True, **i)
    assert ran.read_text() == "n\n"  # flag absent: nifcmd lets n run, ifcmd holds i
    assert done.exists()
    flag.write_text("")
    done.unlink()
    apply(tmp_path, True, **n)
    apply(tmp_path, False, **i)
    assert ran.read_text() == "n\ni\n"
    assert not done.exists()


def test_user_and_group_run_the_command_as_them(tmp_path: Path) -> None:
    # nobody cannot reach pytest's 0700 temp tree: use a world-writable dir of
    # our own, removed afterwards
    shared = Path(tempfile.mkdtemp(prefix="evergraph-test-"))
    try:
        os.chmod(shared, 0o777)
        out = shared / "who"
        cmd = f"id -un > {out}; id -gn >> {out}; echo $HOME >> {out}"
        apply(tmp_path, False, name="w", shell="/bin/sh", cmd=cmd, user="nobody", group="nogroup")
        assert out.read_text().split() == ["nobody", "nogroup", "/nonexistent"]
        assert out.stat().st_uid != 0
    finally:
        shutil.rmtree(shared)


def test_unknown_user_is_a_clear_failure(tmp_path: Path) -> None:
    rc, err = run_graph(tmp_path, "  - {name: u, cmd: /bin/true, user: no-such-user-here}\n")
    assert rc == 1
    assert "exec[u]: no such user 'no-such-user-here'" in err


def test_watchfiles_changes_rerun_the_command(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    watched = tmp_path / "conf" / "app.conf"
    out = tmp_path / "runs"
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: w\nresources:\n  exec:\n"
        f'  - {{name: w, shell: /bin/sh, cmd: "echo run >> {out}", watchfiles: ["{watched}"]}}\n'
    )
    agent: Agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    assert out.read_text() == "run\n"
    watched.parent.mkdir()
    watched.write_text("x")  # appears below a directory that did not exist
    wait_for(lambda: out.read_text().count("run") >= 2, what="rerun on a watched file")
    assert agent.stop() == 0


BAD_INPUT = [
    (
        "  - {name: a, cmd: /bin/echo, args: [x], shell: /bin/sh}\n",
        "exec[a].args: cannot be used with shell",
    ),
    (
        "  - {name: w, cmd: /bin/true, watchfiles: [relative]}\n",
        "exec[w].watchfiles: 'relative' is not an absolute path",
    ),
    (
        '  - {name: q, cmd: /bin/true, nifcmd: "echo \'open"}\n',
        "exec[q].nifcmd: cannot be split",
    ),
]


@pytest.mark.parametrize(("body", "needle"), BAD_INPUT)
def test_bad_exec_parameters_are_load_errors(tmp_path: Path, body: str, needle: str) -> None:
    g = tmp_path / "g.yaml"
    g.write_text("graph: e\nresources:\n  exec:\n" + body)
    err = graph_error(g)  # as `evergraph check` loads it
    assert needle in err
    assert f"{g}:4:" in err
    if (body, needle) != BAD_INPUT[0]:
        return  # one of them end to end: exit 2, nothing changed
    rc, err = run_graph(tmp_path, body)
    assert rc == 2
    assert needle in err
    assert f"{tmp_path / 'g.yaml'}:4:" in err
