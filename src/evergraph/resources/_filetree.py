"""The file kind's other shapes: a directory (made, with `source` and `recurse` a
tree copied into it, with `purge` emptied of what nobody manages) and a symbolic
link; and what is in the way of either. A mixin of File, apart from its regular
file so each room stays readable."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from typing import TYPE_CHECKING

from evergraph._util.atomic import atomic_copy, is_leftover, leftover_of
from evergraph.errors import ResourceError
from evergraph.resources._filereport import (
    FileReport,
    describe,
    listdir_or_empty,
    lstat_or_none,
    read_input,
)
from evergraph.resources._modes import UMASK, attrs_match, set_attrs, tree_mode
from evergraph.resources._oserror import os_error


class FileShapes(FileReport):
    """Directories, trees and symlinks of the file kind (mixed into File)."""

    __slots__ = ()

    if TYPE_CHECKING:  # (File's)
        source: str | None
        force: bool
        purge: bool
        recurse: bool

        @property
        def ident(self) -> str: ...

        _others: frozenset[str]

    def _in_the_way(self, st: os.stat_result, what: str) -> None:
        """Remove what occupies the path (force), or refuse."""
        if not self.force:
            raise ResourceError(f"{self._path} exists and is {what} (force: true replaces it)")
        if stat.S_ISDIR(st.st_mode):
            import shutil  # (rare: not in every run's start-up, with bz2 and lzma)

            shutil.rmtree(self._path)
        else:
            os.unlink(self._path)

    def _symlink(self, st: os.stat_result | None, uid: int, gid: int, apply: bool) -> bool:
        target = self.source or ""
        is_link = st is not None and stat.S_ISLNK(st.st_mode)
        now = os.readlink(self._path) if st is not None and is_link else None
        owned = st is not None and uid in (-1, st.st_uid) and gid in (-1, st.st_gid)
        if now == target and owned:
            return True
        if st is not None and not is_link:
            self.handle.changed("state", describe(st, self._path), "symlink")
        if now != target:
            self.handle.changed("symlink", now, target)
        if not owned:
            self._attr_changes("", st if is_link else None, None, uid, gid)
        if not apply:
            return False
        try:
            if st is not None and not is_link:
                self._in_the_way(st, "not a symlink")
            if now != target:
                os.makedirs(os.path.dirname(self._path), 0o755, exist_ok=True)
                # made beside it, then renamed over it: the path is never missing
                tmp = os.path.join(
                    os.path.dirname(self._path), f".{os.path.basename(self._path)}.evergraph-link"
                )
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                os.symlink(target, tmp)
                os.replace(tmp, self._path)
            if uid != -1 or gid != -1:
                os.lchown(self._path, uid, gid)
        except OSError as e:
            raise os_error(e.filename or self._path, e) from None
        return False

    def _directory(self, st: os.stat_result | None, uid: int, gid: int, apply: bool) -> bool:
        if st is not None and not stat.S_ISDIR(st.st_mode):
            self.handle.changed("state", describe(st, self._path), "directory")
            if not apply:
                return False
            self._in_the_way(st, "not a directory")
            st = None
        elif st is None:
            self.handle.changed("state", None, "directory")
        clean = st is not None and attrs_match(st, self._mode, uid, gid)
        if not clean:
            self._attr_changes("", st, self._mode, uid, gid)
            if not apply:
                return False
        try:
            if st is None:
                os.makedirs(self._path, mode=0o755, exist_ok=True)
            if not clean:
                set_attrs(self._path, self._mode, uid, gid, expect=st)
            if self.source is not None or self.recurse or self.purge:
                clean = self._tree(uid, gid, apply) and clean
        except OSError as e:
            raise os_error(e.filename or self._path, e) from None
        return clean

    def _tree(self, uid: int, gid: int, apply: bool) -> bool:
        """Copy the source tree, apply attributes below, purge: True if all was clean."""
        clean = True
        src = self.source.rstrip("/") if self.source is not None else None
        if src is not None and not os.path.isdir(src):
            raise ResourceError(f"source {src}: not a directory")
        # walk the target and the source side by side, top-down
        stack = [""]
        while stack:
            rel = stack.pop()
            here = f"{self._path}/{rel}" if rel else self._path
            mine = set(listdir_or_empty(here))
            theirs: dict[str, os.stat_result] = {}
            if src is not None:
                sdir = f"{src}/{rel}" if rel else src
                for name in listdir_or_empty(sdir):
                    theirs[name] = os.lstat(f"{sdir}/{name}")
            for name, sst in sorted(theirs.items()):
                target = f"{here}/{name}"
                srcpath = f"{src}/{rel}/{name}" if rel else f"{src}/{name}"
                ok = self._copy_entry(srcpath, sst, target, uid, gid, apply)
                clean = clean and ok
                if stat.S_ISDIR(sst.st_mode) and (apply or ok):
                    stack.append(f"{rel}/{name}" if rel else name)
            for name in sorted(mine - set(theirs)):
                target = f"{here}/{name}"
                if apply and _left_by_us(target, name, theirs):
                    _remove(target)  # a copy's temporary file, left by a kill
                    continue
                if self.purge and not self._kept(target):
                    clean = False
                    self.handle.changed(self._rel(target), describe(lstat_or_none(target)), None)
                    if apply:
                        self.handle.logger.info("%s: purge %s", self.ident, target)
                        _remove(target)
                    continue
                if self.recurse and not self._managed_by_other(target):
                    try:
                        tst = os.lstat(target)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISLNK(tst.st_mode):
                        continue
                    isdir = stat.S_ISDIR(tst.st_mode)
                    mode = tree_mode(self._mode, isdir)
                    if not attrs_match(tst, mode, uid, gid):
                        clean = False
                        self._attr_changes(f"{self._rel(target)} ", tst, mode, uid, gid)
                        if apply:
                            set_attrs(target, mode, uid, gid, self._path, tst)
                    if isdir:
                        stack.append(f"{rel}/{name}" if rel else name)
        return clean

    def _copy_entry(
        self, src: str, sst: os.stat_result, target: str, uid: int, gid: int, apply: bool
    ) -> bool:
        if self._managed_by_other(target):
            return True  # another resource owns it
        try:
            tst: os.stat_result | None = os.lstat(target)
        except FileNotFoundError:
            tst = None
        isdir = stat.S_ISDIR(sst.st_mode)
        mode = tree_mode(self._mode, isdir)
        if mode is None:
            mode = stat.S_IMODE(sst.st_mode)
        if stat.S_ISLNK(sst.st_mode):
            link = os.readlink(src)
            if tst is not None and stat.S_ISLNK(tst.st_mode) and os.readlink(target) == link:
                return True
            self.handle.changed(self._rel(target), describe(tst, target), f"symlink → {link}")
            if apply:
                if tst is not None:
                    _remove(target)
                os.symlink(link, target)
            return False
        if isdir:
            if tst is not None and stat.S_ISDIR(tst.st_mode):
                if attrs_match(tst, mode, uid, gid):
                    return True
                self._attr_changes(f"{self._rel(target)} ", tst, mode, uid, gid)
                if apply:
                    set_attrs(target, mode, uid, gid, self._path, tst)
                return False
            self.handle.changed(self._rel(target), describe(tst, target), "directory")
            if apply:
                if tst is not None:
                    _remove(target)
                os.mkdir(target, mode)
                set_attrs(target, mode, uid, gid, self._path)
            return False
        if not stat.S_ISREG(sst.st_mode):
            return True  # devices, sockets, fifos: not copied
        same = (
            tst is not None
            and stat.S_ISREG(tst.st_mode)
            and tst.st_size == sst.st_size
            and read_input(target, "path") == read_input(src, "source")
        )
        if same and tst is not None and attrs_match(tst, mode, uid, gid):
            return True
        self._entry_changes(src, sst, target, tst, same, mode, uid, gid)
        if apply:
            if same:
                set_attrs(target, mode, uid, gid, self._path, tst)
            else:
                if tst is not None and stat.S_ISDIR(tst.st_mode):
                    _remove(target)
                _atomic_copy(src, target, mode, uid, gid)
        return False

    def _managed_by_other(self, path: str) -> bool:
        return path in self._others

    def _kept(self, path: str) -> bool:
        """Purge keeps what another resource manages, and the directories leading to it."""
        if path in self._others:
            return True
        prefix = path + "/"
        return any(p.startswith(prefix) for p in self._others)


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil  # (rare: not in every run's start-up, with bz2 and lzma)

            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _left_by_us(target: str, name: str, theirs: Iterable[str]) -> bool:
    of = leftover_of(name)
    return of is not None and any(is_leftover(target, t) for t in theirs if t.startswith(of))


def _atomic_copy(src: str, target: str, mode: int | None, uid: int, gid: int) -> None:
    owner = None if (uid, gid) == (-1, -1) else (uid, gid)
    atomic_copy(src, target, mode=0o666 & ~UMASK if mode is None else mode, owner=owner)
