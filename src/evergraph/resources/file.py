"""file: a file or directory with the declared existence, content and mode.

Writes are atomic: new content goes to a temporary file in the same
directory, gets its mode (and the old file's owner), then is renamed over the
path, so a reader — or a crash — never sees half a file. Missing parent
directories are created (0755), as `install -D` does.

Check and apply run in the event loop on purpose: on a local filesystem each
syscall takes microseconds and a hop to a thread costs more than the work.

The watch goes through the engine's one shared inotify instance on the
parent directory, so deletion, replacement by rename, content and mode
changes are all seen, and a path that does not exist yet is watched from its
nearest existing ancestor.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Callable, Iterator
from typing import Annotated, Literal

from evergraph.engine.contract import Handle, PathSubscription, Resource, doc, register
from evergraph.errors import ResourceError
from evergraph.watch.inotify import MOVED_TO


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: read once: asking the kernel means setting it, which is racy with threads
_UMASK = _current_umask()
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
    mode: Annotated[
        str | None, doc("permissions, octal `'0644'` or symbolic `'u=rw,g=r,o='` (quote it)")
    ] = None

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
        if path.endswith("/") and self.content is not None:
            raise self.bad("content", "a directory (path ends with /) cannot have content")

    # Keys: "dir:/a/b/" for a managed directory, "path:/a/b" for a file (an exec
    # wants the file of its program); separate namespaces let the autoedge
    # driver skip the parent walk when no directory is managed at all.
    def autoedge_provides(self) -> list[str]:
        path = self.path or self.name
        norm = os.path.normpath(path)
        return [f"dir:{norm.rstrip('/')}/" if path.endswith("/") else f"path:{norm}"]

    def autoedge_wants(self) -> Iterator[Iterator[str]]:
        yield self._parent_keys(os.path.normpath(self.path or self.name))

    @staticmethod
    def _parent_keys(path: str) -> Iterator[str]:
        # Lazily, nearest first: the first managed one ends the walk.
        end = path.rfind("/")
        while end > 0:
            yield f"dir:{path[:end]}/"
            end = path.rfind("/", 0, end)
        yield "dir:/"

    def reversal(self) -> File | None:
        """What restores the path as it is now: absent, or its current content and mode."""
        path = os.path.normpath(self.path or self.name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return File(name=self.name, path=self.path or self.name, state="absent")
        mode = f"{stat.S_IMODE(st.st_mode):04o}"
        if stat.S_ISDIR(st.st_mode):
            return File(name=self.name, path=path.rstrip("/") + "/", mode=mode)
        if not stat.S_ISREG(st.st_mode):
            return None  # a symlink or a device: not ours to recreate
        content = None
        if self.content is not None or self.state == "absent":
            try:
                with open(path, "rb") as f:
                    content = f.read().decode()
            except UnicodeDecodeError:
                content = None  # binary content cannot be kept in a str parameter
        return File(name=self.name, path=path, content=content, mode=mode)

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        path = self.path or self.name
        self._is_dir = path.endswith("/")
        self._path = os.path.normpath(path)
        self._mode = parse_mode(self.mode) if self.mode is not None else None
        self._data = self.content.encode() if self.content is not None else None
        self._own_ino = 0  # inode of our last atomic write, until its rename is seen
        self._watch: PathSubscription | None = None

    def subscribe(self) -> Callable[[], None]:
        # A passive watch: the shared inotify hub calls us directly, so 10k
        # files need no 10k watch tasks.
        self._watch = self.handle.watcher.subscribe(self._path, self._changed)
        return self._watch

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
        if self.state == "absent":
            return self._absent(st, apply)
        if self._is_dir:
            return self._directory(st, apply)
        return self._regular(st, apply)

    # -- states -------------------------------------------------------------
    def _absent(self, st: os.stat_result | None, apply: bool) -> bool:
        if st is None:
            return True
        if not apply:
            return False
        try:
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(self._path)
            else:
                os.unlink(self._path)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno == errno.ENOTEMPTY:
                raise ResourceError(f"{self._path}: directory is not empty") from None
            raise ResourceError(f"{self._path}: cannot remove: {e.strerror}") from None
        return False

    def _directory(self, st: os.stat_result | None, apply: bool) -> bool:
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise ResourceError(f"{self._path} exists and is not a directory")
        mode_ok = self._mode is None or (st is not None and stat.S_IMODE(st.st_mode) == self._mode)
        if st is not None and mode_ok:
            return True
        if not apply:
            return False
        try:
            if st is None:
                os.makedirs(self._path, mode=0o755, exist_ok=True)
            if self._mode is not None:
                os.chmod(self._path, self._mode)
        except OSError as e:
            raise ResourceError(f"{self._path}: {e.strerror}") from None
        return False

    def _regular(self, st: os.stat_result | None, apply: bool) -> bool:
        if st is not None and not stat.S_ISREG(st.st_mode):
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise ResourceError(f"{self._path} exists and is {what}")
        data = self._data
        content_ok = st is not None and (
            data is None or (st.st_size == len(data) and self._read() == data)
        )
        mode_ok = self._mode is None or (st is not None and stat.S_IMODE(st.st_mode) == self._mode)
        if content_ok and mode_ok:
            return True
        if not apply:
            return False
        try:
            if not content_ok:
                self._write(st, data if data is not None else b"")
            else:
                assert self._mode is not None
                os.chmod(self._path, self._mode)
        except OSError as e:
            raise ResourceError(f"{self._path}: {e.strerror or e}") from None
        return False

    # -- io ---------------------------------------------------------------------
    def _read(self) -> bytes:
        try:
            with open(self._path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""

    def _write(self, st: os.stat_result | None, data: bytes) -> None:
        parent, _, base = self._path.rpartition("/")
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
        tmp = f"{parent}/.{base}.evergraph-{os.getpid()}-{id(self):x}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            os.makedirs(parent, mode=0o755, exist_ok=True)  # as `install -D` does
            if self._watch is not None:
                self._watch.settle()
            fd = os.open(tmp, flags, 0o600)
        try:
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                os.fchmod(fd, mode)
                self._own_ino = os.fstat(fd).st_ino
                if st is not None and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                    os.fchown(fd, st.st_uid, st.st_gid)
            finally:
                os.close(fd)
            os.rename(tmp, self._path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
