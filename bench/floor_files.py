"""Floor for W1: the least a plain-Python program does to converge the same files.

Run as a whole process: `python bench/floor_files.py SPEC.json [--durable]`,
where SPEC is a JSON list of [path, content, mode]. Per file: lstat; if it
exists, read and compare content and mode (and stop there when both match);
otherwise make the parent directory if missing; then write atomically (temp
file, write, fchmod, close, rename over) — or chmod when only the mode is
wrong. Imports only the standard library, no asyncio, no logging.

`--durable` syncs every write as evergraph syncs one that replaces a file
(_util/atomic.py; one that makes a file where none was is not synced), the
cheapest plain way: each file's data is on disk before its rename and the rename
on disk before the end (a directory made on the way is fsynced into its parent).
With 8 or more files to write (atomic.SYNCFS_MIN), every temp file is written
first, then one syncfs(2), the renames, and one more syncfs; with fewer, an
fsync of each temp file before its rename and of its directory after.
"""

import ctypes
import json
import os
import stat
import sys

#: as atomic.SYNCFS_MIN
SYNCFS_MIN = 8


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs")
    finally:
        os.close(fd)


def converge(
    path: str, data: bytes, mode: int, durable: bool = False, later: list | None = None
) -> bool:
    """True if already correct. With `later`, a durable write's temp file is only
    written: (temp, path) is appended for `finish` to sync and rename."""
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    content_ok = False
    if st is not None:
        with open(path, "rb") as f:
            content_ok = f.read() == data
        if content_ok and stat.S_IMODE(st.st_mode) == mode:
            return True
        if content_ok:
            os.chmod(path, mode)
            return False
    parent, _, base = path.rpartition("/")
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o755, exist_ok=True)
        if durable:
            _fsync_dir(os.path.dirname(parent))
    tmp = f"{parent}/.{base}.floor"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
        if durable and later is None:
            os.fsync(fd)
    finally:
        os.close(fd)
    if later is not None:
        later.append((tmp, path))
        return False
    os.rename(tmp, path)
    if durable:
        _fsync_dir(parent)
    return False


def finish(later: list, root: str) -> None:
    """The data of every temp file to disk, the renames, the renames to disk."""
    _syncfs(root)
    for tmp, path in later:
        os.rename(tmp, path)
    _syncfs(root)


def main() -> int:
    durable = "--durable" in sys.argv[2:]
    with open(sys.argv[1], "rb") as f:
        spec = json.load(f)
    changed = 0
    # durable writes are synced and renamed at the end, all at once (the docstring)
    later: list | None = [] if durable else None
    for path, content, mode in spec:
        if not converge(path, content.encode(), int(mode, 8), durable, later):
            changed += 1
    if later and len(later) < SYNCFS_MIN:
        for tmp, path in later:
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            os.fsync(fd)
            os.close(fd)
            os.rename(tmp, path)
            _fsync_dir(os.path.dirname(path))
    elif later:
        finish(later, os.path.dirname(later[0][1]))
    print(f"{changed} changed of {len(spec)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
