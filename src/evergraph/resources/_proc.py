"""Subprocesses for resources: asyncio, own process group, terminate -> grace -> kill."""

from __future__ import annotations

import asyncio
import contextlib
import os
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


def build_env(extra: Mapping[str, str] | None) -> dict[str, str] | None:
    """The agent's environment with `extra` laid over it (None: inherit unchanged)."""
    if not extra:
        return None
    env = dict(os.environ)
    env.update(extra)
    return env


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


async def run(
    argv: Sequence[str], cwd: str | None = None, env: Mapping[str, str] | None = None
) -> Completed:
    """Run to completion, capturing output; cancellation stops the process group."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd or None,
        env=build_env(env),
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


async def lines(
    argv: Sequence[str], cwd: str | None = None, env: Mapping[str, str] | None = None
) -> AsyncIterator[str]:
    """Yield stdout lines of a long-running command; raises when it exits."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd or None,
        env=build_env(env),
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
