"""file: a file or directory with the declared existence, content, mode and owner.

Content comes from `content`, from `source` (a file, or with `recurse` a
directory tree copied into a directory) or from `fragments` (files
concatenated; a directory stands for its files in name order). `purge`
removes what nobody manages from a directory: entries neither copied from
`source` nor managed by another resource of the graph.

Mode and owner are changed through a descriptor, never a path looked up
again: each entry is opened O_PATH|O_NOFOLLOW from the managed directory one
component at a time (every directory on the way O_NOFOLLOW too), and an entry
that became a symlink (or another file) since it was checked is left alone.
So a user who owns part of a managed tree and swaps a symlink in cannot make
a recursive `mode` or `owner` land on a file outside it.

Writes are atomic: new content goes to a temporary file in the same
directory, gets its mode (and the old file's owner), then is renamed over the
path, so a reader — or a crash — never sees half a file. Missing parent
directories are created (0755), as `install -D` does. A file whose `content`
is received from a sender that marks it secret (a `password`) is made 0600
unless `mode` says otherwise.

Check and apply run in the event loop on purpose: on a local filesystem each
syscall takes microseconds and a hop to a thread costs more than the work.
The one exception is making new content durable (fsync of the file and of its
directory: ~0.5 ms on a disk): a lone write does it inline, but when writes are
slow (a disk, not tmpfs) and follow each other closely (a first apply, a stream
of repairs) the loop only writes each temporary file, and one committer thread
makes them durable and renames them, in batches (atomic's `commit`: syncfs
instead of an fsync per file), while the loop checks other files. A write
handed to the committer is awaited to its end even when the check is
cancelled: it is never left half done, nor done after the check has returned.

The watch goes through the engine's one shared inotify instance on the
parent directory, so deletion, replacement by rename, content and mode
changes are all seen, and a path that does not exist yet is watched from its
nearest existing ancestor.

With `symlink: true` (mgmt's), the path is a symbolic link whose target is
`source`, made (by rename, so never missing) or re-pointed when it differs; a
file or directory in its place is replaced only with `force`.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import grp
import os
import pwd
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

from evergraph._util.atomic import (
    Pending,
    atomic_copy,
    atomic_write,
    commit,
    current_umask,
    is_leftover,
    leftover_of,
    make_dirs,
    sweep_leftovers_of,
)
from evergraph._util.atomic import prepare as atomic_prepare
from evergraph.engine.contract import (
    Handle,
    PathSubscription,
    Resource,
    doc,
    parent_dir_keys,
    register,
)
from evergraph.errors import ResourceError
from evergraph.watch.inotify import MOVED_TO

if TYPE_CHECKING:
    import asyncio

#: read once: asking the kernel means setting it, which is racy with threads
_UMASK = current_umask()
_SYMBOLIC_WHO = {"u": 0o4700, "g": 0o2070, "o": 0o0007, "a": 0o0777}
_SYMBOLIC_PERM = {"r": 0o444, "w": 0o222, "x": 0o111, "s": 0o6000, "t": 0o1000}
#: content larger than this is reported by its size: never read whole just to show a diff
REPORT_MAX = 4 << 20


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


@register("file")
class File(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A file (or, with a trailing `/` on path, a directory): existence, content, mode."""

    eager = True

    path: Annotated[
        str, doc("absolute path; default the name; a trailing `/` means a directory")
    ] = ""
    state: Annotated[
        Literal["exists", "absent"], doc("`exists` creates the file; `absent` removes it")
    ] = "exists"
    content: Annotated[str | None, doc("the whole content; unset = content not managed")] = None
    source: Annotated[
        str | None,
        doc("copy this file's content; for a directory path, copy this tree (needs recurse)"),
    ] = None
    fragments: Annotated[
        list[str],
        doc("content = these files concatenated; a directory adds its files in name order"),
    ] = []
    mode: Annotated[
        str | None, doc("permissions, octal `'0644'` or symbolic `'u=rw,g=r,o='` (quote it)")
    ] = None
    owner: Annotated[str | None, doc("user name or numeric uid; unset = not managed")] = None
    group: Annotated[str | None, doc("group name or numeric gid; unset = not managed")] = None
    recurse: Annotated[
        bool,
        doc("directories: copy `source` recursively; mode/owner/group apply to the whole tree"),
    ] = False
    force: Annotated[
        bool, doc("replace what is in the way: a directory by a file, a file by a directory")
    ] = False
    purge: Annotated[
        bool,
        doc("directories: remove entries not from `source` nor managed by another resource"),
    ] = False
    symlink: Annotated[
        bool, doc("the path is a symbolic link to `source` (the link's target, as written)")
    ] = False

    # -- contract -----------------------------------------------------------
    def validate(self) -> None:
        path = self.path or self.name
        if not path.startswith("/"):
            raise self.bad("path", f"{path!r} is not an absolute path")
        if "\0" in path:
            raise self.bad("path", "contains a NUL byte")
        if self.mode is not None:
            try:
                parse_mode(self.mode)
            except ValueError as e:
                raise self.bad("mode", str(e)) from None
        is_dir = path.endswith("/")
        if self.symlink:
            self._validate_symlink(is_dir)
        if (self.content is not None) + (self.source is not None) + bool(self.fragments) > 1:
            given = [
                f for f in ("content", "source", "fragments") if getattr(self, f) not in (None, [])
            ]
            raise self.bad(given[1], f"cannot be combined with {given[0]}: pick one")
        if self.source is not None or self.fragments:
            # (a link's target may be relative: to the link's directory)
            copied = [] if self.symlink or self.source is None else [("source", self.source)]
            for f, p in [*copied, *(("fragments", frag) for frag in self.fragments)]:
                if not p.startswith("/"):
                    raise self.bad(f, f"{p!r} is not an absolute path")
        if is_dir:
            if self.content is not None:
                raise self.bad("content", "a directory (path ends with /) cannot have content")
            if self.fragments:
                raise self.bad("fragments", "a directory (path ends with /) cannot have fragments")
            if self.source is not None and not self.recurse:
                raise self.bad("source", "copying a directory needs recurse: true")
        else:
            if self.purge:
                raise self.bad("purge", "only a directory (path ends with /) can be purged")
            if self.recurse:
                raise self.bad("recurse", "only a directory (path ends with /) can recurse")
        if self.owner is not None or self.group is not None:
            for f in ("owner", "group"):
                v = getattr(self, f)
                if v is not None and (not v or ":" in v or v.startswith("-")):
                    raise self.bad(f, f"{v!r} is not a name or a numeric id")
        if self.state == "absent":  # as mgmt: there is nothing to hold it
            for f in ("content", "source", "fragments", "purge"):
                if getattr(self, f) not in (None, [], False):
                    raise self.bad("state", f"absent cannot be combined with {f}")

    def _validate_symlink(self, is_dir: bool) -> None:
        if self.state != "absent" and not self.source:
            raise self.bad("symlink", "needs source: the target the link points to")
        if is_dir:
            raise self.bad("symlink", "a link's path has no trailing / (it is not a directory)")
        for f in ("content", "fragments", "mode", "recurse", "purge"):
            if getattr(self, f) not in (None, [], False):
                raise self.bad(f, "cannot be combined with symlink")

    def claims(self) -> list[str]:
        # a directory and a file of one path are one thing to manage
        path = _normpath(self.path or self.name)
        whole = self._manages_content() or self.state == "absent" or self.symlink
        if whole or (self.path or self.name).endswith("/"):
            # all of its content (a directory has none): a `line` (claims_part) would fight
            return [f"file:{path}", f"content:{path}"]
        return [f"file:{path}"]

    # Keys: "dir:/a/b/" for a managed directory, "path:/a/b" for a file (an exec
    # wants the file of its program); separate namespaces let the autoedge
    # driver skip the parent walk when no directory is managed at all.
    #: what autoedge_wants names: parent directories, the package that installs it
    wants_namespaces: ClassVar[frozenset[str] | None] = frozenset({"dir", "pkgfile"})

    def autoedge_provides(self) -> list[str]:
        path = self.path or self.name
        norm = _normpath(path)
        return [f"dir:{norm.rstrip('/')}/" if path.endswith("/") else f"path:{norm}"]

    def autoedge_wants(self) -> Iterator[Iterator[str]]:
        norm = _normpath(self.path or self.name)
        yield parent_dir_keys(norm)
        yield iter((f"pkgfile:{norm}",))  # after the package that installs it

    def managed_under(self) -> str | None:
        if self.purge:
            return os.path.normpath(self.path or self.name).rstrip("/") + "/"
        return None

    def know_managed(self, paths: frozenset[str]) -> None:
        self._others = paths

    def cmp(self, other: Resource) -> bool:
        # a purge must learn about a new managed path: restart it when the set changes
        # (init sets an empty set where prepare told nothing: the same thing)
        return super().cmp(other) and getattr(self, "_others", frozenset()) == getattr(
            other, "_others", frozenset()
        )

    def reversal(self) -> File | None:
        """What restores the path as it is now: absent, or its current content and mode."""
        path = os.path.normpath(self.path or self.name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return File(name=self.name, path=self.path or self.name, state="absent")
        mode = f"{stat.S_IMODE(st.st_mode):04o}"
        owner = str(st.st_uid) if self.owner is not None else None
        group = str(st.st_gid) if self.group is not None else None
        if stat.S_ISDIR(st.st_mode):
            return File(
                name=self.name, path=path.rstrip("/") + "/", mode=mode, owner=owner, group=group
            )
        if not stat.S_ISREG(st.st_mode):
            return None  # a symlink or a device: not ours to recreate
        content = None
        if self._manages_content() or self.state == "absent":
            try:
                with open(path, "rb") as f:
                    content = f.read().decode()
            except UnicodeDecodeError:
                content = None  # binary content cannot be kept in a str parameter
        return File(name=self.name, path=path, content=content, mode=mode, owner=owner, group=group)

    def _manages_content(self) -> bool:
        return self.content is not None or self.source is not None or bool(self.fragments)

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        path = self.path or self.name
        self._is_dir = path.endswith("/")
        self._path = _normpath(path)
        mode = parse_mode(self.mode) if self.mode is not None else None
        if mode is None and handle.is_secret("content"):
            mode = 0o600  # a secret (a received password) is not for every reader
        self._mode = mode
        content = self.content
        self._data = None if content is None else content.encode()
        self._own_ino = 0  # inode of our last atomic write, until its rename is seen
        is_dir = self._is_dir
        #: the common case, checked first: a regular file of known content, no owner
        self._plain = (
            content is not None
            and not is_dir
            and self.state == "exists"
            and not self.symlink
            and self.owner is None
            and self.group is None
        )
        if not is_dir:
            for left in _sweep_leftovers(self._path):
                handle.logger.info("%s: removed %s (an interrupted write's)", self.ident, left)
        self._watch: PathSubscription | None = None
        #: extra watches (source, fragments, listed directories) by path
        self._extra: dict[str, PathSubscription] = {}
        if not hasattr(self, "_others"):
            self._others = frozenset()

    def subscribe(self) -> Callable[[], None]:
        # A passive watch: the shared inotify hub calls us directly, so 10k
        # files need no 10k watch tasks.
        self._watch = self.handle.watcher.subscribe(self._path, self._changed)
        if self.source is not None and not self.symlink:  # (a link's target is not ours)
            self._watch_path(self.source.rstrip("/") or "/", listing=False)
        for frag in self.fragments:
            # the path itself, and its listing in case it is (or becomes) a directory
            self._watch_path(frag.rstrip("/") or "/", listing=False)
            self._watch_path(frag.rstrip("/") or "/", listing=True)
        if self._is_dir and (self.source or self.purge or self.recurse):
            self._rewatch_trees()
        return self._unsubscribe

    def _unsubscribe(self) -> None:
        if self._watch is not None:
            self._watch()
        for sub in self._extra.values():
            sub()
        self._extra.clear()

    def _watch_path(self, path: str, listing: bool) -> None:
        key = f"{path}/" if listing else path
        if key not in self._extra:
            watcher = self.handle.watcher
            hub = watcher.subscribe_dir if listing else watcher.subscribe
            self._extra[key] = hub(path, self._changed_other)

    def _changed_other(self, mask: int) -> None:
        self.handle.event()

    def _rewatch_trees(self) -> None:
        """Watch the listing of the directory (and with recurse every directory below
        it), of the source tree, and of fragment directories. Re-run after each check:
        new subdirectories get watches, vanished ones lose theirs."""
        if self._watch is None:
            return
        want: set[str] = set()
        roots = [self._path]
        if self.source is not None and self._is_dir:
            roots.append(self.source.rstrip("/") or "/")
        for root in roots:
            want.add(root)
            if self.recurse:
                for d, dirs, _files in os.walk(root):
                    want.update(f"{d}/{x}" for x in dirs)
        keys = {f"{d}/" for d in want}
        for key in [k for k in self._extra if k.endswith("/") and k not in keys]:
            self._extra.pop(key)()
        for d in want:
            self._watch_path(d, listing=True)

    def _changed(self, mask: int) -> None:
        if mask & MOVED_TO and self._own_ino:
            # Our own atomic write renaming the new file into place is not a
            # change to repair: skip the re-check if the inode is the one we
            # wrote. Any other writer's rename brings another inode; in-place
            # writes raise other events, which are never skipped.
            own, self._own_ino = self._own_ino, 0
            try:
                if os.lstat(self._path).st_ino == own:
                    return
            except OSError:
                pass
        self.handle.event()

    async def check_apply(self, apply: bool) -> bool:
        try:
            st: os.stat_result | None = os.lstat(self._path)
        except FileNotFoundError:
            st = None
        if self._plain and st is not None:
            # nothing changed (the common case): no more than one read, no objects
            data = self._data
            assert data is not None
            mode = self._mode
            if (
                st.st_size == len(data)
                and stat.S_ISREG(st.st_mode)
                and (mode is None or stat.S_IMODE(st.st_mode) == mode)
                and self._read(len(data)) == data
            ):
                return True
        if self.state == "absent":
            return self._absent(st, apply)
        uid, gid = self._ids()
        if self.symlink:
            return self._symlink(st, uid, gid, apply)
        if self._is_dir:
            ok = self._directory(st, uid, gid, apply)
            if self._extra:
                self._rewatch_trees()
            return ok
        return await self._regular(st, uid, gid, apply)

    # -- desired state ----------------------------------------------------------
    def _ids(self) -> tuple[int, int]:
        """(uid, gid) wanted, -1 where not managed. Looked up at each check, not at
        init: a user resource earlier in the graph may create the user."""
        if self.owner is None and self.group is None:
            return -1, -1  # the common case: neither managed
        uid = _lookup(self.owner, lambda n: pwd.getpwnam(n).pw_uid, "owner", "user")
        gid = _lookup(self.group, lambda n: grp.getgrnam(n).gr_gid, "group", "group")
        return uid, gid

    def _wanted(self) -> bytes | None:
        """The content to have, or None when content is not managed."""
        if self._data is not None:
            return self._data
        if self.source is not None:
            return _read_input(self.source, "source")
        if self.fragments:
            parts = []
            for frag in self.fragments:
                if os.path.isdir(frag):
                    for name in sorted(os.listdir(frag)):
                        p = os.path.join(frag, name)
                        if os.path.isfile(p):
                            parts.append(_read_input(p, "fragments"))
                else:
                    parts.append(_read_input(frag, "fragments"))
            return b"".join(parts)
        return None

    def _in_the_way(self, st: os.stat_result, what: str) -> None:
        """Remove what occupies the path (force), or refuse."""
        if not self.force:
            raise ResourceError(f"{self._path} exists and is {what} (force: true replaces it)")
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(self._path)
        else:
            os.unlink(self._path)

    # -- states -------------------------------------------------------------
    def _absent(self, st: os.stat_result | None, apply: bool) -> bool:
        if st is None:
            return True
        self.handle.changed("state", _what(st, self._path), None)
        if not apply:
            return False
        try:
            if stat.S_ISDIR(st.st_mode):
                if self.force:
                    shutil.rmtree(self._path)
                else:
                    os.rmdir(self._path)
            else:
                os.unlink(self._path)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno == errno.ENOTEMPTY:
                raise ResourceError(
                    f"{self._path}: directory is not empty (force: true removes it all)"
                ) from None
            raise ResourceError(f"{self._path}: cannot remove: {e.strerror}") from None
        return False

    def _symlink(self, st: os.stat_result | None, uid: int, gid: int, apply: bool) -> bool:
        target = self.source or ""
        is_link = st is not None and stat.S_ISLNK(st.st_mode)
        now = os.readlink(self._path) if st is not None and is_link else None
        owned = st is not None and uid in (-1, st.st_uid) and gid in (-1, st.st_gid)
        if now == target and owned:
            return True
        if st is not None and not is_link:
            self.handle.changed("state", _what(st, self._path), "symlink")
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
            raise ResourceError(f"{e.filename or self._path}: {e.strerror or e}") from None
        return False

    def _directory(self, st: os.stat_result | None, uid: int, gid: int, apply: bool) -> bool:
        if st is not None and not stat.S_ISDIR(st.st_mode):
            self.handle.changed("state", _what(st, self._path), "directory")
            if not apply:
                return False
            self._in_the_way(st, "not a directory")
            st = None
        elif st is None:
            self.handle.changed("state", None, "directory")
        clean = st is not None and _attrs_ok(st, self._mode, uid, gid)
        if not clean:
            self._attr_changes("", st, self._mode, uid, gid)
            if not apply:
                return False
        try:
            if st is None:
                os.makedirs(self._path, mode=0o755, exist_ok=True)
            if not clean:
                _set_attrs(self._path, self._mode, uid, gid, expect=st)
            if self.source is not None or self.recurse or self.purge:
                clean = self._tree(uid, gid, apply) and clean
        except OSError as e:
            raise ResourceError(f"{e.filename or self._path}: {e.strerror or e}") from None
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
            mine = set(_listdir(here))
            theirs: dict[str, os.stat_result] = {}
            if src is not None:
                sdir = f"{src}/{rel}" if rel else src
                for name in _listdir(sdir):
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
                    self.handle.changed(self._rel(target), _what(_lstat(target)), None)
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
                    mode = _tree_mode(self._mode, isdir)
                    if not _attrs_ok(tst, mode, uid, gid):
                        clean = False
                        self._attr_changes(f"{self._rel(target)} ", tst, mode, uid, gid)
                        if apply:
                            _set_attrs(target, mode, uid, gid, self._path, tst)
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
        mode = _tree_mode(self._mode, isdir)
        if mode is None:
            mode = stat.S_IMODE(sst.st_mode)
        if stat.S_ISLNK(sst.st_mode):
            link = os.readlink(src)
            if tst is not None and stat.S_ISLNK(tst.st_mode) and os.readlink(target) == link:
                return True
            self.handle.changed(self._rel(target), _what(tst, target), f"symlink → {link}")
            if apply:
                if tst is not None:
                    _remove(target)
                os.symlink(link, target)
            return False
        if isdir:
            if tst is not None and stat.S_ISDIR(tst.st_mode):
                if _attrs_ok(tst, mode, uid, gid):
                    return True
                self._attr_changes(f"{self._rel(target)} ", tst, mode, uid, gid)
                if apply:
                    _set_attrs(target, mode, uid, gid, self._path, tst)
                return False
            self.handle.changed(self._rel(target), _what(tst, target), "directory")
            if apply:
                if tst is not None:
                    _remove(target)
                os.mkdir(target, mode)
                _set_attrs(target, mode, uid, gid, self._path)
            return False
        if not stat.S_ISREG(sst.st_mode):
            return True  # devices, sockets, fifos: not copied
        same = (
            tst is not None
            and stat.S_ISREG(tst.st_mode)
            and tst.st_size == sst.st_size
            and _read_input(target, "path") == _read_input(src, "source")
        )
        if same and tst is not None and _attrs_ok(tst, mode, uid, gid):
            return True
        self._entry_changes(src, sst, target, tst, same, mode, uid, gid)
        if apply:
            if same:
                _set_attrs(target, mode, uid, gid, self._path, tst)
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

    async def _regular(self, st: os.stat_result | None, uid: int, gid: int, apply: bool) -> bool:
        created = st is None
        if st is not None and not stat.S_ISREG(st.st_mode):
            self.handle.changed("state", _what(st, self._path), "file")
            if not apply:
                return False
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            try:
                self._in_the_way(st, what)
            except OSError as e:
                raise ResourceError(f"{self._path}: {e.strerror or e}") from None
            st = None
        data = self._wanted()
        current = None  # read only when the size says it may be the same
        if st is not None and data is not None and st.st_size == len(data):
            current = self._read(len(data))
        content_ok = st is not None and (data is None or current == data)
        attrs_ok = st is not None and _attrs_ok(st, self._mode, uid, gid)
        if content_ok and attrs_ok:
            return True
        self._regular_changes(st, created, data, current, content_ok, attrs_ok, uid, gid)
        if not apply:
            return False
        try:
            if not content_ok:
                await self._write(st, data if data is not None else b"", uid, gid)
            else:
                _set_attrs(self._path, self._mode, uid, gid, expect=st)
        except OSError as e:
            raise ResourceError(f"{self._path}: {e.strerror or e}") from None
        return False

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
                    h.changed("content", _size(st.st_size), _size(len(data)))
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
            h.changed(f"{where}mode", None if st is None else _octal(st.st_mode), _octal(mode))
        if uid >= 0 and (st is None or st.st_uid != uid):
            h.changed(f"{where}owner", None if st is None else _user(st.st_uid), _user(uid))
        if gid >= 0 and (st is None or st.st_gid != gid):
            h.changed(f"{where}group", None if st is None else _group(st.st_gid), _group(gid))

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
                h.changed(rel, _what(tst, target), "file")
            old_size = tst.st_size if tst is not None and is_file else 0
            if max(old_size, sst.st_size) > REPORT_MAX:  # not read whole just to be shown
                h.changed(rel, _size(old_size) if is_file else None, _size(sst.st_size))
            else:
                old = _read_input(target, "path") if is_file else None
                h.changed(rel, old, _read_input(src, "source"), content=True)
            if not is_file:
                tst = None
        self._attr_changes(f"{rel} ", tst, mode, uid, gid)

    def _rel(self, path: str) -> str:
        """A path in our tree, relative to the directory."""
        return path[len(self._path) :].lstrip("/") or "."

    # -- io ---------------------------------------------------------------------
    def _read(self, size: int = -1) -> bytes:
        """The file's content. `size`: what its stat said; one read of size + 1
        bytes that returns less is the end (a short read of a regular file), so a
        file of that size takes one read, not a second one to see the end."""
        # raw syscalls, not open(): no buffered-reader object per check (10k
        # files are read on every no-change run)
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return b""
        try:
            if size >= 0:
                first = os.read(fd, size + 1)
                if len(first) <= size:
                    return first
                parts = [first]
            else:
                parts = []
            while chunk := os.read(fd, _READ_CHUNK):
                parts.append(chunk)
            return parts[0] if len(parts) == 1 else b"".join(parts)
        finally:
            os.close(fd)

    async def _write(self, st: os.stat_result | None, data: bytes, uid: int, gid: int) -> None:
        parent = self._path.rpartition("/")[0]
        parent = parent or "/"
        if self._watch is not None:
            # the parent may exist by now (made by us or a sibling resource):
            # watch it before our file appears, so its rename is seen as ours
            self._watch.settle()
        if self._mode is not None:
            mode = self._mode
        elif st is not None:
            mode = stat.S_IMODE(st.st_mode)
        else:
            mode = 0o666 & ~_UMASK
        if st is not None:  # keep the old file's owner unless told otherwise
            uid = st.st_uid if uid < 0 else uid
            gid = st.st_gid if gid < 0 else gid
        if not os.path.isdir(parent):
            make_dirs(parent, 0o755)  # as `install -D` does
            if self._watch is not None:
                self._watch.settle()
        # a random O_EXCL|O_NOFOLLOW temporary name: nothing planted there is followed
        owner = None if (uid, gid) == (-1, -1) else (uid, gid)
        # (the inode is noted before the rename, in whichever thread writes: our
        # watch's MOVED_TO is read in the loop after the rename, so it sees it)
        await _durably(self._path, data, mode, owner, self._note_ino)

    def _note_ino(self, fd: int) -> None:
        self._own_ino = os.fstat(fd).st_ino


# -- durable writes off the loop -------------------------------------------------------

#: a write is handed to the committer only when writes are slow (the median of the
#: last few done inline: an fsync on a disk, ~0.5 ms here; tmpfs ~0.09 ms, where the
#: hop costs more than it saves) and they come in a stream: one starts within
#: STREAM_S of the last one's end, or while others are with the committer. A lone
#: write (a drift repair) is done inline: a hop to a thread and back is ~0.1 ms.
SLOW_S = 0.00025
STREAM_S = 0.005
#: in a stream sent to the committer, every SAMPLE-th write is still done inline, to
#: measure again
SAMPLE = 32
#: writes with the committer at most: each holds its directory open (see
#: atomic.Pending), and a batch waits for the one before it
MAX_PENDING = 512
#: writes with the committer now; when (time.monotonic()) the last write ended; the
#: durations of the last inline writes; writes sent since the last sample; writes
#: waiting for room below MAX_PENDING
_in_flight = 0
_last_end = -1.0
_inline_s: collections.deque[float] = collections.deque([0.0], maxlen=5)
_since_sample = 0
_room: list[asyncio.Future[None]] = []


def _slow() -> bool:
    return sorted(_inline_s)[len(_inline_s) // 2] >= SLOW_S


class _Job:
    __slots__ = ("done", "error", "fut", "loop", "pending")

    def __init__(self, pending: Pending, loop: asyncio.AbstractEventLoop) -> None:
        self.pending = pending
        self.loop = loop
        self.fut: asyncio.Future[None] = loop.create_future()
        self.done = False
        self.error: BaseException | None = None


class _Committer:
    """One daemon thread committing the temporary files the loop prepared: it takes
    every write queued meanwhile as one batch (a group commit: the longer the disk
    takes, the bigger the next batch) and hands the ended ones back with one
    wake-up of their loop (a future per write, and its wake-up, would cost the loop
    more than the write saves it when 10k files are written)."""

    def __init__(self) -> None:
        import threading  # (here: `check`, which writes nothing, does not load it)

        self._cv = threading.Condition(threading.Lock())
        self._jobs: list[_Job] = []
        self._ended: dict[asyncio.AbstractEventLoop, list[_Job]] = {}
        self._thread: threading.Thread | None = None
        self._new_thread = threading.Thread

    def submit(self, job: _Job) -> None:
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()
            if self._thread is not None:
                return
            self._thread = self._new_thread(target=self._work, name="evergraph-commit", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                batch, self._jobs = self._jobs, []
            try:
                errors = commit([job.pending for job in batch])
            except BaseException as e:  # handed to every awaiting check, raised there
                errors = [e] * len(batch)
            loops: set[asyncio.AbstractEventLoop] = set()
            with self._cv:
                for job, error in zip(batch, errors, strict=True):
                    job.error = error
                    self._ended.setdefault(job.loop, []).append(job)
                    loops.add(job.loop)
            for loop in loops:
                with contextlib.suppress(RuntimeError):  # (a closed loop: nobody waits)
                    loop.call_soon_threadsafe(self._deliver, loop)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._cv:
            ended = self._ended.pop(loop, [])
        for job in ended:
            job.done = True
            if not job.fut.done():
                job.fut.set_result(None)
        while _room:
            fut = _room.pop()
            if not fut.done():
                fut.set_result(None)


_committer: _Committer | None = None


async def _durably(
    path: str,
    data: bytes,
    mode: int,
    owner: tuple[int, int] | None,
    before_rename: Callable[[int], None],
) -> None:
    """An atomic, durable write of `data` to `path` (see atomic_write): inline, or
    prepared here and committed by the committer thread (see SLOW_S); returns once
    it is durable. Cancelled while the committer works on it, it waits for the
    commit's end, then raises the cancellation."""
    global _in_flight, _last_end, _committer, _since_sample
    if (
        not _slow()
        or (not _in_flight and time.monotonic() - _last_end > STREAM_S)
        or _since_sample >= SAMPLE
    ):
        _since_sample = 0
        t0 = time.monotonic()
        try:
            atomic_write(path, data, mode=mode, owner=owner, before_rename=before_rename)
        finally:
            _last_end = time.monotonic()
            _inline_s.append(_last_end - t0)
        return
    import asyncio  # (loaded by then: we run in its loop)

    loop = asyncio.get_running_loop()
    while _in_flight >= MAX_PENDING:
        room = loop.create_future()
        _room.append(room)
        await room
    _since_sample += 1
    if _committer is None:
        _committer = _Committer()
    job = _Job(
        atomic_prepare(path, data, mode=mode, owner=owner, before_rename=before_rename), loop
    )
    _committer.submit(job)
    _in_flight += 1
    cancel: asyncio.CancelledError | None = None
    try:
        while True:
            try:
                await job.fut
                break
            except asyncio.CancelledError as e:
                # the write cannot be stopped half done: wait for its end, then stop
                cancel = e
                if job.done:
                    break
                job.fut = job.loop.create_future()
    finally:
        _in_flight -= 1
        _last_end = time.monotonic()
    if cancel is not None:
        raise cancel
    if job.error is not None:
        raise job.error


#: bytes per read() of a file's current content
_READ_CHUNK = 1 << 16


def _normpath(path: str) -> str:
    """os.path.normpath, skipped where it changes nothing (the common absolute path:
    no `//`, `/.` nor trailing `/`): graphs of 10k files ask for it several times each."""
    if "//" in path or "/." in path or path.endswith("/"):
        return os.path.normpath(path)
    return path


#: directory listings for `sweep_leftovers_of`, kept for one turn of the event loop
#: `_listed_in`, then forgotten. The inits of a swap (a thousand between two yields)
#: share one listing of each directory, with no stat of it per file; nothing of ours
#: runs between them that could leave a leftover (only a kill does).
_listed: dict[str, dict[str, list[str]]] = {}
_listed_in: list[asyncio.AbstractEventLoop | None] = [None]
#: the paths swept since the loop `_swept_in` began: each once. Leftovers come from
#: a process killed mid-write, not from this run (a failed write removes its own),
#: so a vertex started again for the same path (a swap: a collector's changed export)
#: does not list its directory again (10k collected files share one: ~5 ms a change)
_swept: set[str] = set()
_swept_in: list[asyncio.AbstractEventLoop | None] = [None]
#: asyncio.get_running_loop, once imported
_running_loop: Callable[[], asyncio.AbstractEventLoop] | None = None


def _end_turn() -> None:
    _listed.clear()
    _listed_in[0] = None


def _sweep_leftovers(path: str) -> list[str]:
    """`sweep_leftovers_of(path)` with this turn's listings (outside a loop: its own),
    once per path in a run."""
    global _running_loop
    if _running_loop is None:
        import asyncio  # (loaded by then: inits run in its loop)

        _running_loop = asyncio.get_running_loop
    try:
        loop = _running_loop()
    except RuntimeError:
        return sweep_leftovers_of(path)  # (no turn to end: nothing kept)
    if _swept_in[0] is not loop:  # (a new run)
        _swept.clear()
        _swept_in[0] = loop
    if path in _swept:
        return []
    _swept.add(path)
    if _listed_in[0] is not loop:  # (another loop's turn, never ended: it stopped)
        _end_turn()
        loop.call_soon(_end_turn)
        _listed_in[0] = loop
    return sweep_leftovers_of(path, _listed)


def _lookup(value: str | None, by_name: Callable[[str], int], field: str, what: str) -> int:
    """A name or numeric id -> the id; -1 when not managed."""
    if value is None:
        return -1
    if value.isdigit():
        return int(value)
    try:
        return by_name(value)
    except KeyError:
        raise ResourceError(f"{field}: no such {what} {value!r}") from None


def _read_input(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ResourceError(f"{field} {path}: no such file") from None
    except IsADirectoryError:
        raise ResourceError(f"{field} {path}: is a directory") from None
    except OSError as e:
        raise ResourceError(f"{field} {path}: {e.strerror}") from None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _what(st: os.stat_result | None, path: str = "") -> str | None:
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


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _size(n: int) -> str:
    return "1 byte" if n == 1 else f"{n} bytes"


def _octal(mode: int) -> str:
    return f"{stat.S_IMODE(mode):04o}"


def _user(uid: int) -> str:
    """A uid as its name where it has one (and the number), for a change report."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} ({uid})"
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} ({gid})"
    except KeyError:
        return str(gid)


def _attrs_ok(st: os.stat_result, mode: int | None, uid: int, gid: int) -> bool:
    return (
        (mode is None or stat.S_IMODE(st.st_mode) == mode)
        and (uid < 0 or st.st_uid == uid)
        and (gid < 0 or st.st_gid == gid)
    )


def _set_attrs(
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


def _tree_mode(mode: int | None, isdir: bool) -> int | None:
    """A mode applied to a whole tree: directories get search (x) where read is granted."""
    if mode is None or not isdir:
        return mode
    return mode | ((mode & 0o444) >> 2)


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
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
    atomic_copy(src, target, mode=0o666 & ~_UMASK if mode is None else mode, owner=owner)
