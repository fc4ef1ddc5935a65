"""`evergraph remote --inventory FILE` (remote/inventory.py): plain lines and YAML
read into targets, every error one line naming FILE:LINE, checked before any
connection; the JSON output's records (remote/progress.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evergraph.errors import InputError
from evergraph.remote.inventory import merge, parse_inventory, read_inventory
from evergraph.remote.progress import Json, Plain
from evergraph.remote.runner import Outcome
from evergraph.remote.session import AgentArgs
from evergraph.remote.target import Target


def test_plain_lines_with_comments_and_blank_lines() -> None:
    text = "# the web tier\nweb1\n\n  root@web2:2222   # behind a NAT\n[::1]:2200\n"
    assert parse_inventory(text, "inv") == [
        Target("web1"),
        Target("web2", 2222, "root"),
        Target("::1", 2200),
    ]
    assert [t.agent_hostname for t in parse_inventory(text, "inv")] == ["web1", "web2", "::1"]


def test_yaml_with_per_host_fields(tmp_path: Path) -> None:
    key = tmp_path / "deploy"
    key.write_text("not really a key\n")
    text = (
        "# the inventory\n"
        "hosts:\n"
        "  web1:\n"
        "    host: 10.0.0.5\n"
        "    user: root\n"
        "    port: 2222\n"
        "    key: deploy\n"
        "    hostname: web1.lan\n"
        "  db:\n"
        "  cache: {user: ops}\n"
    )
    path = tmp_path / "hosts.yaml"
    path.write_text(text)
    assert read_inventory(path) == [
        Target("10.0.0.5", 2222, "root", key, "web1.lan"),
        Target("db", hostname="db"),
        Target("cache", user="ops", hostname="cache"),
    ]


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ("web1\nweb2 web3\n", "inv:2", "one host per line"),
        ("web1\n\nroot@web1\n", "inv:3", "web1 is given twice (first at inv:1)"),
        ("web1\nh:99999\n", "inv:2", "port 99999 is not in 1-65535"),
        ("web1\n-x\n", "inv:2", "expected [user@]host[:port]"),
        ("# nothing\n\n", "inv", "no host in the inventory"),
        ("hosts:\n  a:\n    port: 0\n", "inv:3:", "a.port: 0 is not a port"),
        ("hosts:\n  a:\n    port: x\n", "inv:3:", "a.port: 'x' is not a port"),
        ("hosts:\n  a:\n    prot: 22\n", "inv:3:", "a: unknown field 'prot'"),
        ("hosts:\n  a:\n    key: /nonexistent/k\n", "inv:3:", "a.key: no such file"),
        ("hosts:\n  a: {}\n  b: {host: a}\n", "inv:3:", "a is given twice (first at inv:2:"),
        (
            "hosts:\n  a: {hostname: x}\n  b: {hostname: x}\n",
            "inv:3:",
            "hostname 'x' is given twice",
        ),
        ("hosts:\n  a: {}\n  a: {}\n", "inv:3:", "duplicate"),
        ("hosts:\n  a: {hostname: 'a b'}\n", "inv:2:", "is not a host name"),
        ("hosts:\n  a: {user: '1x'}\n", "inv:2:", "is not a user name"),
        ("hosts:\n  a: [1]\n", "inv:2:", "a: expected a mapping"),
        ("hosts:\n  a:\ngroups: {}\n", "inv:3:", "unknown key 'groups'"),
        ("hosts: []\n", "inv:1:", "`hosts:` must map"),
        ("hosts:\n  a: {host: 'a b'}\n", "inv:2:", "is not a host name or address"),
        ("hosts:\n  a: {\n", "inv:", "YAML syntax error"),
    ],
)
def test_an_error_is_one_line_naming_file_and_line(text: str, where: str, what: str) -> None:
    with pytest.raises(InputError) as caught:
        parse_inventory(text, "inv")
    assert caught.value.where.startswith(where.rstrip(":")), caught.value
    if where.endswith(":"):  # YAML: file:line:col
        assert caught.value.where.count(":") == 2, caught.value
    assert what in caught.value.message, caught.value
    assert "\n" not in str(caught.value)


def test_merge_with_the_host_arguments() -> None:
    listed = parse_inventory("web2\n", "inv")
    assert merge([Target("web1")], listed) == [Target("web1"), Target("web2")]
    with pytest.raises(InputError, match="web2 is given twice"):
        merge([Target("web2")], listed)
    with pytest.raises(InputError, match="no host"):
        merge([], [])


def test_the_agent_gets_runs_own_flags() -> None:
    # the default: the agent reports each converged transition and is ended by the
    # initiator (remote/runner.py's Ending)
    assert AgentArgs().coordinated
    assert AgentArgs().argv() == [
        "--converged-timeout",
        "0",
        "--converged-report",
        "--log-format",
        "text",
    ]
    # an explicit timeout: it ends by itself, as `run --converged-exit`
    assert not AgentArgs(5).coordinated
    assert AgentArgs(5).argv() == [
        "--converged-timeout",
        "5",
        "--converged-exit",
        "--log-format",
        "text",
    ]
    argv = AgentArgs(1.5, noop=True, diff=True, log_format="json").argv()
    assert argv[:5] == ["--converged-timeout", "1.5", "--converged-exit", "--log-format", "json"]
    assert set(argv[5:]) == {"--noop", "--diff"}


def test_json_output_is_one_object_per_line() -> None:
    out = io.StringIO()
    j = Json(out)
    j.emit("web1", json.dumps({"ts": 1.0, "level": "info", "msg": "file[x]: applied"}))
    j.emit("web1", "Traceback (most recent call last):")
    j.emit("web2", "unreachable: no SSH answer within 5 s")
    outcomes = [Outcome(Target("web1"), "converged"), Outcome(Target("web2"), "unreachable", "x")]
    j.finish(outcomes)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert records == [
        {"host": "web1", "ts": 1.0, "level": "info", "msg": "file[x]: applied"},
        {"host": "web1", "line": "Traceback (most recent call last):"},
        {"host": "web2", "line": "unreachable: no SSH answer within 5 s"},
        {"host": "web1", "recap": "converged", "reason": ""},
        {"host": "web2", "recap": "unreachable", "reason": "x"},
        {"total": {"hosts": 2, "converged": 1, "unreachable": 1}, "exit": 4},
    ]


def test_plain_output_prefixes_and_escapes() -> None:
    out = io.StringIO()
    p = Plain(["web1", "db:2222"], lambda s: s.replace("\x1b", "\\x1b"), out)
    p.emit("web1", "hello \x1b[2J")
    p.finish([Outcome(Target("web1"), "converged")])
    assert out.getvalue().splitlines() == [
        "web1    | hello \\x1b[2J",
        "web1: converged",
        "total: 1 host(s): 1 converged",
    ]


def test_the_cli_refuses_a_bad_inventory_or_no_host(tmp_path: Path) -> None:
    graph = tmp_path / "site.py"
    graph.write_text("def graph(g, world):\n    pass\n")
    inv = tmp_path / "hosts.yaml"
    inv.write_text("hosts:\n  web1:\n    port: 99999\n")
    env = {**os.environ, "SSH_AUTH_SOCK": "", "HOME": str(tmp_path)}
    base = [sys.executable, "-m", "evergraph.cli.main", "remote", str(graph)]
    for extra, where in (
        (["--inventory", str(inv)], f"{inv}:3:"),
        ([], "HOST: no host"),
        (["web1", "--seeds", "ftp://x"], "--seeds: "),
    ):
        out = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 2, out.stderr
        assert out.stdout == ""
        assert len(out.stderr.splitlines()) == 1, out.stderr
        assert f"evergraph: {where}" in out.stderr, out.stderr
