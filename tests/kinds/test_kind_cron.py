"""cron: the timeline against a real `systemd --user`, whose timer really fires.

This machine runs no systemd as PID 1; `UserManager` (tests/kit/systemd.py)
starts a real systemd user manager in a private mount namespace, its units,
runtime and bus in the test's tmp dir (the agent is pointed there with XDG_CONFIG_HOME and
DBUS_SESSION_BUS_ADDRESS). Drift is made as an admin would: `systemctl --user`
inside that namespace, and edits of the unit file. The unit files are also
checked with `systemd-analyze verify`.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from evergraph.resources.cron import Cron
from tests.conftest import EVERGRAPH, Agent, wait_for
from tests.kit.kinds import refused
from tests.kit.machine import MACHINE_WIDE
from tests.kit.systemd import UserManager, needs_user_manager

pytestmark = MACHINE_WIDE


@pytest.fixture
def user_manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[UserManager]:
    m = UserManager(tmp_path / "sd")
    try:
        m.start()
        # the agents find the user bus and the user's unit directory through these
        monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", m.bus)
        monkeypatch.setenv("XDG_CONFIG_HOME", m.env["XDG_CONFIG_HOME"])
        yield m
    finally:
        m.stop()


def run_once(g: Path, state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EVERGRAPH, "run", str(g), "--state-dir", str(state), "--converged-exit", *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_user_manager
def test_timeline(tmp_path: Path, user_manager: UserManager, agents: Callable[..., Agent]) -> None:
    m = user_manager
    ran = tmp_path / "ran"
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: g\nresources:\n  cron:\n  - name: egtick\n    session: true\n"
        "    trigger: OnActiveSec\n    time: 1s\n    accuracysec: 1ms\n"
        f"    command: echo fired >> {ran}\n"
        "    startup: enabled\n    meta: {reverse: true}\n"
    )
    timer, service = m.units / "egtick.timer", m.units / "egtick.service"
    link = m.units / "timers.target.wants" / "egtick.timer"
    agent = agents(g, tmp_path / "s", "-v")
    agent.wait_converged()
    # applied: both units written, the timer started and enabled, and it really fires
    assert "OnActiveSec=1s\n" in timer.read_text()
    assert f'ExecStart=/bin/sh -c "echo fired >> {ran}"\n' in service.read_text()
    assert m.systemctl("is-active", "egtick.timer") == "active"
    assert link.is_symlink()
    wait_for(lambda: ran.exists() and ran.read_text() == "fired\n", what="the timer to fire")
    # drift: the timer stopped by an admin (D-Bus signal), started again
    m.systemctl("stop", "egtick.timer")
    wait_for(lambda: agent.log.read_text().count("started egtick.timer") == 2, what="restart")
    assert m.systemctl("is-active", "egtick.timer") == "active"
    # drift: the unit file edited (inotify): written back, systemd reloaded, restarted
    text = timer.read_text()
    timer.write_text(text.replace("OnActiveSec=1s", "OnActiveSec=1h"))
    wait_for(lambda: timer.read_text() == text, what="the timer file written back")
    wait_for(
        lambda: m.systemctl("show", "-p", "NeedDaemonReload", "--value", "egtick.timer") == "no",
        what="systemd's copy current",
    )
    wait_for(lambda: "restarted egtick.timer" in agent.log.read_text(), what="the restart")
    # drift: disabled by an admin, enabled again
    m.systemctl("disable", "egtick.timer")
    wait_for(link.is_symlink, what="enabled again")
    # a check from outside finds it clean
    r = run_once(g, tmp_path / "s2", "--noop")
    assert r.returncode == 0, r.stderr
    assert "nothing would change or failed, 1 clean" in r.stderr
    # reversal: there was no timer before: stopped, disabled, its files removed
    g.write_text("graph: g\nresources:\n  noop:\n  - name: n\n")
    wait_for(lambda: not timer.exists() and not service.exists(), what="the units removed")
    assert not link.exists()
    assert m.systemctl("is-active", "egtick.timer") == "inactive"
    assert agent.stop() == 0


@needs_user_manager
def test_a_time_systemd_refuses_is_a_clear_failure(
    tmp_path: Path, user_manager: UserManager
) -> None:
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: g\nresources:\n  cron:\n"
        "  - {name: eg, session: true, trigger: OnCalendar, time: 'no such day'}\n"
    )
    r = run_once(g, tmp_path / "s")
    assert r.returncode == 1, r.stderr
    assert "cron[eg]: eg.timer: systemd's load state is 'bad-setting'" in r.stderr
    assert "Traceback" not in r.stderr


def test_no_user_bus_is_a_clear_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", f"unix:path={tmp_path / 'no-bus'}")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    g = tmp_path / "g.yaml"
    g.write_text(
        "graph: g\nresources:\n  cron:\n"
        "  - {name: eg, session: true, trigger: OnCalendar, time: daily}\n"
    )
    r = run_once(g, tmp_path / "s")
    assert r.returncode == 1, r.stderr
    assert "cron[eg]: init failed: systemd's D-Bus API is not reachable on the user bus" in r.stderr
    assert not (tmp_path / "config").exists()  # nothing written without systemd


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")
def test_the_unit_files_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    cron = Cron(
        name="egtick",
        trigger="OnCalendar",
        time="Mon..Fri *-*-* 03:00:00",
        accuracysec="1s",
        randomizeddelaysec="5min",
        persistent=True,
        remainafterelapse=False,
        command='echo "it\'s $HOME at 100%" >> /tmp/x',
    )
    paths = []
    for path, text in cron._files().items():
        paths.append(tmp_path / Path(path).name)
        paths[-1].write_text(text)
    r = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    service = (tmp_path / "egtick.service").read_text()
    # systemd's own unquoting gives the shell the command as written
    assert 'ExecStart=/bin/sh -c "echo \\"it\'s $$HOME at 100%%\\" >> /tmp/x"\n' in service


BAD_INPUT = [
    ("{name: eg, time: daily}", "cron[eg].trigger: needs a trigger: one of OnCalendar"),
    ("{name: eg, trigger: Daily, time: x}", "cron[eg].trigger: 'Daily' is not a trigger"),
    ("{name: eg, trigger: OnCalendar}", "cron[eg].time: needs the value of OnCalendar"),
    ("{name: 'a/b', trigger: OnCalendar, time: daily}", "cron[a/b].name: 'a/b' cannot name"),
    ("{name: eg, state: on, trigger: OnCalendar, time: daily}", "cron[eg].state: Invalid"),
    ("{name: eg, startup: yes, trigger: OnCalendar, time: daily}", "cron[eg].startup: "),
    ("{name: eg, unit: x.timer, trigger: OnCalendar, time: x}", "cron[eg].unit: 'x.timer'"),
    ('{name: eg, trigger: OnCalendar, time: "a\\nb"}', "cron[eg].time: must be one line"),
]


@pytest.mark.parametrize(("item", "needle"), BAD_INPUT)
def test_bad_input_is_exit_2_and_changes_nothing(
    tmp_path: Path, item: str, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    g = tmp_path / "g.yaml"
    g.write_text(f"graph: g\nresources:\n  cron:\n  - {item}\n")
    # in process, as `evergraph check` loads it; one of them end to end: exit 2,
    # nothing changed
    if not refused(g, needle, f"{g}:4:", end_to_end=(item, needle) == BAD_INPUT[0]):
        return
    r = run_once(g, tmp_path / "s")
    assert r.returncode == 2, r.stderr
    assert not (tmp_path / "config").exists()
    assert not (tmp_path / "s").exists()
