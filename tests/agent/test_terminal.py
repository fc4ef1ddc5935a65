"""What `run` shows: on a terminal (a real pty) a live progress display during the
first convergence, then one status line updated in place, coloured lines; in a
pipe plain lines only; -v each check with its duration, -vv commands' output."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from evergraph.engine.masking import MASK
from tests.conftest import run_cli, status_lines, wait_for
from tests.kit.passwords import password_of
from tests.kit.terminal import RECORD


def write_graph(tmp_path: Path) -> Path:
    """file[a] changes; exec[hold] runs until the test creates GO; exec[bad] fails."""
    g = tmp_path / "g.yaml"
    g.write_text(
        f"""graph: ux
resources:
  file:
  - name: a
    path: {tmp_path}/a.txt
    content: "one\\n"
  exec:
  - name: hold
    shell: /bin/sh
    cmd: "while [ ! -e {tmp_path}/GO ]; do sleep 0.01; done"
  - name: bad
    shell: /bin/sh
    cmd: "echo boom >&2; exit 3"
"""
    )
    return g


def test_a_terminal_shows_progress_then_a_status_line(tmp_path: Path, pty: Any) -> None:
    g = write_graph(tmp_path)
    t = pty("run", g, "--state-dir", tmp_path / "s", "--converged-timeout", "0.05")
    # the first convergence: a bar with done/total, and what runs for how long
    t.expect(lambda: re.search(r"running exec\[hold\] \(\d", t.plain), "the running vertex")
    t.expect(lambda: re.search(r"converging .*\d/3", t.plain), "the progress bar")
    (tmp_path / "GO").touch()
    # then one status line, after the converged line and the recap
    t.expect(lambda: "watching 3 resources, 1 failed, no repair yet" in t.plain, "status")
    plain = t.plain
    assert plain.index("converged with 1 of 3") < plain.index("recap: 2 changed, 1 failed")
    # coloured lines: changed yellow, failed red
    assert re.search(r"\x1b\[33m\d\d:\d\d:\d\d\.\d{3} file\[a\]: applied", t.text), t.text
    assert re.search(r"\x1b\[31m\d\d:\d\d:\d\d\.\d{3} error: exec\[bad\]", t.text), t.text
    assert re.search(r"\x1b\[33m +changed file\[a\]", t.text), t.text  # in the recap too
    # a repair updates the status line in place
    (tmp_path / "a.txt").write_text("drifted\n")
    t.expect(
        lambda: re.search(
            r"watching 3 resources, 1 failed, last repair file\[a\] \d+ s ago", t.plain
        ),
        "the status line naming the repair",
    )
    t.proc.send_signal(signal.SIGTERM)
    assert t.wait() == 1  # exec[bad] failed
    # one line updated in place: each drawing of it is erased before the next
    draws = t.text.split("watching 3 resources")
    assert len(draws) > 2, t.text
    assert all("\x1b[2K" in between for between in draws[1:-1]), t.text


def test_the_agent_outlives_its_terminal(tmp_path: Path, pty: Any) -> None:
    g = write_graph(tmp_path)
    g.write_text(g.read_text().split("  - name: bad")[0])  # all will be clean: status 0
    status = tmp_path / "converged.status"
    t = pty(
        "run",
        g,
        "--state-dir",
        tmp_path / "s",
        "--converged-timeout",
        "0.05",
        "--converged-status-file",
        status,
    )
    t.expect(lambda: "running exec[hold]" in t.plain, "the display")
    t.hang_up()
    (tmp_path / "GO").touch()
    # it converges all the same (the display's writes fail: it goes on without it)
    wait_for(lambda: status_lines(status)[-1:] == ["true"], what="convergence")
    (tmp_path / "a.txt").write_text("drifted\n")
    wait_for(lambda: status_lines(status).count("true") == 2, what="the repair")
    # the stop is logged, and the display ends: writes that fail, which must not
    # fail the agent (status 1, "a service failed")
    t.proc.send_signal(signal.SIGTERM)
    assert t.proc.wait(20) == 0


def test_a_pipe_gets_plain_lines(tmp_path: Path) -> None:
    g = write_graph(tmp_path)
    (tmp_path / "GO").touch()
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 1, r.stderr
    assert "\x1b" not in r.stderr
    assert "converging" not in r.stderr
    assert "watching" not in r.stderr
    for line in r.stderr.splitlines():
        assert RECORD.match(line) or line.startswith("  "), line
    assert "recap: 2 changed, 1 failed, 0 clean" in r.stderr


def test_json_on_a_terminal_stays_json(tmp_path: Path, pty: Any) -> None:
    g = write_graph(tmp_path)
    (tmp_path / "GO").touch()
    t = pty("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "--log-format", "json")
    assert t.wait() == 1
    lines = [line for line in t.text.split("\r\n") if line]
    records = [json.loads(line) for line in lines]  # every line: no display, no colour
    assert any(rec.get("event") == "recap" for rec in records)


def test_v_shows_each_check_with_its_duration(tmp_path: Path) -> None:
    g = write_graph(tmp_path)
    (tmp_path / "GO").touch()
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "-v")
    assert re.search(r"debug: file\[a\]: changed in \d+(\.\d)? ms\n", r.stderr), r.stderr
    assert re.search(r"debug: exec\[bad\]: failed in \d+(\.\d)? ms\n", r.stderr), r.stderr
    assert "cmd stderr" not in r.stderr  # command output is -vv
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "-v")
    assert re.search(r"debug: file\[a\]: clean in \d+(\.\d)? ms\n", r.stderr), r.stderr
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit")
    assert " in " not in r.stderr.replace("exited with", "")  # no checks without -v


def test_vv_shows_commands_with_arguments_and_their_output(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(
        """graph: out
resources:
  exec:
  - name: talk
    cmd: /bin/sh
    args: ["-c", "echo hello; echo warn >&2"]
"""
    )
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "-vv")
    assert r.returncode == 0, r.stderr
    # the command with its arguments, not only the program
    assert "exec[talk]: ran /bin/sh -c 'echo hello; echo warn >&2'" in r.stderr
    assert "exec[talk]: cmd: /bin/sh -c 'echo hello; echo warn >&2'" in r.stderr
    assert "exec[talk]: cmd stdout: hello\n" in r.stderr
    assert "exec[talk]: cmd stderr: warn\n" in r.stderr
    r = run_cli("run", g, "--state-dir", tmp_path / "s2", "--converged-exit", "-v")
    assert "ran /bin/sh -c 'echo hello; echo warn >&2'" in r.stderr
    assert "stdout: hello" not in r.stderr  # output is for -vv only


def test_vv_output_is_masked(tmp_path: Path) -> None:
    # the command is the secret: the shell says it was not found, on stderr
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: sec\nresources:\n  password:\n  - {name: p}\n"
        "  exec:\n  - {name: use, shell: /bin/sh, cmd: 'true'}\n"
        "edges:\n- from: {kind: password, name: p, send: password}\n"
        "  to: {kind: exec, name: use, recv: cmd}\n"
    )
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "-vv")
    assert r.returncode == 1, r.stderr
    password = password_of(tmp_path / "s")
    assert password not in r.stderr
    assert re.search(rf"exec\[use\]: cmd stderr: .*{re.escape(MASK)}: not found", r.stderr)
    assert f"exec[use]: cmd: {MASK}" in r.stderr


@pytest.mark.slow
def test_a_long_apply_says_it_is_still_running(tmp_path: Path, agents: Any) -> None:
    g = write_graph(tmp_path)
    agent = agents(g, tmp_path / "s")
    wait_for(
        lambda: "exec[hold]: still running (10 s)" in agent.log.read_text(),
        timeout=25,
        what="the still-running line",
    )
    assert "still running" not in agent.log.read_text().replace("exec[hold]: still", "")
    (tmp_path / "GO").touch()
    agent.wait_converged()
    assert agent.stop() == 1
