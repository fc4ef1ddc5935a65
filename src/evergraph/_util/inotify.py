"""inotify(7) itself: an instance's descriptor, adding and removing watches.

Three libc calls through ctypes, for the two readers of inotify events (the
watch hub, the sqlite World's notifier), which parse the descriptor's bytes
themselves. A library for this cost a start-up ~10 ms: its import (enums,
`pathlib`) and `ctypes.util.find_library("c")`, which runs `ldconfig -p` in a
child process. The symbols are looked up in the running process (libc is
loaded already), so nothing is searched for.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported with the first instance: `check` imports the bits only
    import ctypes

# the kernel's event bits (linux/inotify.h)
IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000

#: struct inotify_event: wd, mask, cookie, len (then `len` bytes of name, NUL-padded)
_EVENT = struct.Struct("iIII")


def events(buf: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(watch descriptor, mask, name) of each event read from an instance; the name
    is b"" for an event of the watched path itself."""
    off, end = 0, len(buf)
    unpack = _EVENT.unpack_from
    while off + 16 <= end:
        wd, mask, _cookie, size = unpack(buf, off)
        off += 16
        yield wd, mask, buf[off : off + size].rstrip(b"\0") if size else b""
        off += size


_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        import ctypes

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
        import ctypes

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
