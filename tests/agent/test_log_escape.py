"""Control characters in what the agent logs (resource names, errors, command
output: users' and machines' text) are escaped: no forged log line, no terminal
escape. The rule: every non-printable character but tab and newline is written as
its Python escape (`\\x1b`, `\\r`); a newline starts a continuation line indented
two spaces, so no line of a message can pass for a record (records start with
their time)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from evergraph.cli.logs import escape
from tests.conftest import run_cli
from tests.kit.terminal import ANSI, RECORD

#: a name that tries it all: a colour, a carriage return and a forged record, a
#: newline and another forged record, NUL, a C1 control (NEL), a line separator
HOSTILE = "x\x1b[31mRED\r00:00:00.000 forged\n00:00:01.000 file[y]: applied\x00\x85\u2028z"
ESCAPED_PARTS = ("x\\x1b[31mRED\\r00:00:00.000 forged", "\\x00\\x85\\u2028z")
#: bytes that must never reach a log from the name or the output
RAW = ("\x1b[31m", "\r", "\x00", "\x85", "\u2028", "\x1b]0;")


def test_escape_rule() -> None:
    assert escape("file[a]: applied") == "file[a]: applied"
    assert escape("a\tb") == "a\tb"  # tab kept
    assert escape("a\x1b[2Jb\rc\x00\x7f\x9b") == "a\\x1b[2Jb\\rc\\x00\\x7f\\x9b"
    assert escape("\u202egnp.exe \u2028 é ü 日本 \xa0") == "\\u202egnp.exe \\u2028 é ü 日本 \xa0"
    assert escape("one\ntwo\n\x1b") == "one\n  two\n  \\x1b"  # continuation lines
    assert escape("one\ntwo", lines=False) == "one\\ntwo"


def hostile_graph(tmp_path: Path, hold: bool = False) -> Path:
    """exec[HOSTILE] prints control sequences and fails (or, `hold`, waits for GO)."""
    cmd = (
        f"while [ ! -e {tmp_path}/GO ]; do sleep 0.01; done"
        if hold
        else r"printf 'out\033]0;title\007\033[2J\r\n'; echo bad >&2; exit 1"
    )
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: evil\nresources:\n  exec:\n"
        f"  - name: {json.dumps(HOSTILE)}\n    shell: /bin/sh\n    cmd: {json.dumps(cmd)}\n"
    )
    return g


def assert_no_forged_lines(text: str) -> None:
    for raw in RAW:
        assert raw not in text, (raw, text)
    for line in text.splitlines():
        assert RECORD.match(line) or line.startswith("  "), line
    assert not re.search(r"^00:00:0[01]\.000", text, re.M), text


def test_a_hostile_name_in_a_pipe(tmp_path: Path) -> None:
    r = run_cli("run", hostile_graph(tmp_path), "--state-dir", tmp_path / "s", "--converged-exit")
    assert r.returncode == 1, r.stderr
    assert_no_forged_lines(r.stderr)
    for part in ESCAPED_PARTS:
        assert part in r.stderr, r.stderr
    # the newline in the name: the forged record is an indented continuation
    assert "\n  00:00:01.000 file[y]: applied" in r.stderr
    assert "recap: 0 changed, 1 failed" in r.stderr  # the recap's name escaped too
    assert r.stderr.count("x\\x1b[31mRED") >= 3  # error, converged line, recap


def test_command_output_is_escaped(tmp_path: Path) -> None:
    g = hostile_graph(tmp_path)
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "-vv")
    assert_no_forged_lines(r.stderr)
    assert "cmd stdout: out\\x1b]0;title\\x07\\x1b[2J\\r\n" in r.stderr, r.stderr


def test_json_keeps_the_name_whole(tmp_path: Path) -> None:
    g = hostile_graph(tmp_path)
    r = run_cli("run", g, "--state-dir", tmp_path / "s", "--converged-exit", "--log-format", "json")
    records = [json.loads(line) for line in r.stderr.splitlines()]  # each line one object
    [recap] = [rec for rec in records if rec.get("event") == "recap"]
    assert recap["failed"][0]["name"] == HOSTILE
    assert any(rec["msg"].startswith(f"exec[{HOSTILE}]: ") for rec in records)


def test_a_hostile_name_on_a_terminal(tmp_path: Path, pty: Any) -> None:
    t = pty("run", hostile_graph(tmp_path, hold=True), "--state-dir", tmp_path / "s")
    # the live display names it too, on one line
    t.expect(lambda: "running exec[x\\x1b[31mRED\\r00:00:00.000 forged\\n00" in t.plain, "display")
    (tmp_path / "GO").touch()
    t.expect(lambda: "watching 1 resources" in t.plain, "the status line")
    t.proc.terminate()
    assert t.wait() == 0
    # our own colours only: what is left without them has no control character
    plain = ANSI.sub("", t.text.replace("\r\n", "\n"))
    plain = re.sub(r"\r(?=.)", "", plain)  # the display returns to the line's start
    for raw in RAW[:1] + RAW[2:]:
        assert raw not in plain, (raw, plain)
    assert "\x1b[31mRED" not in t.text
    assert "exec[x\\x1b[31mRED\\r00:00:00.000 forged" in plain
