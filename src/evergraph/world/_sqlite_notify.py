"""How the sqlite World hears of other processes' commits and of leases due: one
task per client with a watch (started by `SQLiteKV.watch`, ended by its close),
that wakes the client's watchers on inotify events of the World's `-wal` file
and directory, and sweeps expired leases at the earliest expiry, so deletions
by expiry reach watchers without any write. Why inotify, when it is armed and
what an idle client wakes for: the docstring of world/sqlite.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from evergraph._util.inotify import (  # the event bits and parser; ctypes once armed
    IN_ATTRIB,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_MODIFY,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    events,
)

#: the notifier arms its inotify instance this long after the first watch starts:
#: a client done by then (a run that exits the moment it converges) never pays the
#: instance's teardown, ~15 ms of wall time in the kernel at close or exit (the
#: marks' RCU grace period). Another process's commit (or a lease's expiry) in that
#: moment reaches the watchers when it is armed: at most this late.
ARM_AFTER = 0.1
#: the same for a client that says it ends soon (`SQLiteKV(short_lived=True)`: a
#: run that exits once converged): a first apply of 10k files takes under a
#: second, and what another process commits meanwhile only needs to reach it
#: before it is done, if at all
SHORT_LIVED_ARM_AFTER = 2.0
_IN_MODIFY_CLOSE_WRITE_ATTRIB = IN_MODIFY | IN_CLOSE_WRITE | IN_ATTRIB
_IN_CREATE_DELETE_MOVED = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO


class Notified(msgspec.Struct, frozen=True):
    """What the notifier needs of its client. (A Struct: a dataclass's generated
    methods are compiled at import, ~0.7 ms of every run with a World.)"""

    #: set when the client is closed: the notifier ends
    closed: asyncio.Event
    #: the client's epoch: a new one means a new World, with a new -wal file
    epoch: Callable[[], int]
    #: seconds until the earliest lease expires (a little after)
    until_expiry: Callable[[], float]
    #: delete what expired leases held; True if anything was
    sweep_now: Callable[[], Awaitable[bool]]
    #: wake the client's watchers: look again
    notify: Callable[[], None]
    #: seconds after its first watch the notifier arms (`ARM_AFTER`)
    arm_after: float = ARM_AFTER


async def notify_loop(kv: Notified, path: Path) -> None:
    """Wake watchers on other processes' commits (inotify on the WAL) and sweep
    expired leases, so deletions by expiry reach watchers without any write."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(kv.arm_after):
            await kv.closed.wait()
    if kv.closed.is_set():
        return
    from evergraph._util.inotify import Inotify  # (ctypes) once armed

    loop = asyncio.get_running_loop()
    woke = asyncio.Event()
    woke.set()  # look again once armed: what was committed before

    def drain(fd: int) -> None:
        # A write to the -wal, or the World's files deleted, created or renamed in
        # its directory (a replacement), means "look again"; other files of the
        # directory (the state dir's own writes) do not.
        hit = False
        with contextlib.suppress(BlockingIOError, OSError):
            while buf := os.read(fd, 65536):
                for wd, _mask, name in events(buf):
                    if wd != dir_wd or name.startswith(base):
                        hit = True
        if hit:
            woke.set()

    with Inotify() as ino:
        watch = -1  # the -wal file's watch descriptor
        watched = -1  # the epoch (World) whose -wal file is watched

        def add_watch() -> None:
            # again after a replacement: the new World has a new -wal file;
            # ATTRIB: its deletion (a link count change) wakes us too
            nonlocal watch, watched
            with contextlib.suppress(OSError):
                new = ino.add_watch(str(path) + "-wal", _IN_MODIFY_CLOSE_WRITE_ATTRIB)
                if watch != -1 and watch != new:
                    with contextlib.suppress(OSError):
                        ino.rm_watch(watch)
                watch, watched = new, kv.epoch()

        add_watch()
        base = os.fsencode(path.name)
        dir_wd = -1
        with contextlib.suppress(OSError):
            dir_wd = ino.add_watch(str(path.parent), _IN_CREATE_DELETE_MOVED)
        loop.add_reader(ino.fd, drain, ino.fd)
        try:
            # Sweep on a deadline — the earliest lease expiry — not on quiet ticks
            # (another process touching the -wal would postpone it for ever) and
            # not on a fixed tick (an idle agent would wake for nothing). A write
            # by anyone wakes us: a new lease may expire sooner.
            next_sweep = loop.time() + kv.until_expiry()
            while not kv.closed.is_set():
                if watched != kv.epoch() or watch == -1:
                    add_watch()  # a new World, or a -wal that did not exist yet
                written = False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(next_sweep):
                        await woke.wait()
                        written = True
                woke.clear()
                swept = False
                if loop.time() >= next_sweep:
                    swept = await kv.sweep_now()
                    next_sweep = loop.time() + kv.until_expiry()
                elif written:
                    next_sweep = min(next_sweep, loop.time() + kv.until_expiry())
                if written or swept:
                    kv.notify()
        finally:
            loop.remove_reader(ino.fd)
