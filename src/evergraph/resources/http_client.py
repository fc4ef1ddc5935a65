"""http:client: a file downloaded from a URL, verified, kept as downloaded.

mgmt's `http:client` names: `url`, `file` (default the name, when that is an
absolute path), `sha256`; and `method`. With `sha256` the file is correct when its
content has that hash: nothing is fetched while it does, and a download with
another hash is a failure that leaves the file as it was. Without it, the file
is kept equal to what was last downloaded with this method from this URL (its
hash is kept in the vertex's state dir); a change on the server is fetched on
a refresh (a notify edge).

`method` is the request whose answer is the file: `GET` (the default), or
`POST` (sent with no body) for a server that hands out content only to a POST.
Any case is accepted. Other methods are refused: HEAD's answer has no body,
and PUT, PATCH, DELETE and the rest ask the server to change something, which
a fetch repeated at every drift must not do.

The download goes to a temporary file in the state dir, is verified, then
put in place atomically with `mode` (else the old file's mode; new: 0644
less the umask) and the old file's owner. Its directory must exist. The file
is watched through the shared inotify hub: a change, removal or mode change
from outside is repaired (a fetch only when the content differs).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable
from typing import Annotated
from urllib.parse import urlsplit

import httpx

from evergraph._util.atomic import atomic_copy, atomic_write, current_umask, sweep_leftovers_of
from evergraph.engine.contract import (
    Handle,
    PathSubscription,
    doc,
    register,
)
from evergraph.errors import ResourceError
from evergraph.resources._archive import file_hash
from evergraph.resources._modes import parse_mode
from evergraph.resources._oserror import os_error
from evergraph.resources._output import OutputFile
from evergraph.resources._owninode import OwnInode

#: the state file: the URL and the hash of the last download
STATE = "download.json"
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
#: seconds to connect, and between two reads of the body
TIMEOUT = 30.0


_NEW_MODE = 0o666 & ~current_umask()


#: the request methods whose answer can be a file (see the module's doc)
METHODS = ("GET", "POST")


@register("http:client")
class HttpClient(OutputFile, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A file downloaded from `url` (GET, or POST), verified by `sha256`, fetched again
    when the file drifts."""

    url: Annotated[str, doc("what to download: an http:// or https:// URL")] = ""
    file: Annotated[str, doc("absolute path of the file; default the name (an absolute path)")] = ""
    sha256: Annotated[
        str, doc("the content's SHA-256 (hex); empty = keep what was last downloaded")
    ] = ""
    mode: Annotated[
        str | None, doc("permissions, octal `'0644'` or symbolic; unset = kept (new: 0644)")
    ] = None
    method: Annotated[
        str,
        doc(
            "the request whose answer is the file: `GET`, or `POST` (sent with no body); "
            "others are refused (HEAD has no body, PUT or DELETE change the server)"
        ),
    ] = "GET"

    def _out(self) -> str:
        return os.path.normpath(self.file or self.name)

    def validate(self) -> None:
        path = self.file or (self.name if self.name.startswith("/") else "")
        if not path:
            raise self.bad("file", "is empty: give the path to write (or name the resource by it)")
        if not path.startswith("/") or path.endswith("/") or "\0" in path:
            raise self.bad("file", f"{path!r} is not an absolute file path")
        try:
            parts = urlsplit(self.url)
        except ValueError as e:
            raise self.bad("url", f"{self.url!r}: {e}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            what = "is empty" if not self.url else f"{self.url!r} is not an http(s):// URL"
            raise self.bad("url", f"{what}: give the URL to download")
        if self.method.upper() not in METHODS:
            why = (
                "a HEAD answer has no body to keep"
                if self.method.upper() == "HEAD"
                else "the request whose answer is the file"
            )
            raise self.bad("method", f"{self.method!r} is not GET or POST: {why}")
        if self.sha256 and not _SHA256.fullmatch(self.sha256):
            raise self.bad("sha256", f"{self.sha256!r} is not 64 hexadecimal digits")
        if self.mode is not None:
            try:
                parse_mode(self.mode)
            except ValueError as e:
                raise self.bad("mode", str(e)) from None

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._target = self._out()
        self._mode = parse_mode(self.mode) if self.mode is not None else None
        self._want = self.sha256.lower()
        self._method = self.method.upper()
        self._own = OwnInode()
        self._sub: PathSubscription | None = None
        for left in sweep_leftovers_of(self._target):
            handle.logger.info("%s: removed %s (an interrupted write's)", self.ident, left)

    def subscribe(self) -> Callable[[], None]:
        self._sub = self.handle.watcher.subscribe(self._target, self._output_changed)
        return self._unsubscribe

    def _unsubscribe(self) -> None:
        if self._sub is not None:
            self._sub()
            self._sub = None

    # -- state --------------------------------------------------------------------
    def _state_file(self) -> str:
        return str(self.handle.state_dir / STATE)

    def _last(self) -> str | None:
        """The hash of the last download of this URL (None: none recorded)."""
        try:
            with open(self._state_file(), "rb") as f:
                data = json.loads(f.read())
        except (OSError, ValueError):
            return None
        # (a record from before `method` existed is a GET's)
        if (
            isinstance(data, dict)
            and data.get("url") == self.url
            and data.get("method", "GET") == self._method
        ):
            digest = data.get("sha256")
            return digest if isinstance(digest, str) else None
        return None

    def _record(self, digest: str) -> None:
        record = {"url": self.url, "method": self._method, "sha256": digest}
        atomic_write(self._state_file(), json.dumps(record).encode())

    # -- check and apply --------------------------------------------------------
    async def check_apply(self, apply: bool) -> bool:
        try:
            st: os.stat_result | None = os.lstat(self._target)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise ResourceError(f"{self._target}: not a regular file")
        have = file_hash(self._target) if st is not None else None
        want = self._want or self._last()
        # a refresh fetches again what no hash pins (the server may have changed it)
        fetch = have is None or have != want or (not self._want and self.handle.refresh())
        if not fetch:
            return self._check_mode(st, apply)
        if not apply:
            self.handle.changed("content", _short(have), _short(want) if want else self.url)
            return False
        tmp, got = await self._download()
        try:
            if self._want and got != self._want:
                raise ResourceError(
                    f"{self.url}: the download's sha256 is {got}, not {self._want}: "
                    f"{self._target} left as it was"
                )
            if got == have:  # the same content: only the record was missing
                self._record(got)
                return self._check_mode(st, apply)
            if st is None:
                self.handle.changed("file", None, "file")
            self.handle.changed("content", _short(have), _short(got))
            self._place(tmp, st)
            self._record(got)
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _check_mode(self, st: os.stat_result | None, apply: bool) -> bool:
        if st is None or self._mode is None or stat.S_IMODE(st.st_mode) == self._mode:
            return True
        self.handle.changed("mode", f"{stat.S_IMODE(st.st_mode):04o}", f"{self._mode:04o}")
        if apply:
            try:
                os.chmod(self._target, self._mode)
            except OSError as e:
                raise os_error(self._target, e) from None
        return False

    async def _download(self) -> tuple[str, str]:
        """Fetch the URL into a temporary file in the state dir: (its path, its sha256)."""
        fd, tmp = tempfile.mkstemp(prefix=".download.", suffix=".tmp", dir=self.handle.state_dir)
        h = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out:
                timeout = httpx.Timeout(TIMEOUT)
                async with (
                    httpx.AsyncClient(follow_redirects=True, timeout=timeout) as client,
                    client.stream(self._method, self.url) as r,
                ):
                    if r.status_code >= 400:
                        raise ResourceError(
                            f"{self._method} {self.url}: {r.status_code} {r.reason_phrase}"
                        )
                    async for chunk in r.aiter_bytes():
                        h.update(chunk)
                        out.write(chunk)
        except httpx.HTTPError as e:
            os.unlink(tmp)
            raise ResourceError(
                f"{self._method} {self.url}: {str(e) or type(e).__name__}"
            ) from None
        except BaseException:
            os.unlink(tmp)
            raise
        return tmp, h.hexdigest()

    def _place(self, tmp: str, st: os.stat_result | None) -> None:
        parent = os.path.dirname(self._target) or "/"
        if not os.path.isdir(parent):
            raise ResourceError(f"{self._target}: directory {parent} does not exist")
        if self._mode is not None:
            mode = self._mode
        else:
            mode = stat.S_IMODE(st.st_mode) if st is not None else _NEW_MODE
        owner = (st.st_uid, st.st_gid) if st is not None else None
        try:
            atomic_copy(tmp, self._target, mode=mode, owner=owner, before_rename=self._own.note)
        except OSError as e:
            raise os_error(self._target, e) from None


def _short(digest: str | None) -> str | None:
    return None if digest is None else f"sha256 {digest[:16]}"
