"""File modes and owners, shared by the kinds that set them (file, http:client):
parsing a mode (`0644`, `u=rw,g=r,o=`), looking up an owner, comparing a stat's
attributes with the wanted ones, and setting them through a descriptor, never a
path looked up again (see `set_attrs`)."""

from __future__ import annotations

import errno
import functools
import grp
import os
import pwd
import stat
from collections.abc import Callable

from evergraph._util.atomic import current_umask
from evergraph.errors import ResourceError

#: read once: asking the kernel means setting it, which is racy with threads
UMASK = current_umask()
_SYMBOLIC_WHO = {"u": 0o4700, "g": 0o2070, "o": 0o0007, "a": 0o0777}
_SYMBOLIC_PERM = {"r": 0o444, "w": 0o222, "x": 0o111, "s": 0o6000, "t": 0o1000}


@functools.lru_cache(maxsize=256)
def parse_mode(text: str) -> int:
    """`0644`, `644`, `u=rw,g=r,o=` -> int. Raises ValueError with a reason."""
    t = text.strip()
    if t and all(c in "01234567" for c in t):
        if len(t) > 4:
            raise ValueError(f"{text!r} has more than 4 octal digits")
        return int(t, 8)
    mode = 0
    for clause in t.split(","):
        who, op, perms = clause.partition("=")
        if not op or not who or any(c not in _SYMBOLIC_WHO for c in who):
            raise ValueError(
                f"{text!r} is neither octal (e.g. '0644') nor symbolic (e.g. 'u=rw,g=r,o=')"
            )
        bits = 0
        for c in perms:
            if c not in _SYMBOLIC_PERM:
                raise ValueError(f"{text!r}: unknown permission {c!r}")
            bits |= _SYMBOLIC_PERM[c]
        for w in who:
            mask = _SYMBOLIC_WHO[w]
            mode = (mode & ~(mask & 0o777)) | (bits & mask)
    return mode


def lookup_id(value: str | None, by_name: Callable[[str], int], field: str, what: str) -> int:
    """A name or numeric id -> the id; -1 when not managed."""
    if value is None:
        return -1
    if value.isdigit():
        return int(value)
    try:
        return by_name(value)
    except KeyError:
        raise ResourceError(f"{field}: no such {what} {value!r}") from None


@functools.lru_cache(maxsize=256)
def octal(mode: int) -> str:
    """A mode's permission bits as a change report shows them, `0644` (memoised: a
    first apply reports the same few modes for 10k files)."""
    return f"{stat.S_IMODE(mode):04o}"


def user_text(uid: int) -> str:
    """A uid as its name where it has one (and the number), for a change report."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} ({uid})"
    except KeyError:
        return str(uid)


def group_text(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} ({gid})"
    except KeyError:
        return str(gid)


def attrs_match(st: os.stat_result, mode: int | None, uid: int, gid: int) -> bool:
    return (
        (mode is None or stat.S_IMODE(st.st_mode) == mode)
        and (uid < 0 or st.st_uid == uid)
        and (gid < 0 or st.st_gid == gid)
    )


def set_attrs(
    path: str,
    mode: int | None,
    uid: int,
    gid: int,
    root: str | None = None,
    expect: os.stat_result | None = None,
) -> None:
    """Set owner and mode of `path`, never through a symlink: the entry is opened
    O_PATH|O_NOFOLLOW (from `root`, when under it, one component at a time, each
    O_NOFOLLOW too: a directory swapped for a symlink on the way is not followed)
    and changed through that descriptor. An entry that is now a symlink, gone, or
    (`expect`: the lstat it was checked by) another file is left alone: it was
    changed under us, and the next check sees what is there."""
    try:
        fd = _open_nofollow(path, root)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            return
        raise OSError(e.errno, e.strerror, path) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            return
        if expect is not None and (st.st_dev, st.st_ino) != (expect.st_dev, expect.st_ino):
            return
        # an O_PATH descriptor takes no fchmod/fchown; its /proc link is the very
        # inode it holds (not a path looked up again), so changing through it is safe
        via = f"/proc/self/fd/{fd}"
        try:
            if uid >= 0 or gid >= 0:
                os.chown(via, uid, gid)
            if mode is not None:
                os.chmod(via, mode)  # after chown, which clears set-id bits
        except OSError as e:
            if e.errno == errno.ENOENT and not os.path.isdir("/proc/self/fd"):
                raise OSError(e.errno, "changing a mode safely needs /proc mounted", path) from None
            raise OSError(e.errno, e.strerror, path) from None
    finally:
        os.close(fd)


_DIR_NOFOLLOW = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC


def _open_nofollow(path: str, root: str | None) -> int:
    """An O_PATH descriptor of `path` itself (a symlink's own, if it is one). Under
    `root`, reached from it one directory at a time, none of them through a
    symlink (ELOOP or ENOTDIR if one is met); else from its parent directory."""
    if root is not None and path.startswith(root.rstrip("/") + "/"):
        fd = os.open(root, _DIR_NOFOLLOW)
        parts = path[len(root.rstrip("/")) + 1 :].split("/")
    else:
        parent, name = os.path.split(path)
        fd = os.open(parent or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        parts = [name]
    try:
        for part in parts[:-1]:
            nfd = os.open(part, _DIR_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return os.open(parts[-1], os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def tree_mode(mode: int | None, isdir: bool) -> int | None:
    """A mode applied to a whole tree: directories get search (x) where read is granted."""
    if mode is None or not isdir:
        return mode
    return mode | ((mode & 0o444) >> 2)
