"""Floor for W1: the least a plain-Python program does to converge the same files.

Run as a whole process: `python bench/floor_files.py SPEC.json [--durable]`,
where SPEC is a JSON list of [path, content, mode]. Per file: lstat; if it
exists, read and compare content and mode (and stop there when both match);
otherwise make the parent directory if missing; then write atomically (temp
file, write, fchmod, close, rename over) — or chmod when only the mode is
wrong. Imports only the standard library, no asyncio, no logging.

`--durable` does the same job as evergraph's writes (_util/atomic.py): the temp
file is fsynced before the rename and the directory after it (and a directory
made on the way is fsynced into its parent), one write after another.
"""

import json
import os
import stat
import sys


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def converge(path: str, data: bytes, mode: int, durable: bool = False) -> bool:
    """True if already correct."""
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
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    if durable:
        _fsync_dir(parent)
    return False


def main() -> int:
    durable = "--durable" in sys.argv[2:]
    with open(sys.argv[1], "rb") as f:
        spec = json.load(f)
    changed = 0
    for path, content, mode in spec:
        if not converge(path, content.encode(), int(mode, 8), durable):
            changed += 1
    print(f"{changed} changed of {len(spec)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
