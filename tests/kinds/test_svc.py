"""svc: a clear failure where no systemd answers; against a real `systemd --user`, the timeline.

This machine runs no systemd as PID 1, so the system-bus paths can only be
shown to fail cleanly. The same D-Bus calls are exercised for real through
`session: true` against a real systemd user manager that the fixture starts
in a private mount namespace (where `/run/systemd/system` exists, which
systemd requires; nobody else sees it), with its runtime, config and bus
directories in the test's tmp dir.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import EVERGRAPH, Agent, run_cli, wait_for
from tests.kit.machine import MACHINE_WIDE
from tests.kit.systemd import UserManager, needs_user_manager

pytestmark = MACHINE_WIDE

SYSTEM_SOCKET = Path("/run/dbus/system_bus_socket")
SYSTEM_PIDFILE = Path("/run/dbus/pid")


def graph(tmp_path: Path, svc: str, extra: str = "") -> Path:
    g = tmp_path / "g.yaml"
    g.write_text(f"graph: s\nresources:\n  svc:\n  - {svc}\n{extra}")
    return g


def run_once(g: Path, state: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    r = subprocess.run(
        [*EVERGRAPH, "run", str(g), "--state-dir", str(state), "--converged-exit", "-vv"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    return r.returncode, r.stderr


# -- no systemd here ---------------------------------------------------------------


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def system_bus() -> Iterator[None]:
    """A system bus without systemd: the running one, or one we start and stop."""
    if _answers(SYSTEM_SOCKET):
        yield  # someone else's (another test, or the machine's): leave it alone
        return
    had = {p: p.exists() for p in (SYSTEM_PIDFILE, SYSTEM_SOCKET)}
    Path("/run/dbus").mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["dbus-daemon", "--system", "--fork", "--print-pid"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        # started by someone else meanwhile? then use theirs
        if _answers(SYSTEM_SOCKET):
            yield
            return
        pytest.fail(f"cannot start a system dbus-daemon: {r.stderr.strip()}")
    pid = int(r.stdout.split()[0])
    try:
        wait_for(lambda: _answers(SYSTEM_SOCKET), what="the system bus")
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        wait_for(lambda: _gone(pid), what="dbus-daemon to exit")
        for p, existed in had.items():
            if not existed:
                p.unlink(missing_ok=True)


def test_no_system_bus_is_a_clear_failure_and_the_rest_still_runs(tmp_path: Path) -> None:
    other = tmp_path / "other"
    g = graph(tmp_path, "{name: nginx, state: running}", f"  file:\n  - {{name: {other}}}\n")
    env = dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=f"unix:path={tmp_path / 'no-bus'}")
    rc, err = run_once(g, tmp_path / "s", env)
    assert rc == 1, err
    lines = [line for line in err.splitlines() if "svc[nginx]" in line]
    assert (
        "svc[nginx]: init failed: systemd's D-Bus API is not reachable on the system bus:"
        in (lines[0])
    )
    assert f"no bus at {tmp_path / 'no-bus'}" in lines[0]
    assert "Traceback" not in err
    assert other.exists()  # the rest of the graph converged


def test_a_system_bus_without_systemd_is_a_clear_failure(tmp_path: Path, system_bus) -> None:  # type: ignore[no-untyped-def]
    g = graph(tmp_path, "{name: nginx, state: running, startup: enabled}")
    env = {k: v for k, v in os.environ.items() if k != "DBUS_SYSTEM_BUS_ADDRESS"}
    rc, err = run_once(g, tmp_path / "s", env)
    assert rc == 1, err
    assert (
        "svc[nginx]: init failed: systemd's D-Bus API is not reachable on the system bus: "
        f"the bus at {SYSTEM_SOCKET} has no org.freedesktop.systemd1 (is systemd running?)"
    ) in err
    assert "Traceback" not in err


def test_no_user_bus_is_a_clear_failure(tmp_path: Path) -> None:
    g = graph(tmp_path, "{name: app, state: running, session: true}")
    env = dict(os.environ, DBUS_SESSION_BUS_ADDRESS=f"unix:path={tmp_path / 'no-bus'}")
    rc, err = run_once(g, tmp_path / "s", env)
    assert rc == 1, err
    assert "svc[app]: init failed: systemd's D-Bus API is not reachable on the user bus" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("svc", "needle"),
    [
        ("{name: web, state: jumping}", "svc[web].state: Invalid enum value 'jumping'"),
        ("{name: web, startup: sometimes}", "svc[web].startup: Invalid enum value 'sometimes'"),
        ("{name: web, session: maybe}", "svc[web].session: expected bool"),
        ("{name: 'a/b', state: running}", "svc[a/b].name: 'a/b' is not a systemd unit name"),
    ],
)
def test_bad_parameters_are_load_errors(tmp_path: Path, svc: str, needle: str) -> None:
    g = graph(tmp_path, svc)
    rc, err = run_once(g, tmp_path / "s")
    assert rc == 2
    assert needle in err
    assert f"{g}:4:" in err
    assert "Traceback" not in err
    assert not (tmp_path / "s").exists()
    r = run_cli("check", g)
    assert r.returncode == 2
    assert needle in r.stderr


def starts(tmp_path: Path) -> list[str]:
    try:
        return (tmp_path / "starts").read_text().split()
    except FileNotFoundError:
        return []


@needs_user_manager
def test_timeline_start_enable_keep_and_repair(
    tmp_path: Path, manager: UserManager, agents: Callable[..., Agent]
) -> None:
    g = graph(tmp_path, "{name: eg, state: running, startup: enabled, session: true}")
    link = manager.units / "default.target.wants" / "eg.service"
    state = tmp_path / "s"
    # from scratch: enabled and started
    rc, err = run_once(g, state)
    assert rc == 0, err
    assert "svc[eg]: enabled eg.service" in err
    assert "svc[eg]: started eg.service" in err
    assert manager.systemctl("is-active", "eg") == "active"
    assert link.is_symlink()
    # (active as soon as systemd forked it: its shell writes the mark a moment later)
    wait_for(lambda: len(starts(tmp_path)) == 1, what="eg's start mark")
    # a second run is clean
    rc, err = run_once(g, state)
    assert rc == 0, err
    assert ": applied" not in err
    assert len(starts(tmp_path)) == 1
    # drift made by an admin while the agent runs is seen (D-Bus signals) and repaired
    agent: Agent = agents(g, state, "-v")
    agent.wait_converged()
    manager.systemctl("stop", "eg")
    wait_for(lambda: len(starts(tmp_path)) == 2, what="the stopped unit started again")
    wait_for(lambda: manager.systemctl("is-active", "eg") == "active", what="active again")
    manager.systemctl("disable", "eg")
    wait_for(link.is_symlink, what="the disabled unit enabled again")
    assert manager.systemctl("is-enabled", "eg") == "enabled"
    assert agent.stop() == 0
    log = agent.log.read_text()
    assert log.count("svc[eg]: started eg.service") == 1
    assert log.count("svc[eg]: enabled eg.service") == 1


@needs_user_manager
def test_stopped_and_disabled_and_refresh(
    tmp_path: Path, manager: UserManager, agents: Callable[..., Agent]
) -> None:
    manager.systemctl("enable", "--now", "eg")
    wait_for(lambda: len(starts(tmp_path)) == 1, what="started by hand")
    link = manager.units / "default.target.wants" / "eg.service"
    assert link.is_symlink()
    g = graph(tmp_path, "{name: eg.service, state: stopped, startup: disabled, session: true}")
    rc, err = run_once(g, tmp_path / "s")
    assert rc == 0, err
    assert manager.systemctl("is-active", "eg") == "inactive"
    assert not link.exists()
    assert "svc[eg.service]: stopped eg.service" in err
    # running again; a change of its config file (notify edge) restarts it
    conf = tmp_path / "eg.conf"
    g = graph(
        tmp_path,
        "{name: eg, state: running, session: true}",
        f"  file:\n  - {{name: {conf}, content: 'v1'}}\n"
        "edges:\n- from: {kind: file, name: " + str(conf) + "}\n"
        "  to: {kind: svc, name: eg}\n  notify: true\n",
    )
    agent: Agent = agents(g, tmp_path / "s2", "-v")
    agent.wait_converged()
    before = starts(tmp_path)
    assert manager.systemctl("is-active", "eg") == "active"
    conf.write_text("edited by hand")  # repaired: a change, so svc[eg] is refreshed
    wait_for(lambda: len(starts(tmp_path)) == len(before) + 1, what="restarted by the refresh")
    assert agent.stop() == 0
    assert "svc[eg]: reloaded or restarted (refresh) eg.service" in agent.log.read_text()


@needs_user_manager
def test_failures_name_the_unit(tmp_path: Path, manager: UserManager) -> None:
    g = graph(tmp_path, "{name: broken, state: running, session: true}")
    rc, err = run_once(g, tmp_path / "s")
    assert rc == 1, err
    assert "svc[broken]: StartUnit broken.service: job failed" in err
    g = graph(tmp_path, "{name: nosuch, state: running, session: true}")
    rc, err = run_once(g, tmp_path / "s")
    assert rc == 1, err
    assert "svc[nosuch]: nosuch.service: no such unit: cannot start it" in err
    assert "Traceback" not in err


@needs_user_manager
def test_the_watch_reconnects_after_the_bus_restarts(
    tmp_path: Path, manager: UserManager, agents: Callable[..., Agent]
) -> None:
    g = graph(tmp_path, "{name: eg, state: running, session: true, meta: {retry: -1, delay: 100}}")
    agent: Agent = agents(g, tmp_path / "s", "-v")
    agent.wait_converged()
    wait_for(lambda: len(starts(tmp_path)) == 1, what="eg's start mark")
    bus_pid = int(manager.systemctl("show", "-p", "MainPID", "--value", "dbus.service"))
    assert bus_pid > 0
    os.kill(bus_pid, signal.SIGKILL)  # the user bus dies (socket activation brings it back)
    wait_for(
        lambda: "restarting it" in agent.log.read_text(), what="the watch noticing the lost bus"
    )
    wait_for(lambda: manager._on_bus(), what="systemd back on a new bus")
    # reconnected: drift is seen again
    # stopped while the agent may still be reconnecting: caught up either way
    manager.systemctl("stop", "eg")
    wait_for(lambda: len(starts(tmp_path)) == 2, what="the stopped unit started again")
    # and watched again afterwards
    wait_for(lambda: manager.systemctl("is-active", "eg") == "active", what="active again")
    manager.systemctl("stop", "eg")
    wait_for(lambda: len(starts(tmp_path)) == 3, what="started again after the reconnect")
    assert agent.stop() == 0
