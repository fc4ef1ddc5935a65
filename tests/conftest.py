"""Shared fixtures: run the real CLI as a subprocess, wait on files, clean up by PID."""

from __future__ import annotations

import asyncio
import asyncio.runners
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from evergraph.world.etcd_server import EtcdServer

#: the kit modules that define fixtures, registered once here so that every test
#: module finds them by name (a test imports only the kit's functions and classes)
pytest_plugins = [
    "tests.kit.accounts",
    "tests.kit.libvirtbed",
    "tests.kit.machine",
    "tests.kit.namespaces",
    "tests.kit.netbed",
    "tests.kit.sshbed",
    "tests.kit.systemd",
    "tests.kit.terminal",
]

EVERGRAPH = [sys.executable, "-m", "evergraph.cli.main"]
#: a command line's prefix that runs it with SIGINT at its default. A process started
#: with SIGINT ignored keeps it ignored across exec, and Python then installs no
#: KeyboardInterrupt handler (nor asyncio.run its Ctrl-C handler): so is every process
#: of a test run that a non-interactive shell started in the background
#: (`scripts/test &`, or the first of two suites started at once). A test whose SIGINT
#: stands for a terminal's Ctrl-C starts its process under this (an exec, not a
#: preexec_fn: see resources/_proc.py)
SIGINT_DEFAULT = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])",
]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="session")
def _own_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The caches evergraph keeps in $XDG_CACHE_HOME (the remote bundle's hashes,
    plans and bytecode; the parse cache of runs without --state-dir) go to the
    session's temp dir, for every process the tests start: never root's ~/.cache."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = old


def wait_for(pred: Callable[[], object], timeout: float = 15.0, what: str = "condition") -> None:
    """Poll a condition on the filesystem (or a process) until it holds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


def status_lines(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except FileNotFoundError:
        return []


def run_cli(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EVERGRAPH, *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def host_key(state: Path) -> str:
    """The host key of a state dir (`PUBLIC:VERIFY`), as `evergraph hosts key` prints it
    (made if none yet): what `--farm-server NAME=KEY` takes."""
    r = run_cli("hosts", "key", "--state-dir", state)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


class Agent:
    """A background `evergraph run` whose convergence we can await."""

    def __init__(self, graph: Path | None, state: Path, *extra: str) -> None:
        self.status = state / "converged.status"
        self.log = state / "agent.log"
        state.mkdir(parents=True, exist_ok=True)
        self._logf = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                *EVERGRAPH,
                "run",
                *([str(graph)] if graph is not None else []),  # none: follow deploys
                "--state-dir",
                str(state),
                "--converged-timeout",
                "0.05",
                "--converged-status-file",
                str(self.status),
                *extra,
            ],
            stdout=self._logf,
            stderr=subprocess.STDOUT,
        )

    def converged_count(self) -> int:
        return status_lines(self.status).count("true")

    def wait_converged(self, count: int = 1, timeout: float = 20) -> None:
        """Wait for the `count`-th converged transition, with the agent converged now."""

        def ok() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited early:\n{self.log.read_text()}")
            lines = status_lines(self.status)
            return lines.count("true") >= count and lines[-1] == "true"

        wait_for(ok, timeout, f"converged #{count}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._logf.close()
        return self.proc.returncode


@pytest.fixture
def agents() -> Iterator[Callable[..., Agent]]:
    started: list[Agent] = []

    def start(graph: Path | None, state: Path, *extra: str) -> Agent:
        a = Agent(graph, state, *extra)
        started.append(a)
        return a

    yield start
    for a in started:
        a.stop()


@pytest.fixture
def shm() -> Iterator[Path]:
    """A temp dir on /dev/shm (etcd's data: fast, and no fsync cost)."""
    d = Path(tempfile.mkdtemp(prefix="evergraph-etcd-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def servers() -> Iterator[list[EtcdServer]]:
    """Every etcd server a test appends here is stopped (by its PID) when the test ends."""
    started: list[EtcdServer] = []
    yield started
    for s in started:
        s.stop()
    assert not any(s.running for s in started)


def _live_children() -> dict[int, str]:
    """This process's children that are alive (not zombies): pid -> command."""
    me = os.getpid()
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        comm_end = stat.rfind(")")
        fields = stat[comm_end + 2 :].split()
        if int(fields[1]) == me and fields[0] != "Z":
            out[int(entry)] = stat[stat.find("(") + 1 : comm_end]
    return out


@pytest.fixture(autouse=True)
def no_leaks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a test that leaves an asyncio task pending when its `asyncio.run` ends, or
    a child process running when it ends (those are killed, by PID, first)."""
    leaked: list[str] = []
    original = asyncio.runners._cancel_all_tasks  # type: ignore[attr-defined]

    def checking(loop: asyncio.AbstractEventLoop) -> None:
        for t in asyncio.all_tasks(loop):
            if not t.done():
                leaked.append(repr(t.get_coro()))
        original(loop)

    monkeypatch.setattr(asyncio.runners, "_cancel_all_tasks", checking)
    before = set(_live_children())
    yield
    left = {pid: cmd for pid, cmd in _live_children().items() if pid not in before}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    problems = []
    if leaked:
        problems.append(f"asyncio tasks left pending: {', '.join(sorted(set(leaked)))}")
    if left:
        problems.append(f"child processes left running: {left}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
