"""Floor for W1: the least a plain-Python program does to converge the same files.

Run as a whole process: `python bench/floor_files.py SPEC.json`, where SPEC is
a JSON list of [path, content, mode]. Per file: lstat; if it exists, read and
compare content and mode (and stop there when both match); otherwise make the
parent directory if missing; then write atomically (temp file, write, fchmod,
close, rename over) — or chmod when only the mode is wrong. Imports only the
standard library, no asyncio, no logging.
"""

import json
import os
import stat
import sys


def converge(path: str, data: bytes, mode: int) -> bool:
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
    tmp = f"{parent}/.{base}.floor"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    return False


def main() -> int:
    with open(sys.argv[1], "rb") as f:
        spec = json.load(f)
    changed = 0
    for path, content, mode in spec:
        if not converge(path, content.encode(), int(mode, 8)):
            changed += 1
    print(f"{changed} changed of {len(spec)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
