"""password: a random secret, generated once, kept across restarts, sent to others.

The password is `length` characters drawn with `secrets` from ASCII letters
and digits (62 symbols, ~5.95 bits each): it needs no quoting in a config
file, a shell, a URL or a connection string. Use it through a send/recv edge:

    edges:
    - from: {kind: password, name: db, send: password}
      to: {kind: file, name: /etc/app/db.pass, recv: content}

It is kept only encrypted, never in plaintext: sealed with a key derived from
the host's private key (`<state>/keys/`), in the file `saved` when given,
else in the resource's private state directory. Both are written atomically
(temp file, fsync, rename) with mode 0600, so a restart sends the same
password again. A copy of the sealed file is useless on another host.

Drift of the saved file is repaired: deleted, the password in memory is
written back; replaced by something that does not open with this host's key
(tampered, or sealed elsewhere), a warning is logged and a new password is
generated: someone else has been writing our secret, so it is rotated. A
refresh (notify edge) generates a new password, as does a change of `length`.

The password is never logged and never part of an error; the value it sends
prints as `'<secret>'` (in the engine's "received" log line, for example).
It is marked secret (`secret_sends`), so whichever resource receives it, the
engine masks it as `********` in that resource's log lines, errors and status;
`kv` stores it sealed, `file` makes it 0600 unless given a `mode`, and a
`meta.reverse` receiver's reversal is kept sealed.
"""

from __future__ import annotations

import os
import string
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

from evergraph._util.atomic import atomic_write
from evergraph.engine.contract import Handle, PathSubscription, Resource, doc, register
from evergraph.resources._oserror import os_error

_ALPHABET = string.ascii_letters + string.digits
_ALPHABET_BYTES = frozenset(_ALPHABET.encode())
#: the sealed file in the state directory when `saved` is not given
_STATE_FILE = "password.sealed"


class Secret(str):
    """A str that does not show itself in a repr (log lines use repr for values)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'<secret>'"


def generate(length: int) -> str:
    import secrets  # lazily: only agents that generate pay for the import

    return "".join(secrets.choice(_ALPHABET) for _ in range(length))


@register("password")
class Password(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A random password (letters and digits), kept encrypted; sends `password`."""

    eager = True  # local syscalls and microseconds of crypto: no task needed

    length: Annotated[int, doc("number of characters, 8 to 4096")] = 64
    saved: Annotated[
        str,
        doc("absolute path of the file keeping it encrypted; empty = the state directory"),
    ] = ""

    sends: ClassVar[dict[str, Any]] = {"password": str}
    #: names of sent values that are secrets (the engine may hide them in logs)
    secret_sends: ClassVar[frozenset[str]] = frozenset({"password"})

    def validate(self) -> None:
        if not 8 <= self.length <= 4096:
            raise self.bad("length", f"{self.length} is not between 8 and 4096")
        if self.saved:
            if not self.saved.startswith("/"):
                raise self.bad("saved", f"{self.saved!r} is not an absolute path")
            if self.saved.endswith("/"):
                raise self.bad("saved", f"{self.saved!r} names a directory, not a file")
            if "\0" in self.saved:
                raise self.bad("saved", "contains a NUL byte")

    def autoedge_wants(self) -> list[list[str]]:
        # a managed directory that will hold the saved file comes first
        if not self.saved:
            return []
        path = os.path.normpath(self.saved)
        parents = []
        end = path.rfind("/")
        while end > 0:
            parents.append(f"dir:{path[:end]}/")
            end = path.rfind("/", 0, end)
        return [[*parents, "dir:/"]]

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._path = os.path.normpath(self.saved) if self.saved else ""
        self._password: str | None = None
        self._sub: PathSubscription | None = None

    def _file(self) -> str:
        if not self._path:  # the state dir is created on first use only
            self._path = str(self.handle.state_dir / _STATE_FILE)
        return self._path

    def subscribe(self) -> Callable[[], None]:
        self._sub = self.handle.watcher.subscribe(self._file(), lambda _mask: self.handle.event())
        return self._unsubscribe

    def _unsubscribe(self) -> None:
        if self._sub is not None:
            self._sub()
            self._sub = None

    def sent(self) -> dict[str, object]:
        return {} if self._password is None else {"password": Secret(self._password)}

    async def check_apply(self, apply: bool) -> bool:
        path = self._file()
        h = self.handle  # reports what happens to the password, never the password
        if h.refresh():
            h.changed("password", "kept", "generated (refresh)")
            if apply:
                self._store(generate(self.length), "refreshed: generated a new password")
            return False
        status, found, mode = self._load(path)
        if status == "missing":
            h.changed("saved", None, path)
            if self._password is not None and len(self._password) == self.length:
                if apply:  # deleted while we run: the one receivers use goes back
                    self._store(self._password, f"{path} was missing: wrote it back")
                return False
            h.changed("password", None, "generated")
            if apply:
                self._store(generate(self.length), f"generated a new password in {path}")
            return False
        if status == "foreign":
            h.changed("password", "does not open with this host's key", "generated")
            if apply:
                self.handle.logger.warning(
                    "%s: %s does not open with this host's key (tampered with, or sealed "
                    "elsewhere): generating a new password",
                    self.ident,
                    path,
                )
                self._store(generate(self.length), f"new password in {path}")
            return False
        if len(found) != self.length:
            h.changed("length", len(found), self.length)
            h.changed("password", "kept", "generated")
            if apply:
                self._store(generate(self.length), f"length is now {self.length}: new password")
            return False
        # The file is the truth: a valid one put back from a backup is adopted.
        self._password = found
        if mode != 0o600:
            h.changed("saved mode", f"{mode:04o}", "0600")
            if apply:
                try:
                    os.chmod(path, 0o600)
                except OSError as e:
                    raise os_error("saved: cannot set mode 0600", e) from None
                self.handle.logger.info("%s: %s mode set to 0600", self.ident, path)
            return False
        return True

    def _load(self, path: str) -> tuple[str, str, int]:
        """(status, password, mode); status: "ok", "missing", or "foreign" (not ours)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return "missing", "", 0
        except OSError as e:
            raise os_error(f"saved: cannot open {path}", e) from None
        try:
            mode = os.fstat(fd).st_mode & 0o7777
            token = b""
            while chunk := os.read(fd, 65536):
                token += chunk
                if len(token) > 65536:
                    return "foreign", "", mode  # far larger than any sealed password
        except OSError as e:
            raise os_error(f"saved: cannot read {path}", e) from None
        finally:
            os.close(fd)
        try:
            plain = self.handle.keys.open_local(token)
        except Exception:
            # keys.KeyError_ (not imported: resources see the engine's contract
            # only). Deliberately without the reason: nothing of the content.
            return "foreign", "", mode
        if not plain or not set(plain) <= _ALPHABET_BYTES:
            return "foreign", "", mode
        return "ok", plain.decode("ascii"), mode

    def _store(self, password: str, what: str) -> None:
        """Seal and write atomically with mode 0600; then it is the one we send."""
        path = self._file()
        token = self.handle.keys.seal_local(password.encode("ascii"))
        directory = os.path.dirname(path) or "/"
        try:
            if not os.path.isdir(directory):
                os.makedirs(directory, mode=0o700, exist_ok=True)
                if self._sub is not None:
                    self._sub.settle()
        except OSError as e:
            raise os_error(f"saved: cannot write in {directory}", e) from None
        try:
            atomic_write(path, token + b"\n", mode=0o600)
        except OSError as e:
            raise os_error(f"saved: cannot write {path}", e) from None
        self._password = password
        self.handle.logger.info("%s: %s", self.ident, what)
