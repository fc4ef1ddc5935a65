"""Commands die with their agent: a parent-death signal on every child, and the
start-up sweep of what a killed agent's commands left running."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from evergraph.resources import _proc
from tests.conftest import Agent, wait_for


@pytest.fixture
def shared() -> Iterator[Path]:
    """A world-writable dir (nobody cannot reach pytest's 0700 temp tree)."""
    d = Path(tempfile.mkdtemp(prefix="evergraph-test-"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for init."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(b")") + 2 :].split()[0] == b"Z"


def pids(path: Path) -> list[int]:
    try:
        return [int(x) for x in path.read_text().split()]
    except FileNotFoundError:
        return []


def kill9(agent: Agent) -> None:
    os.kill(agent.proc.pid, signal.SIGKILL)
    agent.proc.wait()


def kill_left(pidfile: Path) -> None:
    """A failed test leaves no command running (these are not our children)."""
    for pid in pids(pidfile):
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def stop(agent: Agent) -> None:
    """SIGTERM twice: the second cancels the running command (the first waits for it)."""
    agent.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "stopping:" in agent.log.read_text() or agent.proc.poll() is not None)
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.stop() == 1  # the cancelled command failed


def exec_graph(tmp_path: Path, cmd: str, extra: str = "") -> Path:
    g = tmp_path / "g.yaml"
    g.write_text(
        f"graph: p\nresources:\n  exec:\n  - {{name: long, shell: /bin/sh, cmd: '{cmd}'{extra}}}\n"
    )
    return g


@pytest.mark.parametrize("user", ["", "nobody"])
def test_a_running_command_dies_with_its_agent(
    tmp_path: Path,
    shared: Path,
    agents: Callable[..., Agent],
    user: str,
) -> None:
    # `exec`: the command is the agent's child itself, whoever it runs as (a change
    # of user clears a parent-death signal set before it: ours is set after)
    pidfile = shared / "pid"
    g = exec_graph(
        tmp_path, f"echo $$ > {pidfile}; exec sleep 300", f", user: {user}" if user else ""
    )
    agent = agents(g, tmp_path / "s")
    wait_for(lambda: pids(pidfile), what="the command to start")
    (pid,) = pids(pidfile)
    try:
        assert not gone(pid)
        kill9(agent)
        wait_for(lambda: gone(pid), 5, "the command to die with its agent")
    finally:
        kill_left(pidfile)


def test_a_restarted_agent_first_kills_what_the_last_run_left(
    tmp_path: Path,
    agents: Callable[..., Agent],
) -> None:
    # The shell is the agent's child (it dies with it); `sleep` is the shell's child,
    # in its process group, which the parent-death signal does not reach. Each run
    # of the command first notes any earlier sleep still alive.
    sleeps, alive = tmp_path / "sleeps", tmp_path / "alive"
    cmd = (
        f"for p in $(cat {sleeps} 2>/dev/null); do "
        f's=$(cut -d" " -f3 /proc/$p/stat 2>/dev/null); '  # a zombie (Z) runs no more
        f'if [ -n "$s" ] && [ "$s" != Z ]; then echo $p >> {alive}; fi; done; '
        f"sleep 300 & echo $! >> {sleeps}; wait"
    )
    g = exec_graph(tmp_path, cmd)
    state = tmp_path / "s"
    try:
        ran_twice(agents, g, state, sleeps, alive)
    finally:
        kill_left(sleeps)


def ran_twice(
    agents: Callable[..., Agent], g: Path, state: Path, sleeps: Path, alive: Path
) -> None:
    first = agents(g, state)
    wait_for(lambda: len(pids(sleeps)) == 1, what="the first run's command")
    (survivor,) = pids(sleeps)
    wait_for(lambda: list(state.glob("vertices/exec/long/proc.*")), what="the shell's record")
    (record,) = state.glob("vertices/exec/long/proc.*")
    first_shell = int(record.name.split(".")[1])
    kill9(first)
    assert not gone(survivor)  # what PDEATHSIG cannot reach
    second = agents(g, state)
    wait_for(lambda: len(pids(sleeps)) == 2, what="the second run's command")
    assert gone(survivor)
    assert not alive.exists(), "the second run ran beside the first run's command"
    stop(second)
    assert f"killed process group {first_shell}" in second.log.read_text()
    assert not list(state.glob("vertices/exec/long/proc.*")), "records go when the child does"


def _record(state: Path, pid: int, started: int | None) -> Path:
    d = state / "vertices" / "exec" / f"n{pid}"
    d.mkdir(parents=True)
    rec = d / f"proc.{pid}"
    rec.write_text(f"{pid} {started} {_proc._boot_id()}\n")
    return rec


def test_the_sweep_kills_a_recorded_child_that_is_still_the_same_process(
    tmp_path: Path,
) -> None:
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        started = _proc.start_time(child.pid)
        assert started is not None
        rec = _record(tmp_path, child.pid, started)
        assert _proc.sweep_survivors(tmp_path) == [child.pid]
        assert child.wait(5) == -signal.SIGKILL
        assert not rec.exists()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_the_sweep_spares_a_reused_pid_and_drops_stale_records(tmp_path: Path) -> None:
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        started = _proc.start_time(other.pid)
        assert started is not None
        reused = _record(tmp_path, other.pid, started - 1)  # same pid, another process
        dead = _record(tmp_path, 2**22 + 7, 1)  # beyond pid_max: no such process or group
        garbage = tmp_path / "vertices" / "exec" / "g" / "proc.9"
        garbage.parent.mkdir(parents=True)
        garbage.write_text("half a rec")
        assert _proc.sweep_survivors(tmp_path) == []
        assert other.poll() is None
        assert [p for p in (reused, dead, garbage) if p.exists()] == []
    finally:
        other.kill()
        other.wait()


def test_the_sweep_ignores_records_of_another_boot(tmp_path: Path) -> None:
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        started = _proc.start_time(other.pid)
        d = tmp_path / "vertices" / "exec" / "b"
        d.mkdir(parents=True)
        (d / f"proc.{other.pid}").write_text(f"{other.pid} {started} some-other-boot\n")
        assert _proc.sweep_survivors(tmp_path) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
