"""ssh_authorized_key: one public key line in an authorized_keys file.

A key is identified by its type and base64 blob: the file holds exactly one
line with them (options and comment as declared; duplicates are removed), and
every other line — other keys, comments, blank lines — is kept byte for byte.

With `user`, the file is ~user/.ssh/authorized_keys (home from /etc/passwd):
`.ssh` is kept 0700 and the file 0600, both owned by the user, as sshd's
StrictModes wants. The user owns that directory, so everything there is done
through directory descriptors with O_NOFOLLOW and written by temp file +
rename: a symlink or hard link planted by the user cannot make root read or
overwrite another file.

Writes are atomic (temp file in the same directory, fsync, rename, fsync of
the directory). Several resources may share one file and apply concurrently:
each read-modify-write runs under a lock per file and re-reads it inside.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import errno
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

from evergraph._util.atomic import atomic_write
from evergraph.engine.contract import PathSubscription, Resource, doc, parent_dir_keys, register
from evergraph.errors import ResourceError
from evergraph.resources._locks import Locks
from evergraph.resources._oserror import os_error

PASSWD = "/etc/passwd"
#: seconds to wait for a missing user (or home) that may be being made right now
MISSING_GRACE = 2.0

_BASE_TYPES = (
    "ssh-ed25519",
    "ssh-rsa",
    "ssh-dss",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
)


def _cert(t: str) -> str:
    base, at, domain = t.partition("@")
    return f"{base}-cert-v01@{domain if at else 'openssh.com'}"


#: what OpenSSH accepts in authorized_keys: plain keys and their certificates
KEY_TYPES = frozenset((*_BASE_TYPES, *map(_cert, _BASE_TYPES)))

# an option is `name` or `name="value"` (a `"` inside the value is escaped as \")
_OPTION = re.compile(r'[A-Za-z0-9-]+(="(?:[^"\\\r\n]|\\.)*")?')
# shadow-utils' rule for login names
_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*\$?")

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW_DIR = _DIR | os.O_NOFOLLOW
# NONBLOCK: a FIFO planted in place of the file must not hang the open
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _ssh_string(blob: bytes, off: int) -> tuple[bytes, int] | None:
    """One RFC 4251 `string` (uint32 length + bytes) at `off`, and the offset after it."""
    if off + 4 > len(blob):
        return None
    n = int.from_bytes(blob[off : off + 4], "big")
    end = off + 4 + n
    return (blob[off + 4 : end], end) if end <= len(blob) else None


def _tokens(line: str, count: int) -> list[str]:
    """The first `count` whitespace-separated fields; double quotes keep spaces."""
    out: list[str] = []
    i, n = 0, len(line)
    while len(out) < count:
        while i < n and line[i] in " \t":
            i += 1
        if i >= n:
            break
        start, quoted = i, False
        while i < n and (quoted or line[i] not in " \t\r\n"):
            if line[i] == "\\" and quoted:
                i += 1
            elif line[i] == '"':
                quoted = not quoted
            i += 1
        out.append(line[start:i])
    return out


def _split_options(text: str) -> list[str]:
    """`a,b="x,y"` -> ['a', 'b="x,y"'] (commas inside quotes do not split)."""
    out: list[str] = []
    start, quoted, i = 0, False, 0
    while i < len(text):
        c = text[i]
        if c == "\\" and quoted:
            i += 1
        elif c == '"':
            quoted = not quoted
        elif c == "," and not quoted:
            out.append(text[start:i])
            start = i + 1
        i += 1
    out.append(text[start:])
    return [o for o in out if o]


class _NoHome(ResourceError):
    """The user, or its home directory, does not exist (yet)."""


@dataclass(frozen=True, slots=True)
class _Target:
    dir: str  # the directory holding the file
    name: str  # the file's name in it
    home: str = ""  # user mode: the home directory that holds `.ssh`
    uid: int = -1  # user mode: owner of .ssh and the file
    gid: int = -1

    @property
    def path(self) -> str:
        return f"{self.dir}/{self.name}"


@dataclass(slots=True)
class _Seen:
    """What is on disk now."""

    dir_fd: int | None  # None: the directory does not exist
    dir_ok: bool  # user mode: .ssh has mode 0700 and the user's ownership
    data: bytes | None  # None: the file does not exist
    st: os.stat_result | None

    def close(self) -> None:
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None


def _lookup_user(name: str) -> tuple[int, int, str] | None:
    """(uid, gid, home) from /etc/passwd; read directly, as the user kind does."""
    try:
        with open(PASSWD, "rb") as f:
            data = f.read().decode("utf-8", "surrogateescape")
    except FileNotFoundError:
        return None
    for line in data.splitlines():
        p = line.split(":")
        if len(p) >= 7 and p[0] == name:
            try:
                return int(p[2]), int(p[3]), p[5]
            except ValueError:
                return None
    return None


@register("ssh_authorized_key")
class SshAuthorizedKey(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A public key line in an authorized_keys file (of a path, or of a user)."""

    eager = True  # a clean check is a read; writes go to a thread

    file: Annotated[str, doc("absolute path of the authorized_keys file (or give `user`)")] = ""
    user: Annotated[
        str, doc("manage ~user/.ssh/authorized_keys, owned by the user (or give `file`)")
    ] = ""
    type: Annotated[str, doc("key type, e.g. `ssh-ed25519`, `ssh-rsa`, `ecdsa-sha2-nistp256`")] = ""
    key: Annotated[str, doc("the base64 key blob (second field of a .pub file)")] = ""
    options: Annotated[
        list[str], doc('sshd options, e.g. `["no-pty", "command=\\"/bin/true\\""]`')
    ] = []
    comment: Annotated[str, doc("text after the key (often user@host)")] = ""
    state: Annotated[
        Literal["exists", "absent"], doc("`exists` keeps the line there; `absent` removes it")
    ] = "exists"

    # -- contract -----------------------------------------------------------
    def validate(self) -> None:
        if bool(self.file) == bool(self.user):
            if self.file:
                raise self.bad("user", "cannot be used with file: give one of them")
            raise self.bad("file", "is empty: give `file` (a path) or `user`")
        if self.file:
            if not self.file.startswith("/"):
                raise self.bad("file", f"{self.file!r} is not an absolute path")
            if self.file.endswith("/") or "\0" in self.file:
                raise self.bad("file", f"{self.file!r} is not a file path")
        elif len(self.user) > 32 or not _USER.fullmatch(self.user) or self.user.isdigit():
            raise self.bad("user", f"{self.user!r} is not a valid user name")
        if self.type not in KEY_TYPES:
            known = ", ".join(_BASE_TYPES)
            raise self.bad("type", f"{self.type!r} is not a key type ({known}, or a -cert-v01)")
        self._check_key()
        for opt in self.options:
            if not _OPTION.fullmatch(opt):
                raise self.bad(
                    "options", f'{opt!r} is not `name` or `name="value"` (escape " as \\")'
                )
        if any(c in self.comment for c in "\r\n\0"):
            raise self.bad("comment", "contains a line break or NUL")

    def _check_key(self) -> None:
        if not self.key:
            raise self.bad("key", "is empty: give the base64 blob of the public key")
        if any(c.isspace() for c in self.key):
            raise self.bad("key", "contains whitespace: give only the base64 blob")
        if not self.key.isascii():
            raise self.bad("key", "is not valid base64: it holds non-ASCII characters")
        try:
            blob = base64.b64decode(self.key, validate=True)
        except binascii.Error as e:
            raise self.bad("key", f"is not valid base64: {e}") from None
        first = _ssh_string(blob, 0)
        if first is None or not first[0]:
            raise self.bad("key", "does not hold an SSH public key (no type string inside)")
        embedded = first[0].decode("ascii", "replace")
        if embedded != self.type:
            raise self.bad("type", f"is {self.type!r} but the key is of type {embedded!r}")
        if self.type == "ssh-ed25519":
            point = _ssh_string(blob, first[1])
            if point is None or len(point[0]) != 32 or point[1] != len(blob):
                raise self.bad("key", "is not an ssh-ed25519 public key (32 bytes)")

    def autoedge_wants(self) -> Iterator[Iterator[str]]:
        if self.user:
            yield iter((f"user:{self.user}",))  # the account (and its home) first
        else:
            yield parent_dir_keys(os.path.normpath(self.file))

    def reversal(self) -> SshAuthorizedKey:
        """Absent if our key is not in the file now; else its line as it is."""
        absent = SshAuthorizedKey(
            name=self.name,
            file=self.file,
            user=self.user,
            type=self.type,
            key=self.key,
            state="absent",
        )
        try:
            target = self._target()
            seen = self._look(target) if target is not None else None
        except (ResourceError, OSError):
            return absent
        if seen is None:
            return absent
        seen.close()
        for line in (seen.data or b"").decode("utf-8", "surrogateescape").splitlines():
            fields = self._match(line)
            if fields is not None:
                opts, comment = fields
                return SshAuthorizedKey(
                    name=self.name,
                    file=self.file,
                    user=self.user,
                    type=self.type,
                    key=self.key,
                    options=opts,
                    comment=comment,
                )
        return absent

    # -- watch --------------------------------------------------------------------
    def subscribe(self) -> Callable[[], None]:
        self._subs: list[PathSubscription] = []
        self._watched: tuple[str, ...] = ()
        self._rewatch()
        passwd = self.handle.watcher.subscribe(PASSWD, self._passwd_changed) if self.user else None

        def unsubscribe() -> None:
            if passwd is not None:
                passwd()
            for s in self._subs:
                s()
            self._subs = []

        return unsubscribe

    def _rewatch(self) -> None:
        """Watch the file (and in user mode `.ssh` itself: its mode and owner matter)."""
        target = self._target()
        paths: tuple[str, ...] = ()
        if target is not None:
            paths = (target.path, target.dir) if target.home else (target.path,)
        if paths == self._watched:
            return
        for s in self._subs:
            s()
        self._subs = [self.handle.watcher.subscribe(p, self._changed) for p in paths]
        self._watched = paths

    def _passwd_changed(self, _mask: int) -> None:
        self._rewatch()  # the user may have appeared or moved home
        self.handle.event()

    def _changed(self, _mask: int) -> None:
        self.handle.event()

    # -- check and apply ------------------------------------------------------------
    async def check_apply(self, apply: bool) -> bool:
        deadline: float | None = None
        while True:
            try:
                return await self._check_apply(apply)
            except _NoHome as e:
                if self.state == "absent":
                    return True  # no such user (or home): no key of theirs to remove
                if not apply:
                    return False
                # A user resource may be (re-)making the account right now, and
                # useradd writes /etc/passwd before the home: wait a moment.
                loop = asyncio.get_running_loop()
                deadline = deadline or loop.time() + MISSING_GRACE
                if not await self._user_appears(deadline - loop.time()):
                    raise ResourceError(str(e)) from None

    async def _check_apply(self, apply: bool) -> bool:
        target = self._target()
        if target is None:
            raise _NoHome(f"no such user {self.user!r}")
        seen = self._look(target)
        had_dir = seen.dir_fd is not None
        seen.close()
        plan = self._plan(target, seen)
        if plan is None:
            return True
        self._report(target, seen, had_dir, plan[0])
        if not apply:
            return False
        # per file, the agent's: the lock around read-modify-write
        async with self.handle.services.get(Locks).lock(f"authorized_keys:{target.path}"):
            # re-read inside the lock: a sibling resource may have written since
            return await asyncio.to_thread(self._fix, target)

    async def _user_appears(self, timeout: float) -> bool:
        """Wait until the user and its home exist; False after `timeout` seconds."""
        # (no asyncio.timeout: an eager check_apply may be running outside a task)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        changed = asyncio.Event()
        subs: dict[str, Callable[[], None]] = {}
        try:
            while True:
                target = self._target()
                for p in (PASSWD, *((target.home,) if target else ())):
                    if p not in subs:
                        subs[p] = self.handle.watcher.subscribe(p, lambda _m: changed.set())
                target = self._target()  # looked at after subscribing: no change slips by
                if target is not None and os.path.isdir(target.home):
                    return True
                try:
                    await asyncio.wait_for(changed.wait(), deadline - loop.time())
                except TimeoutError:
                    return False
                changed.clear()
        finally:
            for unsubscribe in subs.values():
                unsubscribe()

    def _target(self) -> _Target | None:
        if self.file:
            path = os.path.normpath(self.file)
            d, _, name = path.rpartition("/")
            return _Target(d or "/", name)
        found = _lookup_user(self.user)
        if found is None:
            return None
        uid, gid, home = found
        home = os.path.normpath(home) if home.startswith("/") else home
        return _Target(f"{home.rstrip('/')}/.ssh", "authorized_keys", home, uid, gid)

    def _look(self, t: _Target) -> _Seen:
        """Open the directory (no symlinks in user mode) and read the file."""
        try:
            if t.home:
                try:
                    home_fd = os.open(t.home, _DIR)
                except FileNotFoundError:
                    raise _NoHome(
                        f"home directory {t.home} of user {self.user!r} does not exist"
                    ) from None
                try:
                    dir_fd = os.open(".ssh", _NOFOLLOW_DIR, dir_fd=home_fd)
                finally:
                    os.close(home_fd)
            else:
                dir_fd = os.open(t.dir, _DIR)
        except FileNotFoundError:
            return _Seen(None, False, None, None)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ResourceError(f"{t.dir} is not a directory (a symlink?)") from None
            raise os_error(t.dir, e) from None
        seen = _Seen(dir_fd, True, None, None)
        try:
            if t.home:
                st = os.fstat(dir_fd)
                seen.dir_ok = stat.S_IMODE(st.st_mode) == 0o700 and (st.st_uid, st.st_gid) == (
                    t.uid,
                    t.gid,
                )
            seen.data, seen.st = self._read(t, dir_fd)
        except BaseException:
            seen.close()
            raise
        return seen

    def _read(self, t: _Target, dir_fd: int) -> tuple[bytes | None, os.stat_result | None]:
        try:
            fd = os.open(t.name, _READ, dir_fd=dir_fd)
        except FileNotFoundError:
            return None, None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ResourceError(f"{t.path} is a symlink: refusing to follow it") from None
            raise os_error(t.path, e) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ResourceError(f"{t.path} is not a regular file")
            if t.home and st.st_nlink > 1:
                raise ResourceError(f"{t.path} has other hard links: refusing to use it")
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
            return b"".join(chunks), st
        finally:
            os.close(fd)

    def _plan(self, t: _Target, seen: _Seen) -> tuple[bytes, bool] | None:
        """None if all is as declared; else (the file's new content, whether to write it)."""
        if self.state == "absent" and seen.data is None:
            return None
        new = self._rewrite(seen.data or b"")
        content_ok = seen.data is not None and new is None
        st, file_meta_ok, dir_ok = seen.st, True, True
        if t.home and self.state == "exists":
            # sshd's StrictModes: only the user may write them
            dir_ok = seen.dir_ok
            file_meta_ok = (
                st is not None
                and stat.S_IMODE(st.st_mode) == 0o600
                and (st.st_uid, st.st_gid) == (t.uid, t.gid)
            )
        if content_ok and file_meta_ok and dir_ok:
            return None
        return (seen.data or b"") if new is None else new, not (content_ok and file_meta_ok)

    def _report(self, t: _Target, seen: _Seen, had_dir: bool, content: bytes) -> None:
        """Report what differs: the directory, the file's content (a diff), its mode and
        owner (user mode: sshd's StrictModes)."""
        h = self.handle
        if not had_dir:
            h.changed("directory", None, t.dir)
        elif t.home and self.state == "exists" and not seen.dir_ok:
            h.changed("directory", f"{t.dir}: not 0700 or not the user's", f"0700, {t.uid}:{t.gid}")
        if seen.data is None or content != seen.data:
            h.changed("content", seen.data, content, content=True)
        st = seen.st
        if t.home and self.state == "exists" and st is not None:
            if stat.S_IMODE(st.st_mode) != 0o600:
                h.changed("mode", f"{stat.S_IMODE(st.st_mode):04o}", "0600")
            if (st.st_uid, st.st_gid) != (t.uid, t.gid):
                h.changed("owner", f"{st.st_uid}:{st.st_gid}", f"{t.uid}:{t.gid}")

    def _fix(self, t: _Target) -> bool:
        """Under the file's lock, in a thread: re-read and make it right. True if it was."""
        seen = self._look(t)
        try:
            plan = self._plan(t, seen)
            if plan is None:
                return True
            content, write = plan
            if seen.dir_fd is None:
                seen.dir_fd = self._make_dir(t)
            elif t.home and not seen.dir_ok and self.state == "exists":
                os.fchown(seen.dir_fd, t.uid, t.gid)
                os.fchmod(seen.dir_fd, 0o700)
            if write:
                self._write(t, seen, content)
        except FileNotFoundError as e:
            if t.home:  # the home went away under us (a userdel -r by hand?)
                raise _NoHome(f"{t.path}: {e.strerror}") from None
            raise os_error(t.path, e) from None
        except OSError as e:
            raise os_error(t.path, e) from None
        finally:
            seen.close()
        return False

    def _make_dir(self, t: _Target) -> int:
        if not t.home:
            os.makedirs(t.dir, mode=0o700, exist_ok=True)
            return os.open(t.dir, _DIR)
        home_fd = os.open(t.home, _DIR)
        try:
            try:
                os.mkdir(".ssh", 0o700, dir_fd=home_fd)
            except FileExistsError:
                pass  # made meanwhile: the O_NOFOLLOW open below vets it
            fd = os.open(".ssh", _NOFOLLOW_DIR, dir_fd=home_fd)
        finally:
            os.close(home_fd)
        os.fchown(fd, t.uid, t.gid)
        os.fchmod(fd, 0o700)
        return fd

    def _write(self, t: _Target, seen: _Seen, content: bytes) -> None:
        assert seen.dir_fd is not None
        dfd = seen.dir_fd
        if t.home:
            mode, owner = 0o600, (t.uid, t.gid)
        elif seen.st is not None:
            mode, owner = stat.S_IMODE(seen.st.st_mode), (seen.st.st_uid, seen.st.st_gid)
        else:
            mode, owner = 0o600, (os.geteuid(), os.getegid())
        # relative to the vetted directory fd: no path component is followed
        atomic_write(t.name, content, mode=mode, owner=owner, dir_fd=dfd)

    # -- lines ----------------------------------------------------------------------
    def _line(self) -> str:
        opts = ",".join(self.options)
        line = f"{opts} {self.type} {self.key}" if opts else f"{self.type} {self.key}"
        return f"{line} {self.comment}" if self.comment else line

    def _match(self, line: str) -> tuple[list[str], str] | None:
        """For a line holding our key: (its options, its comment); else None."""
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            return None
        tok = _tokens(stripped, 3)
        if tok[:2] == [self.type, self.key]:
            rest = stripped.split(None, 2)
            return [], rest[2] if len(rest) > 2 else ""
        if tok[1:3] == [self.type, self.key]:
            after = stripped[len(tok[0]) :].split(None, 2)
            return _split_options(tok[0]), after[2] if len(after) > 2 else ""
        return None

    def _rewrite(self, data: bytes) -> bytes | None:
        """The file's content with our line made right (or removed); None if unchanged."""
        want = self._line()
        out: list[str] = []
        placed = self.state == "absent"
        for line in data.decode("utf-8", "surrogateescape").splitlines(keepends=True):
            if self._match(line) is None:
                out.append(line)
            elif not placed:
                body = line.rstrip("\r\n")
                out.append(want + line[len(body) :])  # in its place, with its line end
                placed = True
            # else: a duplicate of our key: dropped
        if not placed:
            if out and not out[-1].endswith("\n"):
                out[-1] += "\n"
            out.append(want + "\n")
        new = "".join(out).encode("utf-8", "surrogateescape")
        return None if new == data else new
