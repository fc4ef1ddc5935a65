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
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import EVERGRAPH, Agent, run_cli, wait_for

SYSTEM_SOCKET = Path("/run/dbus/system_bus_socket")
SYSTEM_PIDFILE = Path("/run/dbus/pid")
SYSTEMD = Path("/lib/systemd/systemd")


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


# -- a real systemd user manager -------------------------------------------------------


class UserManager:
    """`systemd --user` in a private mount namespace, everything under `base`."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.run = base / "run"
        self.units = base / "home" / ".config" / "systemd" / "user"
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(base / "home"),
            "XDG_RUNTIME_DIR": str(self.run),
            "XDG_CONFIG_HOME": str(base / "home" / ".config"),
            "XDG_DATA_HOME": str(base / "home" / ".local" / "share"),
            "XDG_STATE_HOME": str(base / "home" / ".local" / "state"),
            "XDG_CACHE_HOME": str(base / "home" / ".cache"),
        }
        self.bus = f"unix:path={self.run / 'bus'}"
        self.proc: subprocess.Popen[bytes] | None = None

    def unit(self, name: str, service: str, install: bool = True) -> None:
        self.units.mkdir(parents=True, exist_ok=True)
        wanted = "[Install]\nWantedBy=default.target\n" if install else ""
        (self.units / name).write_text(
            f"[Unit]\nDescription=evergraph test\n[Service]\n{service}\n{wanted}"
        )

    def start(self) -> None:
        self.run.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._log = open(self.base / "systemd.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                # systemd --user insists on a system booted with systemd
                "mount -t tmpfs tmpfs /run/systemd && mkdir /run/systemd/system"
                f" && exec {SYSTEMD} --user",
            ],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # the bus is socket-activated: a query starts dbus, then systemd joins it
        wait_for(self._on_bus, timeout=20, what="systemd --user on its bus")

    def _on_bus(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(
                f"systemd --user exited: {(self.base / 'systemd.log').read_text()}"
            )
        r = subprocess.run(
            [
                "dbus-send",
                f"--bus={self.bus}",
                "--print-reply",
                "--dest=org.freedesktop.DBus",
                "/org/freedesktop/DBus",
                "org.freedesktop.DBus.NameHasOwner",
                "string:org.freedesktop.systemd1",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return "boolean true" in r.stdout

    def systemctl(self, *args: str) -> str:
        """systemctl as an admin would run it (inside the namespace: over D-Bus)."""
        assert self.proc is not None
        r = subprocess.run(
            ["nsenter", "-t", str(self.proc.pid), "-m", "systemctl", "--user", *args],
            capture_output=True,
            text=True,
            timeout=30,
            env=self.env,
        )
        return r.stdout.strip()

    def stop(self) -> None:
        if self.proc is None:
            return
        children = _descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # a user manager stops its units, exits
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in children:  # whatever outlived it, by PID
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._log.close()


def _descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    found, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found.extend(kids)
        todo.extend(kids)
    return found


def _can_run_user_manager() -> str:
    if not SYSTEMD.exists() or not shutil.which("unshare") or not shutil.which("nsenter"):
        return "needs systemd, unshare and nsenter installed"
    if os.geteuid() != 0 or not Path("/run/systemd").is_dir():
        return "needs root and /run/systemd to mount over in a private namespace"
    return ""


needs_user_manager = pytest.mark.skipif(
    bool(_can_run_user_manager()), reason=_can_run_user_manager()
)


@pytest.fixture
def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[UserManager]:
    m = UserManager(tmp_path / "sd")
    starts = tmp_path / "starts"
    m.unit("eg.service", f"ExecStart=/bin/sh -c 'echo $$$$ >> {starts}; exec sleep infinity'")
    m.unit("broken.service", "Type=oneshot\nExecStart=/bin/false")
    try:
        m.start()
        # the agents we start find the user bus through the environment
        monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", m.bus)
        yield m
    finally:
        m.stop()


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
    assert len(starts(tmp_path)) == 1
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
    assert len(starts(tmp_path)) == 1
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
