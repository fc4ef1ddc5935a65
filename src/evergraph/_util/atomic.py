"""The one atomic file write: a reader (or a restart after kill -9) sees the old
file or the new one, never a mix or a half.

A temporary sibling is written, fsynced, renamed over the target, and the
directory fsynced so the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write(
    path: Path,
    data: bytes,
    *,
    mode: int = 0o600,
    exclusive: bool = False,
    dir_mode: int = 0o700,
) -> bool:
    """Write `data` to `path` atomically with `mode`; parents are created (`dir_mode`).

    `exclusive`: never replace an existing file (the first writer wins, e.g. two
    processes creating the same key at once); returns False if one was there.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=dir_mode)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            os.fchmod(fd, mode)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        else:
            os.rename(tmp, path)
        _fsync_dir(path.parent)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
