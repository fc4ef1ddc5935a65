"""inotify(7) itself: an instance's descriptor, adding and removing watches.

Three libc calls through ctypes, for the two readers of inotify events (the
watch hub, the sqlite World's notifier), which parse the descriptor's bytes
themselves. A library for this cost a start-up ~10 ms: its import (enums,
`pathlib`) and `ctypes.util.find_library("c")`, which runs `ldconfig -p` in a
child process. The symbols are looked up in the running process (libc is
loaded already), so nothing is searched for.
"""

from __future__ import annotations

import ctypes
import os

_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.inotify_init1.argtypes = (ctypes.c_int,)
        lib.inotify_init1.restype = ctypes.c_int
        lib.inotify_add_watch.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        lib.inotify_add_watch.restype = ctypes.c_int
        lib.inotify_rm_watch.argtypes = (ctypes.c_int, ctypes.c_int)
        lib.inotify_rm_watch.restype = ctypes.c_int
        _libc = lib
    return _libc


def _checked(value: int, path: str | None = None) -> int:
    if value < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)  # errno picks the subclass
    return value


class Inotify:
    """One inotify instance (non-blocking, close-on-exec); `close()` when done."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = _checked(_lib().inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))

    def add_watch(self, path: str, mask: int) -> int:
        """The watch descriptor of `path` (the same one again for a path already
        watched: its mask is replaced). OSError (FileNotFoundError...) if it cannot."""
        return _checked(_lib().inotify_add_watch(self.fd, os.fsencode(path), mask), path)

    def rm_watch(self, wd: int) -> None:
        _checked(_lib().inotify_rm_watch(self.fd, wd))

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> Inotify:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
