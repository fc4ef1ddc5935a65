"""mgmt's YAML layout: keys mgmt dropped are ignored with a warning naming the place,
`@@name` exports, integers for text keep their source text, mgmt's fields of the
kinds evergraph has, mgmt's semantics (kv without a value deletes; content with
state: absent is refused), and mgmt's kinds evergraph lacks named as such. Every
graph here is written for the test."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli, wait_for
from tests.kit.accounts import Accounts, passwd
from tests.kit.machine import MACHINE_WIDE

pytestmark = MACHINE_WIDE


def write(tmp_path: Path, text: str, name: str = "g.yaml") -> Path:
    g = tmp_path / name
    g.write_text(text)
    return g


def run(g: Path, state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("run", g, "--state-dir", state, "--converged-exit", *extra)


def line_of(g: Path, needle: str) -> int:
    """1-based line of the first line of `g` containing `needle`."""
    return next(i for i, line in enumerate(g.read_text().splitlines(), 1) if needle in line)


# -- keys mgmt dropped ------------------------------------------------------------------


def test_each_dropped_exec_key_warns_with_its_place_and_the_graph_runs(tmp_path: Path) -> None:
    made = tmp_path / "made"
    g = write(
        tmp_path,
        "graph: g\nresources:\n  exec:\n"
        "  - name: e\n"
        f"    cmd: touch {made}\n"
        "    shell: ''\n"
        "    timeout: 0\n"
        "    watchcmd: ''\n"
        "    watchshell: ''\n"
        "    ifcmd: ''\n"
        "    ifshell: ''\n"
        "    pollint: 0\n"
        "    state: present\n"
        "edges: []\n",
    )
    r = run(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    assert made.exists()
    for key in ("timeout", "pollint", "state"):
        where = f"{g}:{line_of(g, f'    {key}:')}:5"
        assert re.search(rf"{re.escape(where)}: exec\[e\]\.{key}: ignored", r.stderr), r.stderr
    warned = [line for line in r.stderr.splitlines() if ": ignored (" in line]
    assert len(warned) == 3, warned  # one each; the empty shells are real fields
    assert "use meta: {timeout: SECONDS}" in r.stderr


def test_top_level_remote_and_collect_pattern_warn_and_load(tmp_path: Path) -> None:
    g = write(
        tmp_path,
        "graph: g\nresources:\n  noop:\n  - name: n\n"
        "collect:\n- kind: file\n  pattern: /tmp/somewhere/\n"
        "edges: []\n"
        "remote: ssh://root@host:22\n",
    )
    r = run_cli("check", g)
    assert r.returncode == 0, r.stderr
    assert f"{g}:9:1: top-level `remote:`: ignored" in r.stderr
    assert f"{g}:7:3: collect `pattern:`: ignored" in r.stderr
    assert "is valid: 1 resources" in r.stdout


def test_a_large_graph_warns_each_key_twenty_times_then_counts_the_rest(tmp_path: Path) -> None:
    g = write(
        tmp_path,
        "graph: g\nresources:\n  exec:\n"
        + "".join(f"  - {{name: e{i}, cmd: 'true', pollint: 0}}\n" for i in range(25)),
    )
    r = run_cli("check", g)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert len([line for line in lines if ".pollint: ignored (" in line]) == 20
    assert lines[-1] == f"{g}: exec pollint: 5 more ignored the same way", lines
    r = subprocess.run(
        [str(REPO / "scripts" / "mgmt-compat"), str(tmp_path)], capture_output=True, text=True
    )
    assert r.stdout.splitlines()[0] == "warned    g.yaml: 25 ignored: exec pollint x25"


@pytest.mark.parametrize(
    ("text", "line", "said"),
    [
        (
            "graph: g\nresources:\n  exec:\n  - {name: e, cmd: 'true', watchshel: ''}\n",
            4,
            "exec[e].watchshel: unknown parameter; did you mean 'watchshell'",
        ),
        (
            "graph: g\nresource:\n  noop:\n  - name: n\nremote: x\n",
            2,
            "unknown top-level key 'resource' (expected: graph, resources, edges, collect,"
            " comment); did you mean 'resources'?",
        ),
        (
            "graph: g\nresources:\n  noop:\n  - name: n\ncollect:\n- {kind: file, filtr: {}}\n",
            6,
            "unknown key 'filtr' in collect (expected kind, filter); did you mean 'filter'?",
        ),
    ],
)
def test_a_typo_is_still_an_error_with_a_suggestion(
    tmp_path: Path, text: str, line: int, said: str
) -> None:
    r = run_cli("check", write(tmp_path, text))
    assert r.returncode == 2
    assert f"g.yaml:{line}:" in r.stderr, r.stderr
    assert said in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# -- mgmt's exec fields -----------------------------------------------------------------


def test_exec_commands_have_their_own_shell_and_cwd(tmp_path: Path) -> None:
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    (there / "marker").write_text("")
    out = tmp_path / "out"
    g = write(
        tmp_path,
        "graph: g\nresources:\n  exec:\n"
        "  - name: e\n"
        f"    cmd: touch ran-here\n"  # no shell: split and run directly, in cwd
        f"    cwd: {here}\n"
        "    ifcmd: test -e marker && test ! -e ran-here\n"  # needs a shell
        "    ifshell: /bin/sh\n"
        f"    ifcwd: {there}\n"
        f"    donecmd: pwd > {out}\n"
        "    doneshell: /bin/sh\n"
        f"    donecwd: {there}\n",
    )
    r = run(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    assert (here / "ran-here").exists()  # ifcmd ran by its shell, in ifcwd: passed
    assert out.read_text() == f"{there}\n"  # donecmd by its shell, in donecwd
    (there / "marker").unlink()
    (here / "ran-here").unlink()
    r = run(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    assert not (here / "ran-here").exists()  # no marker in ifcwd: held back


def test_exec_watchcmd_runs_in_its_own_shell(tmp_path: Path, agents) -> None:  # type: ignore[no-untyped-def]
    trigger, count = tmp_path / "trigger", tmp_path / "count"
    g = write(
        tmp_path,
        "graph: g\nresources:\n  exec:\n"
        "  - name: e\n"
        f"    cmd: sh -c 'echo run >> {count}'\n"
        # a shell loop: without watchshell it would not even start
        f"    watchcmd: while true; do if [ -e {trigger} ]; then rm {trigger}; echo go;"
        " fi; sleep 0.05; done\n"
        "    watchshell: /bin/sh\n",
    )
    agent = agents(g, tmp_path / "s")
    agent.wait_converged()
    assert count.read_text() == "run\n"
    trigger.write_text("")
    wait_for(lambda: count.read_text() == "run\nrun\n", what="the watchcmd's event ran cmd")
    assert agent.stop() == 0


@pytest.mark.parametrize(("equals", "runs"), [("ok\\n", False), ("ok", True)])
def test_exec_ifequals_holds_back_only_on_that_output(
    tmp_path: Path, equals: str, runs: bool
) -> None:
    made = tmp_path / "made"
    g = write(
        tmp_path,
        "graph: g\nresources:\n  exec:\n"
        f'  - {{name: e, cmd: "touch {made}", ifcmd: "echo ok", ifequals: "{equals}"}}\n',
    )
    r = run(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    assert made.exists() is runs


def test_exec_mtimes_forces_a_run_past_the_guards(tmp_path: Path) -> None:
    src, count = tmp_path / "src.c", tmp_path / "count"
    src.write_text("int main;")
    g = write(
        tmp_path,
        "graph: g\nresources:\n  exec:\n"
        f"  - {{name: build, shell: /bin/sh, cmd: 'echo built >> {count}', ifcmd: 'false',"
        f" mtimes: ['{src}']}}\n",
    )
    state = tmp_path / "s"
    assert run(g, state).returncode == 0
    assert count.read_text() == "built\n"  # never ran before: forced past ifcmd
    assert run(g, state).returncode == 0
    assert count.read_text() == "built\n"  # nothing newer: the guard holds it back
    later = src.stat().st_mtime + 60
    os.utime(src, (later, later))
    assert run(g, state).returncode == 0
    assert count.read_text() == "built\nbuilt\n"  # modified since: forced again
    src.unlink()
    r = run(g, state)
    assert r.returncode == 1
    assert f"mtimes: {src}: No such file or directory" in r.stderr


def test_exec_field_checks_name_the_field(tmp_path: Path) -> None:
    for body, said in [
        ("{name: e, cmd: 'true', ifcwd: rel}", "exec[e].ifcwd: 'rel' is not an absolute path"),
        ("{name: e, cmd: 'true', mtimes: [rel]}", "exec[e].mtimes: 'rel' is not an absolute"),
        ("{name: e, cmd: 'true', ifequals: x}", "exec[e].ifequals: compares ifcmd's output"),
    ]:
        r = run_cli("check", write(tmp_path, f"graph: g\nresources:\n  exec:\n  - {body}\n"))
        assert r.returncode == 2
        assert "g.yaml:4:" in r.stderr, r.stderr
        assert said in r.stderr, r.stderr


# -- mgmt's user fields -------------------------------------------------------------------


@pytest.fixture
def accounts() -> Iterator[Accounts]:
    acc = Accounts()
    try:
        yield acc
    finally:
        acc.cleanup()


def test_user_group_names_the_primary_group_and_a_duplicate_uid_may_be_allowed(
    tmp_path: Path, accounts: Accounts
) -> None:
    team, first, second = accounts.group("team"), accounts.user("a"), accounts.user("b")
    gid, uid = accounts.ids(2)
    g = write(
        tmp_path,
        f"graph: g\nresources:\n  group:\n  - {{name: {team}, gid: {gid}}}\n"
        f"  user:\n  - {{name: {first}, uid: {uid}, group: {team}}}\n"
        f"  - {{name: {second}, uid: {uid}, group: {team}, allowduplicateuid: true}}\n"
        f"edges:\n- {{from: {{kind: user, name: {first}}}, to: {{kind: user, name: {second}}}}}\n",
    )
    r = run(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    for name in (first, second):
        fields = passwd(name)
        assert fields is not None
        assert fields[2:4] == [str(uid), str(gid)], fields  # primary group: team
    # without allowduplicateuid the second account is refused its uid
    g.write_text(g.read_text().replace(", allowduplicateuid: true", ""))
    subprocess.run(["userdel", second], check=True, capture_output=True)
    r = run(g, tmp_path / "s")
    assert r.returncode == 1
    assert f"user[{second}]" in r.stderr


def test_user_group_and_gid_together_are_refused(tmp_path: Path) -> None:
    r = run_cli(
        "check",
        write(tmp_path, "graph: g\nresources:\n  user:\n  - {name: someone, gid: 5, group: x}\n"),
    )
    assert r.returncode == 2
    assert "g.yaml:4:" in r.stderr, r.stderr
    assert "user[someone].group: names the primary group, as gid does" in r.stderr


# -- mgmt's msg fields ----------------------------------------------------------------


def test_msg_body_is_logged_at_its_priority(tmp_path: Path) -> None:
    g = write(
        tmp_path,
        "graph: g\nresources:\n  msg:\n"
        "  - {name: loud, body: disk almost full, priority: Err}\n"
        "  - {name: quiet, body: all is well, priority: Debug}\n",
    )
    r = run(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    loud = next(line for line in r.stderr.splitlines() if "disk almost full" in line)
    assert "print[loud]: disk almost full" in loud  # msg is an alias of print
    assert " error: " in loud, loud
    assert "all is well" not in r.stderr  # Debug: shown only with -v
    r = run(g, tmp_path / "s", "-v")
    assert "print[quiet]: all is well" in r.stderr


@pytest.fixture
def dgram_socket(tmp_path: Path) -> Iterator[tuple[Path, socket.socket]]:
    """A datagram socket standing for the journal's or syslog's (the agent is told
    its path through EVERGRAPH_JOURNAL_SOCKET / EVERGRAPH_SYSLOG_SOCKET)."""
    path = tmp_path / "log.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        s.settimeout(10)  # the datagram is there once the run has ended
        yield path, s


def test_msg_journal_sends_body_priority_and_fields(
    tmp_path: Path, dgram_socket: tuple[Path, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sock = dgram_socket
    monkeypatch.setenv("EVERGRAPH_JOURNAL_SOCKET", str(path))
    g = write(
        tmp_path,
        "graph: g\nresources:\n  msg:\n"
        '  - name: m\n    body: "two\\nlines"\n    priority: Warning\n    journal: true\n'
        "    fields: {unit_name: web, ticket: '42'}\n",
    )
    r = run(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    data = sock.recv(65536)
    # a value with a newline goes as NAME, its 64-bit length, the bytes
    assert b"MESSAGE\n" + (9).to_bytes(8, "little") + b"two\nlines\n" in data
    lines = data.split(b"\n")
    for want in (b"PRIORITY=4", b"UNIT_NAME=web", b"TICKET=42", b"SYSLOG_IDENTIFIER=evergraph"):
        assert want in lines, data


def test_msg_syslog_sends_it_to_the_syslog_socket(
    tmp_path: Path, dgram_socket: tuple[Path, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sock = dgram_socket
    monkeypatch.setenv("EVERGRAPH_SYSLOG_SOCKET", str(path))
    g = write(
        tmp_path,
        "graph: g\nresources:\n  msg:\n  - {name: m, body: hello syslog, priority: Notice,"
        " syslog: true}\n",
    )
    r = run(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    data = sock.recv(65536).decode()
    assert re.fullmatch(r"<13>evergraph\[\d+\]: hello syslog", data), data  # user.notice


def test_msg_journal_without_a_journal_is_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nowhere = tmp_path / "no-journal.sock"
    monkeypatch.setenv("EVERGRAPH_JOURNAL_SOCKET", str(nowhere))
    g = write(tmp_path, "graph: g\nresources:\n  msg:\n  - {name: m, body: x, journal: true}\n")
    r = run(g, tmp_path / "s")
    assert r.returncode == 1
    assert f"journal: {nowhere}: No such file or directory" in r.stderr


def test_an_edge_may_name_a_msg_by_its_mgmt_kind(tmp_path: Path) -> None:
    g = write(
        tmp_path,
        "graph: g\nresources:\n  noop:\n  - name: tick\n  msg:\n  - {name: m, body: tock}\n"
        "edges:\n- {from: {kind: noop, name: tick}, to: {kind: msg, name: m}, notify: true}\n",
    )
    r = run(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    assert "print[m]: tock" in r.stderr


def test_msg_fields_are_checked(tmp_path: Path) -> None:
    for body, said in [
        ("{name: m, body: x, fields: {'_HIDDEN': v}}", "[m].fields: '_HIDDEN' is not"),
        ("{name: m, body: x, priority: info}", "[m].priority: Invalid enum value 'info'"),
        ("{name: m, msg: a, body: b}", "[m].body: is mgmt's name for msg"),
    ]:
        r = run_cli("check", write(tmp_path, f"graph: g\nresources:\n  msg:\n  - {body}\n"))
        assert r.returncode == 2
        assert "g.yaml:4:" in r.stderr, r.stderr
        assert said in r.stderr, r.stderr


# -- integers for text keep their source text ------------------------------------------


def test_mode_0741_is_octal_and_owner_1_is_a_uid(tmp_path: Path) -> None:
    f = tmp_path / "f"
    g = write(
        tmp_path,
        "graph: g\nresources:\n  file:\n"
        f"  - name: f\n    path: {f}\n    content: x\n    mode: 0741\n    owner: 1\n"
        "    group: 2\n",
    )
    r = run(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    st = f.stat()
    assert stat.S_IMODE(st.st_mode) == 0o741  # not 741 decimal (0o1345)
    assert (st.st_uid, st.st_gid) == (1, 2)


def test_integers_in_lists_and_mappings_keep_their_text(tmp_path: Path) -> None:
    out = tmp_path / "out"
    g = write(
        tmp_path,
        "graph: g\nresources:\n  exec:\n"
        f"  - {{name: e, cmd: /bin/sh, args: [-c, 'echo $N \"$0\" > {out}', 007],"
        " env: {N: 0x1F}}\n",
    )
    r = run(g, tmp_path / "s")
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "0x1F 007\n"


def test_a_float_or_boolean_for_text_still_says_to_quote_it(tmp_path: Path) -> None:
    r = run_cli(
        "check",
        write(tmp_path, "graph: g\nresources:\n  file:\n  - {name: /tmp/x, owner: true}\n"),
    )
    assert r.returncode == 2
    assert "file[/tmp/x].owner: expected str | null, got bool True: quote it" in r.stderr


# -- file: mgmt's semantics and fields -----------------------------------------------------


def test_content_with_state_absent_is_a_load_error_naming_its_place(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("keep me")
    g = write(
        tmp_path,
        f"graph: g\nresources:\n  file:\n  - name: f\n    path: {f}\n    content: gone\n"
        "    state: absent\n",
    )
    for command in (("check",), ("run", "--state-dir", str(tmp_path / "s"), "--converged-exit")):
        r = run_cli(*command[:1], g, *command[1:])
        assert r.returncode == 2
        assert f"{g}:7:12: file[f].state: absent cannot be combined with content" in r.stderr
    assert f.read_text() == "keep me"


def test_file_symlink_points_the_path_at_source(tmp_path: Path) -> None:
    link = tmp_path / "d" / "link"
    g = write(
        tmp_path,
        f"graph: g\nresources:\n  file:\n  - {{name: l, path: {link}, source: ../target,"
        " symlink: true}\n",
    )
    state = tmp_path / "s"
    r = run(g, state)
    assert r.returncode == 0, r.stderr
    assert os.readlink(link) == "../target"  # as written: relative to the link's directory
    assert run(g, state, "--noop").returncode == 0  # clean now
    link.unlink()
    link.symlink_to("/elsewhere")
    assert run(g, state).returncode == 0
    assert os.readlink(link) == "../target"  # re-pointed
    link.unlink()
    link.write_text("a file")
    r = run(g, state)
    assert r.returncode == 1  # a file in the way: only with force
    assert "exists and is not a symlink (force: true replaces it)" in r.stderr
    g.write_text(g.read_text().replace("symlink: true", "symlink: true, force: true"))
    assert run(g, state).returncode == 0
    assert os.readlink(link) == "../target"


def test_file_symlink_needs_a_source_and_no_content(tmp_path: Path) -> None:
    for body, said in [
        ("{name: /tmp/l, symlink: true}", "file[/tmp/l].symlink: needs source"),
        ("{name: /tmp/l, symlink: true, source: /a, mode: '0644'}", "mode: cannot be combined"),
    ]:
        r = run_cli("check", write(tmp_path, f"graph: g\nresources:\n  file:\n  - {body}\n"))
        assert r.returncode == 2
        assert "g.yaml:4:" in r.stderr, r.stderr
        assert said in r.stderr, r.stderr


# -- kv: mgmt's semantics ----------------------------------------------------------------


def world(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("world", *args, "--state-dir", state)


def test_kv_without_a_value_deletes_the_key(tmp_path: Path) -> None:
    state = tmp_path / "s"
    keep = write(tmp_path, "graph: g\nresources:\n  kv:\n  - {name: k, key: stage, value: '3'}\n")
    assert run(keep, state, "--world", "sqlite").returncode == 0
    assert world(state, "get", "kv/stage").stdout == "3\n"
    gone = write(tmp_path, "graph: g\nresources:\n  kv:\n  - {name: k, key: stage}\n", "gone.yaml")
    r = run(gone, state, "--world", "sqlite", "--noop")
    assert r.returncode == 3, r.stderr  # would delete it
    assert world(state, "get", "kv/stage").stdout == "3\n"
    r = run(gone, state, "--world", "sqlite")
    assert r.returncode == 0, r.stderr
    r = world(state, "get", "kv/stage")
    assert r.returncode != 0
    assert r.stdout == ""
    r = run(gone, state, "--world", "sqlite", "--noop")
    assert r.returncode == 0, r.stderr  # nothing to delete: clean


def test_a_readonly_kv_never_writes_nor_deletes(tmp_path: Path) -> None:
    state = tmp_path / "s"
    out = tmp_path / "out"
    assert run(write(tmp_path, "graph: g\nresources:\n  kv:\n  - {name: m, value: hi}\n"), state)
    g = write(
        tmp_path,
        f"graph: g\nresources:\n  kv:\n  - {{name: m, readonly: true}}\n"
        f"  file:\n  - {{name: {out}}}\n"
        f"edges:\n- {{from: {{kind: kv, name: m, send: value}}, to: {{kind: file, name: {out},"
        " recv: content}}\n",
        "read.yaml",
    )
    r = run(g, state)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "hi"
    assert world(state, "get", "kv/m").stdout == "hi\n"
    r = run_cli(
        "check",
        write(tmp_path, "graph: g\nresources:\n  kv:\n  - {name: m, readonly: true, value: x}\n"),
    )
    assert r.returncode == 2
    assert "kv[m].value: cannot be written by a readonly kv" in r.stderr


def test_pkg_takes_mgmts_packagekit_options(tmp_path: Path) -> None:
    g = write(
        tmp_path,
        "graph: g\nresources:\n  pkg:\n  - {name: powertop, state: installed,"
        " allowdowngrade: true, allownonfree: true, allowunsupported: false}\n",
    )
    r = run_cli("check", g)
    assert r.returncode == 0, r.stderr
    assert "1 resources (pkg: 1)" in r.stdout


# -- @@name: exported resources -----------------------------------------------------------


def test_an_at_at_name_is_exported_to_every_host_and_hidden_here(
    tmp_path: Path,
    agents,  # type: ignore[no-untyped-def]
) -> None:
    shared = tmp_path / "shared"
    g = write(
        tmp_path,
        f'graph: g\nresources:\n  file:\n  - name: "@@shared"\n    path: {shared}\n'
        "    content: for every host\n",
    )
    state = tmp_path / "s"
    agent = agents(g, state, "--hostname", "h1")
    agent.wait_converged()
    r = run_cli("exports", "--state-dir", state)
    assert r.returncode == 0, r.stderr
    # its name without @@; verified against this host's own key and its index
    assert r.stdout.splitlines() == ["*\th1\tfile[shared]\tsigned\tok"]
    assert not shared.exists()  # hidden: not applied on the exporting host
    assert agent.stop() == 0


def test_an_at_at_resource_is_applied_here_too_when_this_graph_collects_its_kind(
    tmp_path: Path,
) -> None:
    shared, other = tmp_path / "d" / "shared", tmp_path / "other"
    text = (
        f'graph: g\nresources:\n  file:\n  - name: "@@shared"\n    path: {shared}\n'
        f'    content: here too\n  - name: "@@other"\n    path: {other}\n    content: x\n'
        "collect:\n- kind: file\n  filter: {name: shared}\n"
    )
    r = run(write(tmp_path, text), tmp_path / "s")
    assert r.returncode == 0, r.stderr
    assert shared.read_text() == "here too"  # as mgmt, whose exporter collects its own
    assert not other.exists()  # not collected by this graph: hidden here


# -- mgmt's kinds evergraph lacks ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["virt:builder", "nspawn", "aws:ec2", "hetzner:vm", "bmc:power"])
def test_an_mgmt_kind_evergraph_lacks_is_named_as_such(tmp_path: Path, kind: str) -> None:
    g = write(tmp_path, f"graph: g\nresources:\n  noop:\n  - name: n\n  {kind}:\n  - name: x\n")
    r = run_cli("check", g)
    assert r.returncode == 2
    assert r.stderr == (
        f"evergraph: {g}:5:3: resource kind {kind!r} is one of mgmt's that evergraph does not"
        " provide yet (docs/mgmt-compatibility.md)\n"
    )


def test_a_kind_nobody_has_is_still_unknown(tmp_path: Path) -> None:
    r = run_cli("check", write(tmp_path, "graph: g\nresources:\n  fille:\n  - name: x\n"))
    assert r.returncode == 2
    assert "g.yaml:3:3: unknown resource kind 'fille'" in r.stderr
    assert "did you mean 'file'?" in r.stderr


# -- the compatibility runner ---------------------------------------------------------------


def test_the_runner_sorts_a_folder_of_graphs(tmp_path: Path) -> None:
    top = tmp_path / "graphs"
    (top / "nested").mkdir(parents=True)
    (top / "plain.yaml").write_text("graph: g\nresources:\n  noop:\n  - name: n\n")
    (top / "nested" / "old.yml").write_text(
        "graph: g\nresources:\n  exec:\n  - {name: a, cmd: 'true', timeout: 0, state: present}\n"
        "  - {name: b, cmd: 'true', timeout: 5}\nremote: ssh://h\n"
    )
    (top / "vm.yaml").write_text("graph: g\nresources:\n  nspawn:\n  - name: vm\n")
    (top / "notes.txt").write_text("not a graph")
    r = subprocess.run(
        [str(REPO / "scripts" / "mgmt-compat"), str(top)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "warned    nested/old.yml: 4 ignored: top-level `remote:`, exec timeout x2, exec state",
        "accepted  plain.yaml",
        "rejected  vm.yaml: line 3:3: resource kind 'nspawn' is one of mgmt's that evergraph does"
        " not provide yet (docs/mgmt-compatibility.md)",
        "total: 3 files: 1 accepted, 1 warned, 1 rejected",
    ]
    r = subprocess.run(
        [str(REPO / "scripts" / "mgmt-compat"), str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "not a directory" in r.stderr
