"""A real systemd user manager (`systemd --user`) for the tests of the kinds
that talk to systemd (svc, cron): this machine runs no systemd as PID 1, so it
runs in a private mount namespace, its units, runtime dir and bus under the
test's tmp dir. The `manager` fixture starts one with two units (`eg.service`,
which appends its PID to `tmp_path/starts` at each start, and `broken.service`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for

SYSTEMD = Path("/lib/systemd/systemd")


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
    """A running `UserManager` with units `eg.service` (appends its PID to
    `tmp_path/starts` at each start) and `broken.service`; the agents the test
    starts find its bus (DBUS_SESSION_BUS_ADDRESS)."""
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
