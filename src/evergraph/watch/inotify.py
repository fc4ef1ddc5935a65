"""One inotify instance for the whole process, shared by every path watch.

Why one: the kernel allows 128 inotify instances per user here, and one
instance with a watch per *directory* scales to tens of thousands of managed
files (the limit is 192k watches). A path is watched through its parent
directory, so creation, deletion, replacement by rename, content and
attribute changes all arrive as events naming the entry. Until the parent
exists, the nearest existing ancestor is watched and the subscription moves
down as directories appear. On queue overflow every subscriber is told, so
each resource rescans its own state.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

from asyncinotify import Inotify, Mask, Watch

log = logging.getLogger("evergraph.watch")

_DIR_MASK = (
    Mask.CREATE
    | Mask.DELETE
    | Mask.MODIFY
    | Mask.ATTRIB
    | Mask.CLOSE_WRITE
    | Mask.MOVED_FROM
    | Mask.MOVED_TO
    | Mask.DELETE_SELF
    | Mask.MOVE_SELF
    | Mask.ONLYDIR
)


class _Sub:
    __slots__ = ("callback", "dir", "name", "path")

    def __init__(self, path: str, callback: Callable[[], None]) -> None:
        self.path = path
        self.callback = callback
        self.dir = ""  # directory currently watched for this subscription
        self.name = ""  # entry name within `dir` that leads to `path`


class _DirWatch:
    __slots__ = ("by_name", "watch")

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.by_name: dict[str, set[_Sub]] = {}


class InotifyHub:
    """Use as `async with InotifyHub() as hub:`; `hub.run()` must be running (a task)."""

    def __init__(self) -> None:
        self._ino: Inotify | None = None
        self._dirs: dict[str, _DirWatch] = {}
        self._by_watch: dict[Watch, str] = {}

    async def __aenter__(self) -> InotifyHub:
        self._ino = Inotify()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._ino is not None:
            self._ino.close()
            self._ino = None
        self._dirs.clear()
        self._by_watch.clear()

    # -- public ---------------------------------------------------------
    def subscribe(self, path: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` whenever `path` may have changed; returns an unsubscribe."""
        path = path.rstrip("/") or "/"
        if not path.startswith("/") or "/." in path or "//" in path:
            path = os.path.abspath(path)
        sub = _Sub(path, callback)
        self._arm(sub)

        def unsubscribe() -> None:
            self._disarm(sub)

        return unsubscribe

    async def run(self) -> None:
        """Read events until cancelled, dispatching them to subscribers."""
        assert self._ino is not None, "use `async with InotifyHub()` first"
        async for ev in self._ino:
            if ev.mask & Mask.Q_OVERFLOW:
                log.warning("inotify queue overflowed: rescanning every watched path")
                for dw in list(self._dirs.values()):
                    for subs in list(dw.by_name.values()):
                        for s in list(subs):
                            s.callback()
                continue
            d = self._by_watch.get(ev.watch) if ev.watch is not None else None
            if d is None:
                continue
            dwatch = self._dirs.get(d)
            if dwatch is None:
                continue
            if ev.mask & (Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.IGNORED):
                # The watched directory itself went away: everyone below it
                # changed, and must re-arm on an ancestor.
                self._drop_dir(d)
                continue
            name = str(ev.name) if ev.name is not None else ""
            targets = dwatch.by_name.get(name)
            if not targets:
                continue
            for s in list(targets):
                if s.dir != s.path.rpartition("/")[0] or s.dir == "":
                    # Pending subscription (waiting on an ancestor): try to move down.
                    self._disarm(s)
                    self._arm(s)
                s.callback()

    # -- internals ------------------------------------------------------
    def _arm(self, sub: _Sub) -> None:
        assert self._ino is not None
        target = sub.path
        d, _, name = target.rpartition("/")
        d = d or "/"
        while True:
            dw = self._dirs.get(d)
            if dw is None:
                try:
                    w = self._ino.add_watch(d, _DIR_MASK)
                except (FileNotFoundError, NotADirectoryError):
                    # Walk up: watch the nearest existing ancestor.
                    parent, _, pname = d.rpartition("/")
                    d, name = parent or "/", pname
                    continue
                except PermissionError:
                    log.warning("cannot watch %s: permission denied", d)
                    return
                dw = _DirWatch(w)
                self._dirs[d] = dw
                self._by_watch[w] = d
            dw.by_name.setdefault(name, set()).add(sub)
            sub.dir, sub.name = d, name
            return

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
        self._by_watch.pop(dw.watch, None)
        if self._ino is not None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                self._ino.rm_watch(dw.watch)

    def _drop_dir(self, d: str) -> None:
        dw = self._dirs.pop(d, None)
        if dw is None:
            return
        self._by_watch.pop(dw.watch, None)
        subs = [s for group in dw.by_name.values() for s in group]
        for s in subs:
            s.dir = s.name = ""
            self._arm(s)
            s.callback()
