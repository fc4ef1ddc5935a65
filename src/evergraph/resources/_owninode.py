"""The own-inode filter, shared by every kind that writes a whole file atomically
and watches it (file, line, tar, gzip, http:client): its own write, renamed into
place, raises the watch's MOVED_TO like anyone else's. The write notes the new
file's inode just before the rename (atomic's `before_rename`); the watch skips a
MOVED_TO that brought exactly that inode. Any other writer's rename brings another
inode, and in-place writes raise other events, which are never skipped."""

from __future__ import annotations

import os

from evergraph.engine.contract import MOVED_TO


class OwnInode:
    """The inode of our last atomic write, until its rename is seen."""

    __slots__ = ("ino",)

    def __init__(self) -> None:
        self.ino = 0

    def note(self, fd: int) -> None:
        """`before_rename` of an atomic write (it may run in the committer's thread:
        the watch's MOVED_TO is read in the loop after the rename, so it sees it)."""
        self.ino = os.fstat(fd).st_ino

    def renamed_in(self, mask: int, path: str, *, follow: bool = False) -> bool:
        """True when this watch event on `path` is our own write renamed into place
        (told once: the next event is judged on its own). `follow`: `path` may be a
        symlink to the file written."""
        if not (mask & MOVED_TO and self.ino):
            return False
        own, self.ino = self.ino, 0
        try:
            return (os.stat if follow else os.lstat)(path).st_ino == own
        except OSError:
            return False
