"""One inotify instance for the whole process, shared by every path watch.

Why one: the kernel allows 128 inotify instances per user here, and one
instance with a watch per *directory* scales to tens of thousands of managed
files (the limit is 192k watches). A path is watched through its parent
directory, so creation, deletion, replacement by rename, content and
attribute changes all arrive as events naming the entry. Until the parent
exists, the nearest existing ancestor is watched and the subscription moves
down as directories appear. On queue overflow every subscriber is told, so
each resource rescans its own state.

Callbacks receive the event mask (`Mask` bits), so a subscriber can tell, for
example, the rename of its own new file into place (MOVED_TO) from a change
by someone else.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from evergraph._util.inotify import (  # the kernel's event bits (no ctypes), re-exported
    IN_ATTRIB,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_MODIFY,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_ONLYDIR,
    IN_Q_OVERFLOW,
    events,
)

if TYPE_CHECKING:  # imported when a hub starts (ctypes, asyncio): `check` needs neither
    import asyncio

    from evergraph._util.inotify import Inotify

log = logging.getLogger("evergraph.watch")


#: what a callback receives when a directory on its path appeared or vanished,
#: or the queue overflowed: "anything may have changed"
RESCAN = IN_Q_OVERFLOW
MOVED_TO = IN_MOVED_TO

_DIR_MASK = (
    IN_CREATE
    | IN_DELETE
    | IN_MODIFY
    | IN_ATTRIB
    | IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
)
_APPEARS = IN_CREATE | IN_MOVED_TO
_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED


Callback = Callable[[int], None]
#: the entry name of a directory-listing subscription: no real entry has a NUL
_ANY = "\0"


class _Sub:
    __slots__ = ("callback", "dir", "name", "parent", "path")

    def __init__(self, path: str, callback: Callback) -> None:
        self.path = path
        self.parent = path.rpartition("/")[0] or "/"
        self.callback = callback
        self.dir = ""  # directory currently watched for this subscription
        self.name = ""  # entry name within `dir` that leads to `path`


class _DirWatch:
    __slots__ = ("by_name", "wd")

    def __init__(self, wd: int) -> None:
        self.wd = wd
        self.by_name: dict[str, set[_Sub]] = {}


def _join(d: str, name: str) -> str:
    return f"{d}/{name}" if d != "/" else f"/{name}"


class InotifyHub:
    """Use as `async with InotifyHub() as hub:`; `hub.run()` must be running (a task).

    `lazy`: the inotify instance is made on the first subscription, not on entry.
    For a run that may never watch anything (one that exits the moment it
    converges): an instance that had watches costs its process up to ~15 ms of
    wall time in the kernel when it is closed (or at exit), waiting for the
    marks' RCU grace period. An eager hub reports "no inotify instance left"
    on entry; a lazy one to whatever subscribes first."""

    def __init__(self, lazy: bool = False) -> None:
        self._lazy = lazy
        self._ino: Inotify | None = None
        self._opened: asyncio.Event | None = None
        self._dirs: dict[str, _DirWatch] = {}
        #: watch descriptor -> the directory it watches
        self._by_watch: dict[int, str] = {}
        #: directories known not to exist (saves a failing inotify_add_watch per
        #: subscription below them); an entry leaves when its creation is seen
        self._missing: set[str] = set()

    async def __aenter__(self) -> InotifyHub:
        import asyncio

        self._opened = asyncio.Event()
        if not self._lazy:
            self._open()
        return self

    def _open(self) -> None:
        from evergraph._util.inotify import Inotify

        assert self._opened is not None, "use `async with InotifyHub()` first"
        self._ino = Inotify()
        self._opened.set()

    async def __aexit__(self, *exc: object) -> None:
        if self._ino is not None:
            self._ino.close()
            self._ino = None
        self._dirs.clear()
        self._by_watch.clear()
        self._missing.clear()

    # -- public ---------------------------------------------------------
    def subscribe(self, path: str, callback: Callback) -> Subscription:
        """Call `callback(mask)` whenever `path` may have changed.

        Returns the subscription: call it to unsubscribe; `settle()` it right
        after creating the path's parent directories yourself, so that the
        watch sits on the parent before you put the path in place.
        """
        path = path.rstrip("/") or "/"
        if not path.startswith("/") or "/." in path or "//" in path:
            path = os.path.abspath(path)
        sub = _Sub(path, callback)
        if self._ino is None and self._lazy:
            self._open()
        self._arm(sub)
        return Subscription(self, sub)

    def subscribe_dir(self, directory: str, callback: Callback) -> Subscription:
        """Call `callback(mask)` on any change of an entry directly in `directory`
        (not below it): for resources that own a directory's listing (file.purge)."""
        return self.subscribe(f"{directory.rstrip('/')}/{_ANY}", callback)

    async def run(self) -> None:
        """Read events until cancelled, dispatching them to subscribers.

        The descriptor is read directly (one `os.read` of up to 64 KiB, some
        2,000 events, per wake-up), not through asyncinotify's iterator, which
        builds a `Path` and an enum per event and re-registers the reader per
        batch of ~60: under 1,000 changes/s that cost more than the repairs.
        A lazy hub waits for its first subscription."""
        assert self._opened is not None, "use `async with InotifyHub()` first"
        import asyncio

        await self._opened.wait()
        assert self._ino is not None
        loop = asyncio.get_running_loop()
        fd = self._ino.fd
        failed: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            try:
                self._read(fd)
            except Exception as e:  # a subscriber's bug ends run(), as it always did
                loop.remove_reader(fd)
                if not failed.done():
                    failed.set_exception(e)

        loop.add_reader(fd, readable)
        try:
            await failed
        finally:
            with contextlib.suppress(Exception):
                loop.remove_reader(fd)

    def _read(self, fd: int) -> None:
        try:
            buf = os.read(fd, 65536)
        except BlockingIOError:
            return
        dispatch, decode = self._dispatch, os.fsdecode
        for wd, mask, name in events(buf):
            dispatch(wd, mask, decode(name) if name else "")

    def _dispatch(self, wd: int, mask: int, name: str) -> None:
        if mask & RESCAN:
            log.warning("inotify queue overflowed: rescanning every watched path")
            self._missing.clear()
            for dw in list(self._dirs.values()):
                for subs in list(dw.by_name.values()):
                    for s in list(subs):
                        s.callback(RESCAN)
            return
        d = self._by_watch.get(wd)
        if d is None:
            return
        dwatch = self._dirs.get(d)
        if dwatch is None:
            return
        if mask & _GONE:
            # The watched directory itself went away: everyone below it
            # changed, and must re-arm on an ancestor.
            self._drop_dir(d)
            return
        if mask & _APPEARS:
            self._missing.discard(_join(d, name))
        anyone = dwatch.by_name.get(_ANY)
        if anyone:
            for s in list(anyone):
                if s.dir == s.parent:
                    s.callback(mask)
        targets = dwatch.by_name.get(name)
        if not targets:
            return
        for s in list(targets):
            if s.dir != s.parent:
                # Pending subscription (waiting on an ancestor): move down.
                self._disarm(s)
                self._arm(s)
                s.callback(RESCAN)
            else:
                s.callback(mask)

    # -- internals ------------------------------------------------------
    def _settle(self, sub: _Sub) -> None:
        if sub.dir != sub.parent:
            self._missing.discard(sub.parent)
            self._disarm(sub)
            self._arm(sub)

    def _arm(self, sub: _Sub) -> None:
        assert self._ino is not None
        d, name = sub.parent, sub.path.rpartition("/")[2]
        for _ in range(8):  # bounded: directories may come and go while we look
            d, name, new = self._watch_nearest(d, name)
            if not d:
                return
            self._dirs[d].by_name.setdefault(name, set()).add(sub)
            sub.dir, sub.name = d, name
            if d == sub.parent or not new:
                # On an ancestor watched before: if the next directory appears,
                # its event is queued (or was seen) and moves us down.
                return
            # On an ancestor watched just now: what appeared before the watch
            # existed raised no event. Look once, and go down if it is there.
            nxt = _join(d, name)
            if not os.path.isdir(nxt):
                return
            self._missing.discard(nxt)
            self._disarm(sub)
            d, name = sub.parent, sub.path.rpartition("/")[2]

    def _watch_nearest(self, d: str, name: str) -> tuple[str, str, bool]:
        """Watch `d` or its nearest existing ancestor: (dir watched, entry name, new watch)."""
        assert self._ino is not None
        while True:
            if d in self._dirs:
                return d, name, False
            if d not in self._missing:
                try:
                    w = self._ino.add_watch(d, _DIR_MASK)
                except (FileNotFoundError, NotADirectoryError):
                    self._missing.add(d)
                except PermissionError:
                    log.warning("cannot watch %s: permission denied", d)
                    return "", "", False
                else:
                    self._dirs[d] = _DirWatch(w)
                    self._by_watch[w] = d
                    return d, name, True
            if d == "/":
                return "", "", False
            parent, _, pname = d.rpartition("/")
            d, name = parent or "/", pname

    def _disarm(self, sub: _Sub) -> None:
        dw = self._dirs.get(sub.dir)
        if dw is None:
            return
        subs = dw.by_name.get(sub.name)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del dw.by_name[sub.name]
        if not dw.by_name:
            self._forget_dir(sub.dir)
        sub.dir = sub.name = ""

    def _forget_dir(self, d: str) -> None:
        dw = self._dirs.pop(d, None)
        if dw is None:
            return
        self._by_watch.pop(dw.wd, None)
        if self._ino is not None:
            with contextlib.suppress(OSError):
                self._ino.rm_watch(dw.wd)

    def _drop_dir(self, d: str) -> None:
        dw = self._dirs.pop(d, None)
        if dw is None:
            return
        self._by_watch.pop(dw.wd, None)
        subs = [s for group in dw.by_name.values() for s in group]
        for s in subs:
            s.dir = s.name = ""
            self._arm(s)
            s.callback(RESCAN)


class Subscription:
    """A path watch: call it to unsubscribe."""

    __slots__ = ("_hub", "_sub")

    def __init__(self, hub: InotifyHub, sub: _Sub) -> None:
        self._hub = hub
        self._sub = sub

    def __call__(self) -> None:
        self._hub._disarm(self._sub)

    def settle(self) -> None:
        """Move the watch onto the path's parent now that it exists (no-op if already)."""
        if self._hub._ino is not None:
            self._hub._settle(self._sub)
