"""How a file resource reports what differs (only once something does): the
changes of a regular file, of a tree's entry, of mode and owner, each named and
shown as the engine's `changed()` wants them. A mixin of the file kind, apart
from its states so each room stays readable; with the small helpers that describe
what a path is."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from evergraph.errors import ResourceError
from evergraph.resources._modes import group_text, octal, user_text
from evergraph.resources._oserror import os_error

if TYPE_CHECKING:
    from evergraph.engine.contract import Handle

#: content larger than this is reported by its size: never read whole just to show a diff
REPORT_MAX = 4 << 20


class FileReport:
    """Change reporting of the file kind (mixed into File)."""

    __slots__ = ()

    if TYPE_CHECKING:  # (File's)
        handle: Handle
        _path: str
        _mode: int | None

        def _read(self, size: int = -1) -> bytes: ...

    # -- reporting changes (only once something differs) ---------------------------
    def _regular_changes(
        self,
        st: os.stat_result | None,
        created: bool,
        data: bytes | None,
        current: bytes | None,
        content_ok: bool,
        attrs_ok: bool,
        uid: int,
        gid: int,
    ) -> None:
        """Report how the file differs (`created`: it does not exist; st is None
        too when what was in its place was removed)."""
        h = self.handle
        if created:
            h.changed("state", None, "file")
        if not content_ok and data is not None:
            if st is not None and current is None:
                if st.st_size > REPORT_MAX:  # not read whole just to be shown
                    h.changed("content", size_text(st.st_size), size_text(len(data)))
                    data = None
                else:
                    current = self._read()
            if data is not None:
                h.changed("content", current if st is not None else None, data, content=True)
        if not attrs_ok:
            self._attr_changes("", st, self._mode, uid, gid)

    def _attr_changes(
        self, where: str, st: os.stat_result | None, mode: int | None, uid: int, gid: int
    ) -> None:
        """Report the attributes that differ (`where`: a tree entry's name and a space)."""
        h = self.handle
        if mode is not None and (st is None or stat.S_IMODE(st.st_mode) != mode):
            h.changed(f"{where}mode", None if st is None else octal(st.st_mode), octal(mode))
        if uid >= 0 and (st is None or st.st_uid != uid):
            h.changed(f"{where}owner", None if st is None else user_text(st.st_uid), user_text(uid))
        if gid >= 0 and (st is None or st.st_gid != gid):
            h.changed(
                f"{where}group", None if st is None else group_text(st.st_gid), group_text(gid)
            )

    def _entry_changes(
        self,
        src: str,
        sst: os.stat_result,
        target: str,
        tst: os.stat_result | None,
        same: bool,
        mode: int | None,
        uid: int,
        gid: int,
    ) -> None:
        """Report how a regular file copied into a tree differs from its source."""
        h, rel = self.handle, self._rel(target)
        if not same:
            is_file = tst is not None and stat.S_ISREG(tst.st_mode)
            if not is_file:
                h.changed(rel, describe(tst, target), "file")
            old_size = tst.st_size if tst is not None and is_file else 0
            if max(old_size, sst.st_size) > REPORT_MAX:  # not read whole just to be shown
                h.changed(rel, size_text(old_size) if is_file else None, size_text(sst.st_size))
            else:
                old = read_input(target, "path") if is_file else None
                h.changed(rel, old, read_input(src, "source"), content=True)
            if not is_file:
                tst = None
        self._attr_changes(f"{rel} ", tst, mode, uid, gid)

    def _rel(self, path: str) -> str:
        """A path in our tree, relative to the directory."""
        return path[len(self._path) :].lstrip("/") or "."


def read_input(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ResourceError(f"{field} {path}: no such file") from None
    except IsADirectoryError:
        raise ResourceError(f"{field} {path}: is a directory") from None
    except OSError as e:
        raise os_error(f"{field} {path}", e) from None


def listdir_or_empty(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def describe(st: os.stat_result | None, path: str = "") -> str | None:
    """What a path is, for a change report (None: nothing); a symlink with its target."""
    if st is None:
        return None
    if stat.S_ISREG(st.st_mode):
        return "file"
    if stat.S_ISDIR(st.st_mode):
        return "directory"
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"symlink → {os.readlink(path)}" if path else "symlink"
        except OSError:
            return "symlink"
    return "special file"


def lstat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def size_text(n: int) -> str:
    return "1 byte" if n == 1 else f"{n} bytes"
