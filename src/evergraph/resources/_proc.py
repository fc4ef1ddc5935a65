"""Subprocesses for resources: asyncio, own process group, terminate -> grace -> kill.

Every child dies with the agent: it asks the kernel for SIGKILL when its parent
dies (`PR_SET_PDEATHSIG`, set in the child after its user and group are, since
a change of credentials clears it). The parent is the thread that forked: asyncio
forks in the event loop's thread, which lives as long as the agent. A child
whose agent died before the request kills itself.

The signal reaches the child only, not what it started in its process group
(`sh -c 'a; b'` runs `b` as a grandchild). So a child started with `record`
(a vertex's state dir) is recorded there as `proc.<pid>` (pid, start time,
boot id) while it runs, and `sweep_survivors`, called by the agent at start
(holding the state dir's lock), kills the process group of every recorded child
that is still there: a restarted agent never runs a command beside a survivor
of its previous run.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import grp
import logging
import os
import pwd
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

import msgspec

from evergraph._util.atomic import atomic_write

log = logging.getLogger("evergraph.resource")

#: seconds between SIGTERM and SIGKILL when a running command is cancelled (under 2 s:
#: --max-runtime promises an exit within 2 s of its bound)
KILL_GRACE = 1.5
#: seconds the start-up sweep waits for killed survivors to be gone
SWEEP_WAIT = 2.0
#: a running child's record in its vertex's state dir: `proc.<pid>`
RECORD_PREFIX = "proc."
#: the log level of commands' output lines (below DEBUG: shown with `run -vv`)
OUTPUT = 5
logging.addLevelName(OUTPUT, "OUTPUT")
#: a line longer than this is handed to `on_line` in parts
_LINE_MAX = 1 << 16

#: called with ("stdout" or "stderr", line) for each line a command writes
OnLine = Callable[[str, str], None]


#: util-linux's setpriv sets the parent-death signal and execs the command. Done
#: by exec, not by a `preexec_fn`: Python code in a child forked from a process
#: with other threads (gRPC's, with an etcd World) can deadlock or crash there.
@functools.cache
def _setpriv() -> str | None:
    import shutil  # (a run with no command loads neither it nor bz2/lzma)

    return shutil.which("setpriv")


def _tied(argv: Sequence[str], env: Mapping[str, str] | None) -> list[str]:
    """`argv` wrapped so the command dies (SIGKILL) when the agent's thread that
    started it dies. A command that does not exist is FileNotFoundError here, as
    without the wrapper. (Should the agent die between the fork and setpriv's
    call, the start-up sweep of the next run kills the survivor.)"""
    cmd = argv[0]
    path = (env if env is not None else os.environ).get("PATH", os.defpath)
    import shutil

    found = cmd if "/" in cmd else shutil.which(cmd, path=path)
    if found is None or not os.path.exists(found):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cmd)
    setpriv = _setpriv()
    if setpriv is None:
        return list(argv)
    return [setpriv, "--pdeathsig", "KILL", "--", *argv]  # setpriv finds it the same way


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22, starttime
    except (IndexError, ValueError):
        return None


def _record(where: Path | None, pid: int) -> Path | None:
    """Note a running child in `where` (its vertex's state dir); None if not noted."""
    if where is None:
        return None
    started = start_time(pid)
    if started is None:
        return None  # already gone (and reaped)
    path = where / f"{RECORD_PREFIX}{pid}"
    try:
        atomic_write(path, f"{pid} {started} {_boot_id()}\n".encode(), durable=False)
    except OSError as e:
        log.warning("cannot record child %d in %s: %s", pid, where, e)
        return None
    return path


def _unrecord(path: Path | None, proc: asyncio.subprocess.Process) -> None:
    if path is not None and proc.returncode is not None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def sweep_survivors(state_dir: Path) -> list[int]:
    """Kill (SIGKILL, by process group) every child recorded by an earlier run
    with this state dir that is still running, remove the records, and wait up
    to SWEEP_WAIT for those killed to be gone; the pids killed. Call it only
    holding the state dir's lock (no live agent's children are recorded there)."""
    boot = _boot_id()
    killed: list[int] = []
    for path in state_dir.glob(f"vertices/*/*/{RECORD_PREFIX}*"):
        try:
            pid_s, started_s, rec_boot = [*path.read_text().split(), "", "", ""][:3]
            pid, started = int(pid_s), int(started_s)
        except (OSError, ValueError):
            pid = 0
        if pid > 1 and rec_boot == boot and _kill_survivor(pid, started):
            log.warning(
                "killed process group %d, left running by the last run (%s)", pid, path.parent
            )
            killed.append(pid)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    deadline = time.monotonic() + SWEEP_WAIT
    for pid in killed:
        while _group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
    return killed


def _kill_survivor(pid: int, started: int) -> bool:
    """Kill the group of the recorded child `pid` if it is ours. The child led its
    own process group (its pid is the group's id), and the kernel never reuses a
    pid while a group of that id has members: so if `pid` runs with the recorded
    start time, the group is ours; if nothing runs as `pid`, any group `pid` is the
    rest of ours (the child died, what it started lives on); if another process
    runs as `pid`, ours is entirely gone."""
    now = start_time(pid)
    if now is not None and now != started:
        return False  # the pid was reused: not ours
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    except PermissionError:
        if now is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return True


def _group_alive(pgid: int) -> bool:
    """A process of the group `pgid` is still there (a zombie does not count)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return False
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # after "(comm) ": state, ppid, pgrp
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and fields[2] == b"%d" % pgid and fields[0] != b"Z":
            return True
    return False


class Completed(msgspec.Struct, frozen=True, gc=False):
    returncode: int
    stdout: str
    stderr: str


class RunAs(msgspec.Struct, frozen=True):
    """Where and as whom a command runs."""

    cwd: str | None = None
    env: dict[str, str] | None = None  # None: inherit the agent's unchanged
    user: int | None = None
    group: int | None = None

    @classmethod
    def resolve(cls, cwd: str, extra: Mapping[str, str], user: str = "", group: str = "") -> RunAs:
        """Look up user and group (LookupError naming them if unknown)."""
        uid = gid = None
        env: dict[str, str] | None = None
        if user:
            try:
                pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
            except KeyError:
                raise LookupError(f"no such user {user!r}") from None
            uid, gid = pw.pw_uid, pw.pw_gid
            env = dict(os.environ)
            env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
        if group:
            try:
                gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
            except KeyError:
                raise LookupError(f"no such group {group!r}") from None
        if extra:
            env = dict(os.environ) if env is None else env
            env.update(extra)
        return cls(cwd or None, env, uid, gid)


async def _stop_group(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the whole process group, wait KILL_GRACE, then SIGKILL."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), KILL_GRACE)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


#: a command run where and as the agent runs, with its environment
AS_AGENT = RunAs()


async def run(
    argv: Sequence[str],
    how: RunAs = AS_AGENT,
    record: Path | None = None,
    on_line: OnLine | None = None,
) -> Completed:
    """Run to completion, capturing output; cancellation stops the process group.
    `record`: a vertex's state dir, where the child is recorded while it runs (for
    `sweep_survivors`). `on_line`: also called with each output line as it comes."""
    proc = await asyncio.create_subprocess_exec(
        *_tied(argv, how.env),
        cwd=how.cwd,
        env=how.env,
        user=how.user,
        group=how.group,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    noted = _record(record, proc.pid)
    try:
        if on_line is None:
            out, err = await proc.communicate()
        else:
            assert proc.stdout is not None
            assert proc.stderr is not None
            outs: list[bytes] = []
            errs: list[bytes] = []
            async with asyncio.TaskGroup() as tg:
                tg.create_task(_pump(proc.stdout, "stdout", outs, on_line))
                tg.create_task(_pump(proc.stderr, "stderr", errs, on_line))
            await proc.wait()
            out, err = b"".join(outs), b"".join(errs)
    except BaseException:
        await asyncio.shield(_stop_group(proc))
        raise
    finally:
        _unrecord(noted, proc)
    assert proc.returncode is not None
    return Completed(
        proc.returncode,
        out.decode("utf-8", "replace"),
        err.decode("utf-8", "replace"),
    )


async def _pump(
    stream: asyncio.StreamReader, name: str, chunks: list[bytes], on_line: OnLine
) -> None:
    """Read `stream` to its end into `chunks`, handing each line to `on_line`."""
    partial = b""
    while chunk := await stream.read(_LINE_MAX):
        chunks.append(chunk)
        *done, partial = (partial + chunk).split(b"\n")
        for line in done:
            on_line(name, line.decode("utf-8", "replace"))
        if len(partial) >= _LINE_MAX:
            on_line(name, partial.decode("utf-8", "replace"))
            partial = b""
    if partial:
        on_line(name, partial.decode("utf-8", "replace"))


async def lines(
    argv: Sequence[str], how: RunAs = AS_AGENT, record: Path | None = None
) -> AsyncIterator[str]:
    """Yield stdout lines of a long-running command; raises when it exits.
    `record`: as for `run`."""
    proc = await asyncio.create_subprocess_exec(
        *_tied(argv, how.env),
        cwd=how.cwd,
        env=how.env,
        user=how.user,
        group=how.group,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    noted = _record(record, proc.pid)
    assert proc.stdout is not None
    try:
        async for raw in proc.stdout:
            yield raw.decode("utf-8", "replace").rstrip("\n")
        await proc.wait()
    finally:
        await asyncio.shield(_stop_group(proc))
        _unrecord(noted, proc)
    raise RuntimeError(f"exited with status {proc.returncode}")
