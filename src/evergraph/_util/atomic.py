"""The one atomic file write: a reader (or a restart after kill -9) sees the old
file or the new one, never a mix or a half.

A temporary sibling is written (mode and owner set before it is visible),
fsynced, renamed over the target, and the directory fsynced so the rename
itself survives a power cut. With `dir_fd` the file is named relative to an
open directory, so no path component (a symlink planted by a user in their own
home, say) is followed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def atomic_write(
    path: Path | str,
    data: bytes,
    *,
    mode: int = 0o600,
    owner: tuple[int, int] | None = None,
    exclusive: bool = False,
    dir_mode: int = 0o700,
    dir_fd: int | None = None,
) -> bool:
    """Write `data` to `path` atomically with `mode` (and `owner`: uid, gid).

    Without `dir_fd`, missing parents are created (`dir_mode`); with it, `path` is a
    plain name inside that open directory. `exclusive`: never replace an existing
    file (the first writer wins, e.g. two processes creating one key at once);
    returns False if one was there.
    """
    if dir_fd is None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True, mode=dir_mode)
        dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        name = target.name
    else:
        dfd, name = dir_fd, str(path)
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(tmp, _CREATE, 0o600, dir_fd=dfd)
        try:
            try:
                if owner is not None and owner != (os.geteuid(), os.getegid()):
                    os.fchown(fd, *owner)
                os.fchmod(fd, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                try:
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    return False
            else:
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            with contextlib.suppress(OSError):
                os.fsync(dfd)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
    finally:
        if dir_fd is None:
            os.close(dfd)
