"""Agents in namespaces of their own, for the kinds that change the machine
(hostname, mount, net): `unshare` makes the namespaces, a shell sets them up
(an overlay over /etc, an interface), then the agent runs inside; the test
looks in, or makes drift, with `nsenter`."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.conftest import EVERGRAPH, status_lines, wait_for


def _child_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
    except FileNotFoundError:
        return None
    return int(kids[0]) if kids else None


def _shell(setup: str) -> list[str]:
    """A shell that runs `setup`, then execs its arguments."""
    return ["sh", "-ec", f'{setup}\nexec "$@"', "sh"]


class NsAgent:
    """`evergraph run` in namespaces of its own: `unshare FLAGS --fork`, then the shell
    `setup` (mounts, ...) inside, then the agent (exec'd, so its pid is the child's)."""

    def __init__(
        self,
        graph: Path,
        state: Path,
        flags: Sequence[str],
        setup: str = "true",
        *extra: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.status = state / "converged.status"
        self.log = state / "agent.log"
        state.mkdir(parents=True, exist_ok=True)
        self._logf = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        run = [
            *EVERGRAPH,
            "run",
            str(graph),
            "--state-dir",
            str(state),
            "--converged-timeout",
            "0.05",
            "--converged-status-file",
            str(self.status),
            *extra,
        ]
        self.proc = subprocess.Popen(
            ["unshare", *flags, "--fork", "--kill-child", *_shell(setup), *run],
            stdout=self._logf,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self._pid: int | None = None

    @property
    def pid(self) -> int:
        """The agent's pid (in our namespace): the target of `nsenter -t`."""
        if self._pid is None:
            found: list[int] = []

            def child() -> bool:
                if self.proc.poll() is not None:
                    raise AssertionError(f"agent exited early:\n{self.log.read_text()}")
                kid = _child_of(self.proc.pid)
                if kid is not None:
                    found.append(kid)
                return kid is not None

            wait_for(child, what="unshare's child")
            self._pid = found[0]
        return self._pid

    def wait_converged(self, count: int = 1, timeout: float = 20) -> None:
        def ok() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited early:\n{self.log.read_text()}")
            lines = status_lines(self.status)
            return lines.count("true") >= count and lines[-1] == "true"

        wait_for(ok, timeout, f"converged #{count}")

    def ns(self, *cmd: str, check: bool = True) -> str:
        """Run `cmd` in the agent's mount, UTS and network namespaces; its stdout."""
        r = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-m", "-u", "-n", *cmd],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"{cmd} exited {r.returncode}: {r.stderr}")
        return r.stdout

    def ns_run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["nsenter", "-t", str(self.pid), "-m", "-u", "-n", *cmd],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def stop(self) -> int:
        if self.proc.poll() is None:
            kid = self._pid or _child_of(self.proc.pid)
            if kid is not None:
                os.kill(kid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # --kill-child: the agent dies with it
                self.proc.wait()
        self._logf.close()
        return self.proc.returncode


@pytest.fixture
def ns_agents() -> Iterator[Callable[..., NsAgent]]:
    """Start `NsAgent(...)`s; each is stopped when the test ends."""
    started: list[NsAgent] = []

    def start(*args: object, **kwargs: object) -> NsAgent:
        a = NsAgent(*args, **kwargs)  # type: ignore[arg-type]
        started.append(a)
        return a

    yield start
    for a in started:
        a.stop()


def ns_once(
    flags: Sequence[str], setup: str, *cmd: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`cmd` once in fresh namespaces after `setup`."""
    return subprocess.run(
        ["unshare", *flags, "--fork", "--kill-child", *_shell(setup), *cmd],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def overlay_etc(tmp_path: Path) -> tuple[str, Path]:
    """A shell line laying an overlay over /etc, its writes in `upper`."""
    upper, work = tmp_path / "upper", tmp_path / "work"
    upper.mkdir()
    work.mkdir()
    opts = f"lowerdir=/etc,upperdir={upper},workdir={work}"
    return f"mount -t overlay overlay -o {shlex.quote(opts)} /etc", upper
