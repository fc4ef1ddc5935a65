"""line: a line (or a block of lines) present in, or absent from, a file.

mgmt's `line`: `file`, `content`, `state`. With `state: exists` the file
holds `content` as whole consecutive lines somewhere (appended at the end
when missing, after a newline if the file lacked its last one; a missing file
is created, 0644 less the umask, its directory must exist). With `absent`
every occurrence is removed. Every other byte of the file is kept as it is.

Writes are atomic (a temporary file beside it, renamed over it) and keep the
file's mode and owner. A symbolic link is followed: the file it points to is
edited, the link stays. The watch is the engine's shared inotify on the
file's directory.

A line manages a part of the file: many lines may share one file, but a
`file` resource that manages the same file's content (or removes it) would
fight them, a load error naming both; a `file` with only mode or owner is
fine (it runs first, by an automatic edge).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from typing import Annotated, Literal

from evergraph._util.atomic import atomic_write, current_umask, sweep_leftovers_of
from evergraph.engine.contract import (
    Handle,
    PathSubscription,
    Resource,
    doc,
    parent_dir_keys,
    register,
)
from evergraph.errors import ResourceError
from evergraph.resources._oserror import os_error
from evergraph.resources._owninode import OwnInode

_NEW_MODE = 0o666 & ~current_umask()


@register("line")
class Line(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A line (or block of lines) in a file, kept present or absent; the rest of the
    file is left byte for byte."""

    eager = True

    file: Annotated[str, doc("absolute path of the file")] = ""
    content: Annotated[
        str, doc("the line; with newlines a block of consecutive lines (one final newline is cut)")
    ] = ""
    state: Annotated[
        Literal["exists", "absent"],
        doc("`exists` appends it when missing; `absent` removes every occurrence"),
    ] = "exists"

    def validate(self) -> None:
        if not self.file.startswith("/"):
            what = "is empty" if not self.file else f"{self.file!r} is not an absolute path"
            raise self.bad("file", f"{what}: give the file's absolute path")
        if self.file.endswith("/") or "\0" in self.file:
            raise self.bad("file", f"{self.file!r} is not a file path")
        if not self._lines():
            raise self.bad("content", "is empty: give the line to keep or remove")
        if "\0" in self.content:
            raise self.bad("content", "contains a NUL byte")

    def _lines(self) -> list[bytes]:
        text = self.content[:-1] if self.content.endswith("\n") else self.content
        return text.encode().split(b"\n") if text else []

    def _norm(self) -> str:
        return os.path.normpath(self.file)

    def claims(self) -> list[str]:
        return [f"line:{self._norm()}:{self.content}"]

    def claims_part(self) -> list[str]:
        return [f"content:{self._norm()}"]

    def autoedge_wants(self) -> Iterator[Iterator[str]]:
        norm = self._norm()
        yield parent_dir_keys(norm)
        yield iter((f"path:{norm}",))  # a file resource that makes it (mode, owner)
        yield iter((f"pkgfile:{norm}",))  # the package that installs it

    def reversal(self) -> Line | None:
        """The opposite state when this one is not there yet (removed lines come back
        at the end of the file)."""
        try:
            _st, data = _load(os.path.realpath(self._norm()), self.file)
        except ResourceError:
            return None  # not a file we can edit: nothing to restore
        found = _find(data, self._lines()) > 0
        if found == (self.state == "exists"):
            return None  # already as wanted: nothing to undo
        state: Literal["exists", "absent"] = "exists" if found else "absent"
        return Line(name=self.name, file=self.file, content=self.content, state=state)

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._path = self._norm()
        self._block = self._lines()
        self._own = OwnInode()
        self._watches: dict[str, PathSubscription] = {}
        for left in sweep_leftovers_of(self._path):
            handle.logger.info("%s: removed %s (an interrupted write's)", self.ident, left)

    def subscribe(self) -> Callable[[], None]:
        self._watch(self._path)
        return self._unsubscribe

    def _watch(self, path: str) -> None:
        if path not in self._watches:
            self._watches[path] = self.handle.watcher.subscribe(path, self._changed)

    def _unsubscribe(self) -> None:
        for sub in self._watches.values():
            sub()
        self._watches.clear()

    def _changed(self, mask: int) -> None:
        if not self._own.renamed_in(mask, self._path, follow=True):  # (ours: nothing to repair)
            self.handle.event()

    async def check_apply(self, apply: bool) -> bool:
        # All in one go, without awaiting: lines sharing a file never interleave.
        target = os.path.realpath(self._path)
        if target != self._path and self._watches:
            self._watch(target)  # a link: its target's directory is watched too
        st, data = _load(target, self._path)
        count = _find(data, self._block)
        if self.state == "exists":
            if count:
                return True
            if st is None:
                self.handle.changed("file", None, "file")
            self.handle.changed("line", None, self.content)
            new = data + (b"\n" if data and not data.endswith(b"\n") else b"")
            new += b"\n".join(self._block) + b"\n"
        else:
            if not count:
                return True
            self.handle.changed("line", self.content if count == 1 else f"{count} times", None)
            new = _remove(data, self._block)
        if not apply:
            return False
        parent = os.path.dirname(target)
        if not os.path.isdir(parent):
            raise ResourceError(f"{self._path}: directory {parent} does not exist")
        mode = stat.S_IMODE(st.st_mode) if st is not None else _NEW_MODE
        owner = (st.st_uid, st.st_gid) if st is not None else None
        try:
            atomic_write(target, new, mode=mode, owner=owner, before_rename=self._own.note)
        except OSError as e:
            raise os_error(self._path, e) from None
        return False


def _load(path: str, shown: str) -> tuple[os.stat_result | None, bytes]:
    """The file's status and content (None, b"": it does not exist). Opened without
    blocking (a FIFO in its place is refused, not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, b""
    except OSError as e:
        raise os_error(shown, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ResourceError(f"{shown}: not a regular file")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return st, b"".join(chunks)
    except OSError as e:
        raise os_error(shown, e) from None
    finally:
        os.close(fd)


def _pieces(data: bytes) -> list[bytes]:
    """The file's lines, each with its newline (a last line may have none)."""
    out, start = [], 0
    while start < len(data):
        end = data.find(b"\n", start)
        if end < 0:
            out.append(data[start:])
            break
        out.append(data[start : end + 1])
        start = end + 1
    return out


def _body(piece: bytes) -> bytes:
    return piece[:-1] if piece.endswith(b"\n") else piece


def _matches(pieces: list[bytes], i: int, block: list[bytes]) -> bool:
    return i + len(block) <= len(pieces) and all(
        _body(pieces[i + k]) == line for k, line in enumerate(block)
    )


def _find(data: bytes, block: list[bytes]) -> int:
    """How many times `block` occurs as whole consecutive lines of `data`."""
    if not block or block[0] not in data:
        return 0
    pieces = _pieces(data)
    i, count = 0, 0
    while i < len(pieces):
        if _matches(pieces, i, block):
            count += 1
            i += len(block)
        else:
            i += 1
    return count


def _remove(data: bytes, block: list[bytes]) -> bytes:
    """`data` without any occurrence of `block`; every other line byte for byte."""
    pieces = _pieces(data)
    kept: list[bytes] = []
    i = 0
    while i < len(pieces):
        if _matches(pieces, i, block):
            i += len(block)
        else:
            kept.append(pieces[i])
            i += 1
    return b"".join(kept)
