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
The one exception is making new content durable when it replaces a file (fsync
of the file and of its directory: ~0.5 ms on a disk; a file made where nothing
was is not synced, atomic's fsync policy): a lone write does it inline, but when
writes are slow (a disk, not tmpfs) and follow each other closely (a stream of
repairs) the loop only writes each temporary file, and one committer thread
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

import errno
import grp
import os
import pwd
import stat
from collections.abc import Callable, Hashable
from typing import Annotated, Any, ClassVar, Literal

from evergraph._util.atomic import OpenDirs, Pending, leftovers_named, make_dirs, prepare
from evergraph.engine.contract import (
    Handle,
    ParentDirs,
    PathSubscription,
    Resource,
    doc,
    register,
)
from evergraph.errors import ResourceError
from evergraph.resources._commit import DurableWrites
from evergraph.resources._filereport import describe, read_input
from evergraph.resources._filetree import FileShapes
from evergraph.resources._leftovers import Sweeps
from evergraph.resources._modes import (
    UMASK,
    attrs_match,
    lookup_id,
    octal,
    parse_mode,
    set_attrs,
)
from evergraph.resources._oserror import os_error
from evergraph.resources._owninode import OwnInode


@register("file")
class File(Resource, FileShapes, kw_only=True, dict=True, forbid_unknown_fields=True):
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

    def autoedge_wants(self) -> tuple[ParentDirs, tuple[str]]:
        norm = _normpath(self.path or self.name)
        return ParentDirs(norm), (f"pkgfile:{norm}",)  # (then the package that installs it)

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

    def _mode_wanted(self) -> int | None:
        """`mode` parsed (None: not managed)."""
        return None if self.mode is None else _parsed_mode(self.mode)

    def _is_plain(self, is_dir: bool) -> bool:
        """The common case, checked first: a regular file of known content, no owner."""
        return (
            self.content is not None
            and not is_dir
            and self.state == "exists"
            and not self.symlink
            and self.owner is None
            and self.group is None
        )

    def _is_plain_dir(self, is_dir: bool) -> bool:
        """A directory with no more than a mode to manage (no tree, no owner)."""
        return (
            is_dir
            and self.state == "exists"
            and not (self.symlink or self.recurse or self.purge or self.fragments)
            and self.content is None
            and self.source is None
            and self.owner is None
            and self.group is None
        )

    def ahead_check(self, seen: dict[str, Any]) -> bool | None:
        # check_apply's plain cases, from the parameters: True in its state, False
        # absent (ahead_create may make it), None there but not in its state, or
        # not told (a leftover of a killed write next to the file needs init's
        # sweep; a short read): the engine checks those
        path = self.path or self.name
        content = self.content
        is_dir = path.endswith("/")
        if self._is_plain_dir(is_dir):
            mode = self._mode_wanted()
            path = _normpath(path)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                seen.setdefault("absent", set()).add(path)  # (and all below it)
                return False
            except OSError:
                return None
            return True if stat.S_ISDIR(st.st_mode) and attrs_match(st, mode, -1, -1) else None
        if content is None or not self._is_plain(is_dir):
            return None
        path = _normpath(path)
        absent = seen.get("absent")
        if absent is not None and path.rpartition("/")[0] in absent:
            return False  # (its directory, a resource checked before it, is not there)
        data = content.encode()
        mode = self._mode_wanted()
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        except OSError:
            return None
        listed = seen.setdefault("leftovers", {})
        if not _looks_in_state(st, data, mode) or leftovers_named(path, listed):
            return None
        try:  # (not through a link swapped in since, nor blocking on a FIFO)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            now = os.fstat(fd)
            if now.st_ino != st.st_ino or now.st_dev != st.st_dev:
                return None
            return True if os.read(fd, len(data) + 1) == data else None
        finally:
            os.close(fd)

    def ahead_create(self, seen: dict[str, Any], dirs: OpenDirs) -> Pending | bool:
        # check_apply's plain cases where nothing is there: a directory made as
        # _directory makes it; a file's write prepared as _write prepares it
        path = self.path or self.name
        is_dir = path.endswith("/")
        norm = _normpath(path)
        mode = self._mode_wanted()
        # (a directory this child made was empty: what appeared in it since is
        # replaced by the rename, as a write replaces what appeared after any check)
        made = seen.get("made")
        if not (made is not None and norm.rpartition("/")[0] in made) and os.path.lexists(norm):
            return False
        if self._is_plain_dir(is_dir):
            try:
                os.makedirs(norm, mode=0o755)
            except OSError:
                return False
            set_attrs(norm, mode, -1, -1)
            seen.setdefault("made", set()).add(norm)
            return True
        if self.content is None or not self._is_plain(is_dir):
            return False
        if leftovers_named(norm, seen.setdefault("leftovers", {})):
            return False  # (init's sweep first)
        # (prepare makes the missing directories above it, 0755, as _write does)
        # (nothing is there: a new file, renamed with no sync, atomic's fsync policy)
        return prepare(
            norm, self.content.encode(), mode=_new_mode(mode, None), dirs=dirs, fresh=True
        )

    def ahead_created(self, handle: Handle) -> None:
        # what _regular_changes and _attr_changes report of a path that was absent
        # (its owner and group unmanaged: ahead_create makes no other), with no state
        # kept on the resource (the engine initialises it if it ever runs it; a
        # first apply's 10k would each get a __dict__ here, in the parent)
        if (self.path or self.name).endswith("/"):
            handle.changed("state", None, "directory")
        else:
            assert self.content is not None  # (plain: ahead_create makes no other file)
            handle.changed("state", None, "file")
            handle.changed("content", None, self.content.encode(), content=True)
        mode = self._mode_wanted()
        if mode is not None:
            handle.changed("mode", None, octal(mode))

    def ahead_alike(self) -> Hashable | None:
        # what ahead_created reads: a directory or not, the content's size in bytes
        # (UTF-8, as it encodes it), the mode as written
        content = self.content
        if (self.path or self.name).endswith("/"):
            return None if content is not None else ("/", self.mode)  # (never a size)
        if content is None:
            return None
        return (len(content) if content.isascii() else len(content.encode())), self.mode

    async def init(self, handle: Handle) -> None:
        self.handle = handle  # (Resource.init's one line, without its coroutine: 10k inits)
        path = self.path or self.name
        self._is_dir = path.endswith("/")
        self._path = _normpath(path)
        mode = self._mode_wanted()
        if mode is None and handle.is_secret("content"):
            mode = 0o600  # a secret (a received password) is not for every reader
        self._mode = mode
        content = self.content
        self._data = None if content is None else content.encode()
        self._own = OwnInode()  # our last atomic write's inode, until its rename is seen
        is_dir = self._is_dir
        self._plain = self._is_plain(is_dir)
        if not is_dir:
            for left in handle.services.get(Sweeps).sweep(self._path):
                handle.logger.info("%s: removed %s (an interrupted write's)", self.ident, left)
        self._watch: PathSubscription | None = None
        #: extra watches (source, fragments, listed directories) by path
        self._extra: dict[str, PathSubscription] = {}
        if not hasattr(self, "_others"):
            self._others = _NO_OTHERS

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
        # our own atomic write renamed into place is not a change to repair
        if not self._own.renamed_in(mask, self._path):
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
            if _looks_in_state(st, data, self._mode) and self._read(len(data)) == data:
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
        uid = lookup_id(self.owner, lambda n: pwd.getpwnam(n).pw_uid, "owner", "user")
        gid = lookup_id(self.group, lambda n: grp.getgrnam(n).gr_gid, "group", "group")
        return uid, gid

    def _wanted(self) -> bytes | None:
        """The content to have, or None when content is not managed."""
        if self._data is not None:
            return self._data
        if self.source is not None:
            return read_input(self.source, "source")
        if self.fragments:
            parts = []
            for frag in self.fragments:
                if os.path.isdir(frag):
                    for name in sorted(os.listdir(frag)):
                        p = os.path.join(frag, name)
                        if os.path.isfile(p):
                            parts.append(read_input(p, "fragments"))
                else:
                    parts.append(read_input(frag, "fragments"))
            return b"".join(parts)
        return None

    # -- states -------------------------------------------------------------
    def _absent(self, st: os.stat_result | None, apply: bool) -> bool:
        if st is None:
            return True
        self.handle.changed("state", describe(st, self._path), None)
        if not apply:
            return False
        try:
            if stat.S_ISDIR(st.st_mode):
                if self.force:
                    import shutil  # (rare: not in every run's start-up, with bz2 and lzma)

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
            raise os_error(f"{self._path}: cannot remove", e) from None
        return False

    async def _regular(self, st: os.stat_result | None, uid: int, gid: int, apply: bool) -> bool:
        created = st is None
        if st is not None and not stat.S_ISREG(st.st_mode):
            self.handle.changed("state", describe(st, self._path), "file")
            if not apply:
                return False
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            try:
                self._in_the_way(st, what)
            except OSError as e:
                raise os_error(self._path, e) from None
            st = None
        data = self._wanted()
        current = None  # read only when the size says it may be the same
        if st is not None and data is not None and st.st_size == len(data):
            current = self._read(len(data))
        content_ok = st is not None and (data is None or current == data)
        attrs_ok = st is not None and attrs_match(st, self._mode, uid, gid)
        if content_ok and attrs_ok:
            return True
        self._regular_changes(st, created, data, current, content_ok, attrs_ok, uid, gid)
        if not apply:
            return False
        try:
            if not content_ok:
                await self._write(st, data if data is not None else b"", uid, gid)
            else:
                set_attrs(self._path, self._mode, uid, gid, expect=st)
        except OSError as e:
            raise os_error(self._path, e) from None
        return False

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
        if self._watch is not None:
            # the parent may exist by now (made by us or a sibling resource):
            # watch it before our file appears, so its rename is seen as ours
            self._watch.settle()
        mode = _new_mode(self._mode, st)
        if st is not None:  # keep the old file's owner unless told otherwise
            uid = st.st_uid if uid < 0 else uid
            gid = st.st_gid if gid < 0 else gid
        if _parent_ready(self._path) and self._watch is not None:
            self._watch.settle()
        # a random O_EXCL|O_NOFOLLOW temporary name: nothing planted there is followed
        owner = None if (uid, gid) == (-1, -1) else (uid, gid)
        # (the inode is noted before the rename, in whichever thread writes: our
        # watch's MOVED_TO is read in the loop after the rename, so it sees it)
        await self.handle.services.get(DurableWrites).write(
            self._path, data, mode, owner, self._own.note, fresh=st is None
        )


#: bytes per read() of a file's current content
_READ_CHUNK = 1 << 16
#: `_others` of a file told of no managed paths: one shared set (`frozenset()` makes a
#: new 216-byte set at each call: 2 MB for 10k files)
_NO_OTHERS: frozenset[str] = frozenset()


#: modes parsed at init, by their text (a graph's files share a few: `parse_mode`
#: walks each character of each); bounded, for graphs that give every file its own
_MODES: dict[str, int] = {}


def _parsed_mode(text: str) -> int:
    """`parse_mode(text)`, remembered (its ValueError is not: validate raised it)."""
    mode = _MODES.get(text)
    if mode is None:
        mode = parse_mode(text)
        if len(_MODES) < 256:
            _MODES[text] = mode
    return mode


def _new_mode(mode: int | None, st: os.stat_result | None) -> int:
    """A new content's mode: the one managed, else the old file's, else the default."""
    if mode is not None:
        return mode
    return 0o666 & ~UMASK if st is None else stat.S_IMODE(st.st_mode)


def _parent_ready(path: str) -> bool:
    """Make the missing directories above `path` (0755, as `install -D` does):
    True if any was made."""
    parent = path.rpartition("/")[0] or "/"
    if os.path.isdir(parent):
        return False
    make_dirs(parent, 0o755)
    return True


def _looks_in_state(st: os.stat_result, data: bytes, mode: int | None) -> bool:
    """A plain file's check before its read: a regular file of the content's size,
    with the mode (if managed)."""
    return (
        st.st_size == len(data)
        and stat.S_ISREG(st.st_mode)
        and (mode is None or stat.S_IMODE(st.st_mode) == mode)
    )


def _normpath(path: str) -> str:
    """os.path.normpath, skipped where it changes nothing (the common absolute path:
    no `//`, `/.` nor trailing `/`): graphs of 10k files ask for it several times each."""
    if "//" in path or "/." in path or path.endswith("/"):
        return os.path.normpath(path)
    return path
