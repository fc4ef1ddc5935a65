"""Hostile input (SPEC 6): each case is ONE line naming the place, exit status 2,
at once: never a traceback, never a hang, never a graph silently emptied.

Every case runs the real CLI as a subprocess with a short timeout: a hang (a FIFO
waited on, /dev/zero read to the end) fails the test instead of stalling it."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Agent, run_cli, wait_for

#: a case answers within this (a second of work, plus interpreter start-up under load)
QUICK = 10.0

HELLO = "graph: g\nresources:\n  noop:\n  - name: a\n"


def one_line_exit_2(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The single stderr line of a refused input (which names every needle)."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def timed(*args: str | Path, timeout: float = QUICK) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    r = run_cli(*args, timeout=timeout)
    assert time.monotonic() - t0 < timeout
    return r


def run_once(graph: Path, state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return timed("run", graph, "--state-dir", state, "--converged-exit", *extra)


# --------------------------------------------------------------------------- YAML


def deep_yaml(levels: int) -> str:
    """`content:` nested `levels` mappings deep (block style: yaml_rs reads it, the
    error path's PyYAML locator recursed once per level), and so a type error."""
    lines = ["graph: g", "resources:", "  file:", "  - name: a", "    path: /tmp/eg-deep"]
    lines.append("    content:")
    indent = "      "
    for _ in range(levels):
        lines.append(indent + "k:")
        indent += "  "
    lines[-1] += " 1"
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("command", ["check", "run", "graph"])
def test_yaml_nested_600_levels_with_a_type_error(tmp_path: Path, command: str) -> None:
    f = tmp_path / "deep.yaml"
    f.write_text(deep_yaml(600))
    args = ("--state-dir", tmp_path / "st", "--converged-exit") if command == "run" else ()
    r = timed(command, f, *args)
    one_line_exit_2(r, str(f), "nested too deeply")
    assert not Path("/tmp/eg-deep").exists()


def test_yaml_nested_a_little_is_still_located(tmp_path: Path) -> None:
    f = tmp_path / "deep.yaml"
    f.write_text(deep_yaml(50))
    one_line_exit_2(timed("check", f), f"{f}:7:7: file[a].content: expected str")


def test_yaml_mapping_as_a_key_is_located(tmp_path: Path) -> None:
    f = tmp_path / "key.yaml"
    f.write_text(HELLO + "edges:\n- {from: {kind: noop, name: a}}: x\n")
    one_line_exit_2(timed("check", f), f"{f}:6:3: YAML error: a mapping key must be a scalar")


@pytest.mark.parametrize("field", ["gid", "uid"])
def test_yaml_number_too_long_to_print_is_located(tmp_path: Path, field: str) -> None:
    f = tmp_path / "big.yaml"
    f.write_text(f"graph: g\nresources:\n  user:\n  - name: u\n    {field}: {'9' * 5000}\n")
    one_line_exit_2(timed("check", f), f"{f}:5:{len(field) + 7}: a number of more than 4300")


# --------------------------------------------------------------------------- graph files


SPECIAL = ["zero.yaml", "zero.py", "fifo.yaml", "fifo.py", "big.yaml", "big.py"]


def special_file(tmp_path: Path, name: str) -> tuple[Path, str]:
    """A graph file that is not one, and what its refusal says."""
    p = tmp_path / name
    stem = name.split(".")[0]
    if stem == "zero":
        p.symlink_to("/dev/zero")  # never ends: read whole, memory grew 500 MB/s
        return p, "a character device, not a regular file"
    if stem == "fifo":
        os.mkfifo(p)  # no writer: a plain open waits forever
        return p, "a FIFO, not a regular file"
    with open(p, "wb") as f:
        f.truncate(17 * 1024 * 1024)  # sparse: costs nothing on disk
    return p, "too large (17.0 MiB): a graph file may be at most 16 MiB"


@pytest.mark.parametrize("name", SPECIAL)
def test_check_refuses_what_is_not_a_graph_file(tmp_path: Path, name: str) -> None:
    p, says = special_file(tmp_path, name)
    # a short timeout: unfixed, /dev/zero is read into memory for as long as it runs
    one_line_exit_2(run_cli("check", p, timeout=5), str(p), says)


@pytest.mark.parametrize("name", ["zero.yaml", "fifo.py", "big.yaml"])
@pytest.mark.parametrize("command", ["run", "graph"])
def test_run_and_graph_refuse_what_is_not_a_graph_file(
    tmp_path: Path, name: str, command: str
) -> None:
    p, says = special_file(tmp_path, name)
    state = tmp_path / "st"
    args = ("--state-dir", state, "--converged-exit") if command == "run" else ()
    one_line_exit_2(run_cli(command, p, *args, timeout=5), str(p), says)
    assert not state.exists()  # refused before anything was set up


def test_a_symlink_to_a_regular_file_is_read(tmp_path: Path) -> None:
    real = tmp_path / "real.yaml"
    real.write_text(HELLO)
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    r = timed("check", link)
    assert r.returncode == 0, r.stderr


def test_a_running_graph_file_replaced_by_a_fifo_is_refused_not_waited_on(
    tmp_path: Path,
    agents: Callable[..., Agent],
) -> None:
    graph = tmp_path / "g.yaml"
    graph.write_text(HELLO)
    a: Agent = agents(graph, tmp_path / "st")
    a.wait_converged()
    fifo = tmp_path / "new.fifo"
    os.mkfifo(fifo)
    os.replace(fifo, graph)  # unfixed: the agent's loop blocks in open() forever
    wait_for(lambda: "a FIFO, not a regular file" in a.log.read_text(), what="the refusal")
    assert f"{graph}: a FIFO, not a regular file" in a.log.read_text()
    t0 = time.monotonic()
    assert a.stop() == 0  # SIGTERM is still served
    assert time.monotonic() - t0 < 5
    assert "Traceback" not in a.log.read_text()


# --------------------------------------------------------------------------- --seeds

BAD_SEEDS = [
    "http://[::1",  # urlsplit: Invalid IPv6 URL (raised from the etcd client: exit 1)
    "http://[::1]:99999",
    "http://h:port",
    "http://",
    "http://a b:2379",
    "ftp://h:2379",
    "http://h:2379/v3",
    "http://h:0",
]


@pytest.mark.parametrize("url", BAD_SEEDS)
def test_a_malformed_seed_url_names_seeds(tmp_path: Path, url: str) -> None:
    graph = tmp_path / "g.yaml"
    graph.write_text(HELLO)
    one_line_exit_2(run_once(graph, tmp_path / "st", "--seeds", url), "--seeds")


@pytest.mark.parametrize("command", [("world", "get", "k"), ("members",), ("deploys",)])
def test_every_command_validates_seeds(tmp_path: Path, command: tuple[str, ...]) -> None:
    r = timed(*command, "--seeds", "http://[::1", "--state-dir", tmp_path / "st")
    one_line_exit_2(r, "--seeds", "http://[::1")


def test_a_seed_url_with_a_password_is_not_echoed(tmp_path: Path) -> None:
    graph = tmp_path / "g.yaml"
    graph.write_text(HELLO)
    r = run_once(graph, tmp_path / "st", "--seeds", "http://u:s3cret@h:2379")
    line = one_line_exit_2(r, "--seeds")
    assert "s3cret" not in line
