"""augeas: the timeline for real on files in the test's tmp dir, through libaugeas' own lenses.

The files are tmp copies of real formats (sshd_config, hosts), parsed and written
back by the lenses libaugeas ships; nothing outside the tmp dir is touched.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import EVERGRAPH, Agent, wait_for
from tests.kit.kinds import refused

pytest.importorskip("augeas", reason="needs python-augeas and libaugeas0 (scripts/setup)")

SSHD = """# a comment kept
Port 22
X11Forwarding yes
PasswordAuthentication yes

Match User bob
  X11Forwarding yes
"""


def graph(tmp_path: Path, sets: str, lens: str = "Sshd.lns", reverse: bool = False) -> Path:
    g = tmp_path / "g.yaml"
    meta = "    meta: {reverse: true}\n" if reverse else ""
    g.write_text(
        "graph: g\nresources:\n  augeas:\n  - name: sshd\n"
        f"    file: {tmp_path / 'sshd_config'}\n    lens: {lens}\n    sets:\n{sets}{meta}"
    )
    return g


def run_once(g: Path, state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EVERGRAPH, "run", str(g), "--state-dir", str(state), "--converged-exit", *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


def replace(path: Path, text: str) -> None:
    """As an editor saves: a new file renamed over the old one."""
    tmp = path.with_name(f".{path.name}.edit")
    tmp.write_text(text)
    os.replace(tmp, path)


SETS = "    - {path: X11Forwarding, value: 'no'}\n    - {path: Port, value: 2222}\n"
WANT = SSHD.replace("Port 22\n", "Port 2222\n").replace(
    "X11Forwarding yes\nPassword", "X11Forwarding no\nPassword"
)


def test_timeline(tmp_path: Path, agents: Callable[..., Agent]) -> None:
    conf = tmp_path / "sshd_config"
    conf.write_text(SSHD)
    conf.chmod(0o600)
    g = graph(tmp_path, SETS, reverse=True)
    agent = agents(g, tmp_path / "s", "-v")
    agent.wait_converged()
    # applied: only the two values changed (Match's own X11Forwarding, comments kept)
    assert conf.read_text() == WANT
    assert conf.stat().st_mode & 0o777 == 0o600  # the mode kept
    # drift: an editor's save (rename) that reverts one value and adds a comment
    replace(conf, WANT.replace("X11Forwarding no\nP", "X11Forwarding yes\n# mine\nP"))
    want = WANT.replace("X11Forwarding no\nP", "X11Forwarding no\n# mine\nP")
    wait_for(lambda: conf.read_text() == want, what="X11Forwarding repaired, the comment kept")
    # drift: written in place
    with open(conf, "r+") as f:
        f.write(want.replace("Port 2222", "Port 2200"))
    wait_for(lambda: conf.read_text() == want, what="Port repaired")
    # a check from outside finds it clean
    r = run_once(g, tmp_path / "s2", "--noop")
    assert r.returncode == 0, r.stderr
    assert "nothing would change or failed, 1 clean" in r.stderr
    # reversal: the resource leaves the graph, the values found before come back
    g.write_text("graph: g\nresources:\n  noop:\n  - name: n\n")
    wait_for(
        lambda: (
            conf.read_text() == SSHD.replace("X11Forwarding yes\nP", "X11Forwarding yes\n# mine\nP")
        ),
        what="the old values back",
    )
    assert agent.stop() == 0
    log = agent.log.read_text()
    assert log.count("augeas[sshd]: X11Forwarding, Port set in") == 2  # applied, reversed
    assert log.count("augeas[sshd]: X11Forwarding set in") == 1
    assert log.count("augeas[sshd]: Port set in") == 1


def test_mgmt_layout_with_a_yaml_bool_and_a_missing_file(tmp_path: Path) -> None:
    """mgmt's example shape: `value: false` (a YAML bool) is the text `false`."""
    conf = tmp_path / "sshd_config"
    g = graph(tmp_path, "    - path: X11Forwarding\n      value: false\n")
    r = run_once(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    assert conf.read_text() == "X11Forwarding false\n"  # made from an empty text
    assert conf.stat().st_mode & 0o777 == 0o644


def test_a_path_with_a_predicate_in_hosts(tmp_path: Path) -> None:
    hosts = tmp_path / "sshd_config"  # (the graph's file name; the lens decides)
    hosts.write_text("127.0.0.1 localhost\n10.0.0.5 db db.example\n")
    g = graph(
        tmp_path, "    - {path: \"*[canonical='db']/ipaddr\", value: 10.0.0.6}\n", "Hosts.lns"
    )
    r = run_once(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    assert hosts.read_text() == "127.0.0.1 localhost\n10.0.0.6 db db.example\n"


def test_a_file_the_lens_cannot_parse_fails_clearly_and_is_left_alone(tmp_path: Path) -> None:
    conf = tmp_path / "sshd_config"
    conf.write_text("Port\n")
    r = run_once(graph(tmp_path, SETS), tmp_path / "s")
    assert r.returncode == 1, r.stderr
    assert f"augeas[sshd]: cannot parse {conf} with Sshd.lns at line 1:" in r.stderr
    assert "Traceback" not in r.stderr
    assert conf.read_text() == "Port\n"


def test_a_tree_the_lens_cannot_write_fails_clearly(tmp_path: Path) -> None:
    conf = tmp_path / "sshd_config"
    conf.write_text(SSHD)
    # a new top-level key after a Match block: Sshd.lns cannot write that tree
    r = run_once(graph(tmp_path, "    - {path: PermitRootLogin, value: 'no'}\n"), tmp_path / "s")
    assert r.returncode == 1, r.stderr
    assert f"augeas[sshd]: cannot write back {conf} with Sshd.lns: Failed to match" in r.stderr
    assert conf.read_text() == SSHD


def test_an_unknown_lens_fails_clearly(tmp_path: Path) -> None:
    (tmp_path / "sshd_config").write_text(SSHD)
    r = run_once(graph(tmp_path, SETS, "Nosuchthing.lns"), tmp_path / "s")
    assert r.returncode == 1, r.stderr
    assert "with Nosuchthing.lns: the lens did not load (no such lens?" in r.stderr


F, L, S = "file: /tmp/x", "lens: Sshd.lns", "sets: [{path: a, value: b}]"


BAD_INPUT = [
    (f"{F}, {S}", "augeas[x].lens: needs the lens"),
    (f"{F}, lens: sshd, {S}", "augeas[x].lens: 'sshd' is not a lens name"),
    (f"file: rel, {L}, {S}", "augeas[x].file: 'rel' is not an absolute path"),
    (f"{F}, {L}", "augeas[x].sets: nothing to set"),
    (f"{F}, {L}, sets: [{{path: '', value: b}}]", "augeas[x].sets: '' is not a node path"),
    (f"{F}, {L}, sets: [{{path: a}}]", "augeas[x].sets.0: Object missing required field value"),
    (
        f"{F}, {L}, sets: [{{path: a, value: [1]}}]",
        "augeas[x].sets.0.value: expected bool | str, got array",
    ),
    (f"{F}, {L}, sets: [{{path: a, value: b}}, {{path: a, value: c}}]", "given two values"),
]


@pytest.mark.parametrize(("item", "needle"), BAD_INPUT)
def test_bad_input_is_exit_2_and_changes_nothing(tmp_path: Path, item: str, needle: str) -> None:
    item = item.replace("/tmp/x", str(tmp_path / "conf"))
    (tmp_path / "conf").write_text("Port 22\n")
    g = tmp_path / "g.yaml"
    g.write_text(f"graph: g\nresources:\n  augeas:\n  - {{name: x, {item}}}\n")
    # in process, as `evergraph check` loads it; one of them end to end: exit 2,
    # nothing changed
    if not refused(g, needle, f"{g}:4:", end_to_end=(item, needle) == BAD_INPUT[0]):
        return
    r = run_once(g, tmp_path / "s")
    assert r.returncode == 2, r.stderr
    assert (tmp_path / "conf").read_text() == "Port 22\n"
    assert not (tmp_path / "s").exists()
