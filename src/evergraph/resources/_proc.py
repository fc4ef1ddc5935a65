"""Subprocesses for resources: asyncio, own process group, terminate -> grace -> kill."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import pwd
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

#: seconds between SIGTERM and SIGKILL when a running command is cancelled
KILL_GRACE = 3.0


@dataclass(frozen=True, slots=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True, slots=True)
class RunAs:
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


async def run(argv: Sequence[str], how: RunAs = RunAs()) -> Completed:
    """Run to completion, capturing output; cancellation stops the process group."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=how.cwd,
        env=how.env,
        user=how.user,
        group=how.group,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await proc.communicate()
    except BaseException:
        await asyncio.shield(_stop_group(proc))
        raise
    assert proc.returncode is not None
    return Completed(
        proc.returncode,
        out.decode("utf-8", "replace"),
        err.decode("utf-8", "replace"),
    )


async def lines(argv: Sequence[str], how: RunAs = RunAs()) -> AsyncIterator[str]:
    """Yield stdout lines of a long-running command; raises when it exits."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=how.cwd,
        env=how.env,
        user=how.user,
        group=how.group,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    assert proc.stdout is not None
    try:
        async for raw in proc.stdout:
            yield raw.decode("utf-8", "replace").rstrip("\n")
        await proc.wait()
    finally:
        await asyncio.shield(_stop_group(proc))
    raise RuntimeError(f"exited with status {proc.returncode}")
