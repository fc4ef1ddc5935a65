"""Real agent processes on loopback: what happens around an agent's start and end.

A save of the graph file at any moment of start-up is applied; one agent per
hostname (and per state dir); read-only commands never create a World; exports
live under the member lease (withdrawn when the agent dies, kept without a flap
when it restarts in time) and a change made while the World is unreachable is
published when it returns; hostnames are checked where the user wrote them.

No sleeps as synchronisation: every wait is on a file, a log line, the World's
sqlite file, or a process's exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from evergraph.world.etcd_server import EtcdServer
from tests.conftest import Agent, run_cli, wait_for
from tests.kit.agents import ExportPair, error_lines, exited, file_graph, holds, noop_graph, save
from tests.kit.worldfile import deletions, member, query, record, revision

AgentFactory = Callable[..., Agent]


# -- 1. start-up edits (the graph file is watched, then read once more) ----------------

#: seconds after the agent's spawn at which the graph file is saved: before the
#: agent read it, while it starts (World, membership, keys), around the moment
#: the watch is armed, and after the first graph converged
EDIT_DELAYS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0)


@pytest.mark.slow
def test_a_save_at_any_moment_of_start_up_is_applied(tmp_path: Path, agents: AgentFactory) -> None:
    for i, delay in enumerate(EDIT_DELAYS):
        out, g = tmp_path / f"x{i}", tmp_path / f"g{i}.yaml"
        save(g, file_graph("g", out, "A\n"))
        a = agents(g, tmp_path / f"s{i}", "--hostname", "h", "--world-db", str(tmp_path / f"w{i}"))
        time.sleep(delay)  # only varies the moment of the edit; results are waited on below
        save(g, file_graph("g", out, "B\n"))
        wait_for(holds(out, "B\n"), what=f"the save {delay}s after spawn applied")
        a.wait_converged()
        assert out.read_text() == "B\n", f"edit at {delay}s"
        assert a.stop() == 0, a.log.read_text()


# -- 2. one agent per hostname, one per state dir -------------------------------------


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def test_a_second_agent_for_a_live_hostname_is_refused_and_the_first_keeps_running(
    tmp_path: Path, agents: AgentFactory
) -> None:
    db, g = tmp_path / "world.sqlite", noop_graph(tmp_path)
    a = agents(g, tmp_path / "sa", "--hostname", "web1", "--world-db", str(db))
    a.wait_converged()
    first = member(db, "web1")
    assert first is not None
    assert first["pid"] == a.proc.pid
    keys, leases = record(db, "hostkeys/web1"), query(db, "SELECT id FROM leases")
    r = run_cli("run", g, "--state-dir", tmp_path / "sb", "--hostname", "web1", "--world-db", db)
    assert r.returncode == 2, r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1, r.stderr  # one line, no traceback or warnings
    assert (
        f"hostname 'web1' is held by another live agent (address {first['address']}, "
        f"pid {a.proc.pid}, started {_when(first['started'])})" in lines[0]
    )
    assert "--replace" in lines[0]
    # the refused agent left nothing behind: no lease, no keys of its own
    assert query(db, "SELECT id FROM leases") == leases
    assert record(db, "hostkeys/web1") == keys
    # the first agent runs on, still holding its record
    assert not exited(a)
    still = member(db, "web1")
    assert still is not None
    assert still["pid"] == a.proc.pid
    assert still["state"] == "running"
    assert "taken over" not in a.log.read_text()
    assert a.stop() == 0


def test_replace_takes_the_hostname_over_and_the_old_agent_stops(
    tmp_path: Path, agents: AgentFactory
) -> None:
    db, g = tmp_path / "world.sqlite", noop_graph(tmp_path)
    a = agents(g, tmp_path / "sa", "--hostname", "web1", "--world-db", str(db))
    a.wait_converged()
    b = agents(g, tmp_path / "sb", "--hostname", "web1", "--world-db", str(db), "--replace")
    b.wait_converged()
    wait_for(lambda: exited(a), what="the replaced agent exited")
    # a replaced agent stops as if asked to (SIGTERM): its graph was clean, status 0
    assert a.proc.returncode == 0, a.log.read_text()
    assert "hostname 'web1' was taken over by another agent" in a.log.read_text()
    # the record is the new agent's: the old one's goodbye did not overwrite it
    now = member(db, "web1")
    assert now is not None
    assert (now["pid"], now["state"]) == (b.proc.pid, "running"), now
    assert not exited(b), b.log.read_text()
    assert "taken over" not in b.log.read_text()
    r = run_cli("members", "--world-db", db)
    assert r.returncode == 0, r.stderr
    assert [ln.split("\t")[:2] for ln in r.stdout.splitlines()] == [["web1", "running"]]
    assert b.stop() == 0


def test_an_agent_killed_with_sigkill_restarts_on_its_own_record(
    tmp_path: Path, agents: AgentFactory
) -> None:
    db, g = tmp_path / "world.sqlite", noop_graph(tmp_path)
    state = tmp_path / "sa"
    a = agents(g, state, "--hostname", "web1", "--world-db", str(db))
    a.wait_converged()
    old = record(db, "members/web1")
    assert old is not None
    os.kill(a.proc.pid, signal.SIGKILL)  # no goodbye: the record stays live until its TTL
    a.proc.wait()
    assert record(db, "members/web1") == old
    (state / "converged.status").unlink()
    again = agents(g, state, "--hostname", "web1", "--world-db", str(db))
    again.wait_converged()
    now = member(db, "web1")
    assert now is not None
    assert now["pid"] == again.proc.pid
    # the previous run's lease is revoked once everything is under the new one
    wait_for(
        lambda: not query(db, "SELECT 1 FROM leases WHERE id = ?", old[1]),
        timeout=8,
        what="the killed run's lease revoked",
    )
    assert "held by another" not in again.log.read_text()
    assert again.stop() == 0


def test_a_second_agent_on_the_same_state_dir_is_refused(
    tmp_path: Path, agents: AgentFactory
) -> None:
    db, g = tmp_path / "world.sqlite", noop_graph(tmp_path)
    state = tmp_path / "sa"
    a = agents(g, state, "--hostname", "web1", "--world-db", str(db))
    a.wait_converged()
    # another hostname, so only the state dir's lock can refuse it
    r = run_cli("run", g, "--state-dir", state, "--hostname", "web2", "--world-db", db)
    assert r.returncode == 2, r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert f"another agent (pid {a.proc.pid}) is running with this state directory" in lines[0]
    assert str(state) in lines[0]
    assert member(db, "web2") is None  # it never joined the World
    assert not exited(a)
    assert a.stop() == 0


# -- 3. read-only commands never create a state dir or a World ------------------------

READ_ONLY = (
    ("members",),
    ("exports",),
    ("world", "get", "k"),
    ("world", "watch", "k/"),
    ("hosts",),
)


@pytest.mark.parametrize("cmd", READ_ONLY, ids=" ".join)
def test_read_only_commands_create_nothing(tmp_path: Path, cmd: tuple[str, ...]) -> None:
    missing = tmp_path / "no-such-state"
    r = run_cli(*cmd, "--state-dir", missing, timeout=30)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "no such state directory" in r.stderr
    assert str(missing) in r.stderr
    assert len(error_lines(r.stderr)) == 1, r.stderr
    assert not missing.exists()

    # a state dir that exists, but a World file that does not
    state = tmp_path / "state"
    state.mkdir()
    db = tmp_path / "nonexistent.sqlite"
    r = run_cli(*cmd, "--state-dir", state, "--world-db", db, timeout=30)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"{db}: no such World file" in r.stderr
    assert not db.exists()
    assert list(state.iterdir()) == []


# -- 4. exports live under the member lease -------------------------------------------


@pytest.mark.slow
def test_a_killed_exporters_records_are_withdrawn_within_the_ttl(
    tmp_path: Path, agents: AgentFactory
) -> None:
    db = tmp_path / "world.sqlite"
    p = ExportPair(tmp_path, agents, ("--world-db", str(db)))
    assert record(db, p.key) is not None
    swaps = p.b_swaps()
    killed = time.monotonic()
    os.kill(p.a.proc.pid, signal.SIGKILL)
    p.a.proc.wait()
    # the lease (TTL 10 s, renewed every 3.3 s) expires, B's World client sweeps it
    # and B's graph loses the collected resource. (Waited on in B's log: reading the
    # sqlite file every few ms would wake B's World client so often that it never
    # sweeps on its timer, only at its next keep-alive write, up to 3.3 s later.)
    wait_for(lambda: p.b_swaps() > swaps, timeout=12, what="B swapped the export out")
    took = time.monotonic() - killed
    assert took > 5, f"withdrawn after {took:.1f}s: not by the lease's expiry"
    assert record(db, p.key) is None
    assert member(db, "hosta") is None
    # the file stays, as any removed resource's does
    assert p.target.read_text() == "v1\n"
    assert p.b.stop() == 0


def test_an_exporter_restarted_within_the_ttl_keeps_its_records_without_a_flap(
    tmp_path: Path, agents: AgentFactory
) -> None:
    db = tmp_path / "world.sqlite"
    p = ExportPair(tmp_path, agents, ("--world-db", str(db)))
    before = record(db, p.key)
    assert before is not None
    old_lease = before[1]
    swaps = p.b_swaps()
    applied = p.b.log.read_text().count("applied")
    inode = p.target.stat().st_ino
    since = revision(db)
    os.kill(p.a.proc.pid, signal.SIGKILL)
    p.a.proc.wait()
    again = p.start_a()
    # re-published under the new lease, then the killed run's lease is revoked:
    # from here on nothing of the old run can expire
    wait_for(
        lambda: not query(db, "SELECT 1 FROM leases WHERE id = ?", old_lease),
        timeout=8,
        what="the killed run's lease revoked",
    )
    now = record(db, p.key)
    assert now is not None
    assert now[1] != old_lease
    assert deletions(db, p.key, since) == 0, "the record vanished while A restarted"
    assert deletions(db, "members/hosta", since) == 0
    # a barrier: B has read every World event up to a record it cannot verify yet
    barrier = ("exported/hostb/zz-barrier/file/x", "{}")
    r = run_cli("world", "put", "--world-db", db, "--state-dir", tmp_path / "cli", *barrier)
    assert r.returncode == 0, r.stderr
    wait_for(
        lambda: "waits for the key of its exporter zz-barrier" in p.b.log.read_text(),
        what="B read past A's re-publication",
    )
    # B saw equal parameters: no swap, nothing applied again
    assert p.b_swaps() == swaps, p.b.log.read_text()
    assert p.b.log.read_text().count("applied") == applied
    assert p.target.stat().st_ino == inode
    assert p.target.read_text() == "v1\n"
    assert again.stop() == 0
    assert p.b.stop() == 0


# -- 5. a change made while the World is unreachable is published when it returns -----


@pytest.mark.slow
def test_an_export_changed_while_etcd_is_stopped_arrives_when_it_resumes(
    tmp_path: Path, shm: Path, servers: list[EtcdServer], agents: AgentFactory
) -> None:
    server = EtcdServer.single(shm / "etcd")
    servers.append(server)
    server.start()
    assert server.pid is not None
    p = ExportPair(tmp_path, agents, ("--seeds", server.client_url))
    os.kill(server.pid, signal.SIGSTOP)
    try:
        p.export("v2\n")
        wait_for(
            lambda: "cannot publish exports" in p.a.log.read_text(),
            timeout=20,
            what="A failed to publish during the outage",
        )
    finally:
        os.kill(server.pid, signal.SIGCONT)
    p.wait_content("v2\n", timeout=60)
    assert not exited(p.a)
    assert not exited(p.b)
    assert p.a.stop() == 0
    assert p.b.stop() == 0


@pytest.mark.slow
def test_an_export_changed_while_the_sqlite_world_is_locked_arrives_when_released(
    tmp_path: Path, agents: AgentFactory
) -> None:
    db = tmp_path / "world.sqlite"
    p = ExportPair(tmp_path, agents, ("--world-db", str(db)))
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as hold:
        hold.execute("BEGIN EXCLUSIVE")  # no process can write the World now
        try:
            p.export("v2\n")
            # (each World write waits busy_timeout, 5 s, in the loop: under a loaded
            # machine's full suite the warning once took over 30 s)
            wait_for(
                lambda: "cannot publish exports" in p.a.log.read_text(),
                timeout=90,
                what="A failed to publish while the World was locked",
            )
        finally:
            hold.execute("ROLLBACK")
    p.wait_content("v2\n", timeout=60)
    assert not exited(p.a)
    assert not exited(p.b)
    assert p.a.stop() == 0
    assert p.b.stop() == 0


# -- 6. hostnames are checked where they were given -----------------------------------


def test_a_bad_hostname_flag_is_an_input_error(tmp_path: Path) -> None:
    g = noop_graph(tmp_path)
    r = run_cli(
        "run",
        g,
        "--hostname",
        "Bad/Name",
        "--state-dir",
        tmp_path / "s",
        "--world-db",
        tmp_path / "world.sqlite",
    )
    assert r.returncode == 2, r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert "--hostname: 'Bad/Name' is not a valid hostname" in lines[0]


def test_a_bad_export_target_names_its_line_and_field(tmp_path: Path) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: g\nresources:\n  file:\n"
        f"  - name: {tmp_path / 'x'}\n"
        "    content: hi\n"
        '    meta: {export: ["a/b"]}\n'
    )
    for args in (
        ("check", g),
        ("run", g, "--state-dir", tmp_path / "s", "--world-db", tmp_path / "world.sqlite"),
    ):
        r = run_cli(*args)
        assert r.returncode == 2, r.stderr
        lines = error_lines(r.stderr)
        assert len(lines) == 1, r.stderr
        assert f"{g}:6:" in lines[0]
        assert ".meta.export: 'a/b' is not a valid hostname" in lines[0]
    assert not (tmp_path / "x").exists()
