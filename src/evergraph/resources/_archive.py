"""What `tar` and `gzip` share: an output file built from inputs.

Checked by hashes, as mgmt does: the vertex's state dir keeps the digest of
the inputs (names, types, modes, contents, and the parameters that shape the
output) and the SHA-256 of the output written from them. The output is clean
when both still match; otherwise it is built again, into a temporary file in
the state dir, and compared with what is there: the same bytes (the state was
lost, or an input changed back) are recorded, not written. Outputs are
deterministic (no times, no owners in them), so the same inputs give the
same bytes.

A new output is written atomically (the one helper, `atomic_copy`), keeping
the mode and owner of the file it replaces (a new one: 0644 less the umask).
Hashing and building run in a thread: a large input never stalls the agent.
The output and the inputs are watched through the shared inotify hub
(directories: every directory of the tree).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from typing import IO, Annotated

from evergraph._util.atomic import atomic_copy, atomic_write, current_umask, sweep_leftovers_of
from evergraph.engine.contract import (
    Handle,
    PathSubscription,
    Resource,
    doc,
)
from evergraph.errors import ResourceError
from evergraph.resources._oserror import os_error
from evergraph.resources._output import OutputFile
from evergraph.resources._owninode import OwnInode

#: the state file holding the input digest and the output hash
STATE = "archive.json"
_CHUNK = 1 << 20


_NEW_MODE = 0o666 & ~current_umask()


def file_hash(path: str, shown: str = "") -> str | None:
    """The SHA-256 of a file's content (hex); None: it does not exist."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise os_error(shown or path, e) from None
    return h.hexdigest()


def check_path(res: Resource, field: str, path: str) -> None:
    """An absolute file path (no trailing slash, no NUL), or an InputError."""
    if not path.startswith("/"):
        raise res.bad(field, f"{path!r} is not an absolute path" if path else "is empty")
    if path.endswith("/") or "\0" in path:
        raise res.bad(field, f"{path!r} is not a file path")


def _describe(digest: str | None, size: int) -> str | None:
    return None if digest is None else f"{size} bytes, sha256 {digest[:16]}"


class Archive(OutputFile, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Base of the kinds whose output file is built from inputs (not a kind)."""

    path: Annotated[str, doc("absolute path of the output file; default the name")] = ""

    # -- what a kind provides ------------------------------------------------
    def input_digest(self) -> str:
        """The digest of everything the output is made from (runs in a thread)."""
        raise NotImplementedError

    def build(self, out: IO[bytes]) -> None:
        """Write the output to `out` (runs in a thread)."""
        raise NotImplementedError

    def input_paths(self) -> Iterable[tuple[str, bool]]:
        """The inputs to watch: (path, is_tree) pairs."""
        return ()

    # -- contract ---------------------------------------------------------------
    def _out(self) -> str:
        return os.path.normpath(self.path or self.name)

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._target = self._out()
        self._own = OwnInode()
        self._subs: dict[str, PathSubscription] = {}
        for left in sweep_leftovers_of(self._target):
            handle.logger.info("%s: removed %s (an interrupted write's)", self.ident, left)

    def subscribe(self) -> Callable[[], None]:
        self._subs[self._target] = self.handle.watcher.subscribe(self._target, self._output_changed)
        self._rewatch()
        return self._unsubscribe

    def _unsubscribe(self) -> None:
        for sub in self._subs.values():
            sub()
        self._subs.clear()

    def _rewatch(self) -> bool:
        """Watch each input, and every directory of an input tree (again after each
        check: new directories get a watch, vanished ones lose theirs). True if a
        watch was added: what changed in it before it was armed was not seen."""
        if not self._subs:
            return False  # not watching (meta.poll, or before subscribe)
        want: dict[str, bool] = {}  # key -> listing
        for path, tree in self.input_paths():
            want[path] = False
            if tree and os.path.isdir(path):
                for d, dirs, _files in os.walk(path):
                    want[f"{d.rstrip('/')}/"] = True
                    dirs.sort()
        watcher = self.handle.watcher
        for key in [k for k in self._subs if k != self._target and k not in want]:
            self._subs.pop(key)()
        added = False
        for key, listing in want.items():
            if key not in self._subs:
                hub = watcher.subscribe_dir if listing else watcher.subscribe
                self._subs[key] = hub(key, self._input_changed)
                added = True
        return added

    def _input_changed(self, mask: int) -> None:
        self.handle.event()

    # -- check and apply --------------------------------------------------------
    def _state_file(self) -> str:
        return str(self.handle.state_dir / STATE)

    def _stored(self) -> dict[str, str]:
        try:
            with open(self._state_file(), "rb") as f:
                data = json.loads(f.read())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _store(self, inputs: str, output: str) -> None:
        record = json.dumps({"input": inputs, "output": output}).encode()
        atomic_write(self._state_file(), record)

    async def check_apply(self, apply: bool) -> bool:
        try:
            return await self._check_apply(apply)
        finally:
            if self._rewatch():
                # a new directory's files may have changed between our read and its
                # watch: look again (cheap when nothing did: the hashes compare)
                self.handle.event()

    async def _check_apply(self, apply: bool) -> bool:
        inputs, have = await asyncio.to_thread(self._examine)
        stored = self._stored()
        if have is not None and stored == {"input": inputs, "output": have}:
            return True
        tmp = await asyncio.to_thread(self._build_temp)
        try:
            built = file_hash(tmp) or ""
            if built == have:  # the same bytes: only the record was missing
                self._store(inputs, built)
                return True
            try:
                old_size = os.lstat(self._target).st_size if have is not None else 0
            except OSError:
                old_size = 0
            if have is None:
                self.handle.changed("file", None, "file")
            new = _describe(built, os.path.getsize(tmp))
            self.handle.changed("content", _describe(have, old_size), new)
            if not apply:
                return False
            await asyncio.to_thread(self._place, tmp)
            self._store(inputs, built)
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _examine(self) -> tuple[str, str | None]:
        try:
            st = os.lstat(self._target)
        except FileNotFoundError:
            return self.input_digest(), None
        if not stat.S_ISREG(st.st_mode):
            raise ResourceError(f"{self._target}: not a regular file")
        return self.input_digest(), file_hash(self._target)

    def _build_temp(self) -> str:
        # .<name>.tmp in the state dir: swept at start if a kill leaves it
        fd, tmp = tempfile.mkstemp(prefix=".build.", suffix=".tmp", dir=self.handle.state_dir)
        try:
            with os.fdopen(fd, "wb") as out:
                self.build(out)
        except BaseException:
            os.unlink(tmp)
            raise
        return tmp

    def _place(self, tmp: str) -> None:
        parent = os.path.dirname(self._target) or "/"
        if not os.path.isdir(parent):
            raise ResourceError(f"{self._target}: directory {parent} does not exist")
        try:
            st: os.stat_result | None = os.lstat(self._target)
        except FileNotFoundError:
            st = None
        mode = stat.S_IMODE(st.st_mode) if st is not None else _NEW_MODE
        owner = (st.st_uid, st.st_gid) if st is not None else None
        try:
            atomic_copy(tmp, self._target, mode=mode, owner=owner, before_rename=self._own.note)
        except OSError as e:
            raise os_error(self._target, e) from None
