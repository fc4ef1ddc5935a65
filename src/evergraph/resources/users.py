"""user and group: local accounts, made and changed with the shadow-utils commands.

Checks read /etc/passwd and /etc/group directly (not through NSS, which may
cache, and may answer for accounts from LDAP that no local command can
change). The parsed files are cached by inode, size and times, so a hundred
resources re-checking after one `useradd` parse each file once.

Changes go through useradd/usermod/userdel and groupadd/groupmod/groupdel, so
/etc/shadow, /etc/gshadow, locking and nscd invalidation are done as the
system's own tools do them. Our own commands run one at a time: they all take
the same lock files, and one that finds them taken may fail instead of waiting.

The watch is inotify on /etc/passwd and /etc/group (the tools replace them by
rename, which the shared hub sees as a change of the name), and with
`managehome` on the home directory.

A user that needs a group that is missing waits a moment for it before it
fails: a group resource may be re-making it right now, its event still queued
behind the one that woke the user.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

from evergraph.engine.contract import Resource, doc, register
from evergraph.errors import ResourceError
from evergraph.resources import _proc
from evergraph.resources._locks import Locks
from evergraph.resources._oserror import os_error

PASSWD = "/etc/passwd"
GROUP = "/etc/group"

#: uid_t/gid_t are 32 bits and -1 (4294967295) means "unchanged" to chown(2)
ID_MAX = 2**32 - 2

# shadow-utils' own rule (is_valid_name): no fully numeric names, no "." or ".."
_NAME = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*\$?")
_NAME_MAX = 32


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a user or group name, or None if it can."""
    if not name:
        return "is empty"
    if len(name) > _NAME_MAX:
        return f"{name!r} is longer than {_NAME_MAX} characters"
    if not _NAME.fullmatch(name) or name.isdigit() or name in (".", ".."):
        return (
            f"{name!r} is not a valid name (letters, digits, `_`, `.`, `-`; not all digits;"
            " not starting with `-`)"
        )
    return None


def _id_or_name_problem(value: str) -> str | None:
    if value.isdigit():
        return None if int(value) <= ID_MAX else f"{value} is not between 0 and {ID_MAX}"
    return name_problem(value)


def _path_problem(value: str) -> str | None:
    if not value.startswith("/"):
        return f"{value!r} is not an absolute path"
    if any(c in value for c in ":\n\0"):
        return f"{value!r} contains `:`, a newline or NUL, which /etc/passwd cannot hold"
    return None


# -- reading the databases ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class PwEntry:
    name: str
    uid: int
    gid: int
    home: str
    shell: str


@dataclass(frozen=True, slots=True)
class GrEntry:
    name: str
    gid: int
    members: frozenset[str]


@dataclass(frozen=True, slots=True)
class GroupDb:
    by_name: dict[str, GrEntry]
    by_gid: dict[int, GrEntry]

    def member_of(self, user: str) -> set[str]:
        return {g.name for g in self.by_name.values() if user in g.members}


_StatKey = tuple[int, int, int, int]
_cache: dict[str, tuple[_StatKey, object]] = {}


def _fields(data: bytes, count: int) -> Iterator[list[str]]:
    for raw in data.decode("utf-8", "surrogateescape").splitlines():
        # NIS compat lines (+/-) and malformed ones are not local accounts
        if not raw or raw[0] in "+-#":
            continue
        parts = raw.split(":")
        if len(parts) >= count:
            yield parts


def _parse_passwd(data: bytes) -> dict[str, PwEntry]:
    out: dict[str, PwEntry] = {}
    for p in _fields(data, 7):
        try:
            out.setdefault(p[0], PwEntry(p[0], int(p[2]), int(p[3]), p[5], p[6]))
        except ValueError:
            continue
    return out


def _parse_group(data: bytes) -> GroupDb:
    by_name: dict[str, GrEntry] = {}
    by_gid: dict[int, GrEntry] = {}
    for p in _fields(data, 4):
        try:
            entry = GrEntry(p[0], int(p[2]), frozenset(m for m in p[3].split(",") if m))
        except ValueError:
            continue
        by_name.setdefault(entry.name, entry)
        by_gid.setdefault(entry.gid, entry)
    return GroupDb(by_name, by_gid)


def _load(path: str, parse: Callable[[bytes], object]) -> object:
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            hit = _cache.get(path)
            if hit is not None and hit[0] == key:
                return hit[1]
            value = parse(f.read())
    except FileNotFoundError:
        return parse(b"")
    _cache[path] = (key, value)
    return value


def read_passwd(path: str = PASSWD) -> dict[str, PwEntry]:
    value = _load(path, _parse_passwd)
    assert isinstance(value, dict)
    return value


def read_group(path: str = GROUP) -> GroupDb:
    value = _load(path, _parse_group)
    assert isinstance(value, GroupDb)
    return value


# -- running the tools ------------------------------------------------------------

_SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"


async def _shadow(res: Resource, argv: list[str]) -> None:
    """Run one shadow-utils command, one at a time in the agent; ResourceError on failure."""
    # an agent started from a user's shell may lack /usr/sbin in PATH
    prog = shutil.which(argv[0], path=os.environ.get("PATH", "") + ":" + _SBIN)
    if prog is None:
        raise ResourceError(f"{argv[0]} not found (install the `passwd` package)")
    async with res.handle.services.get(Locks).lock("shadow-utils"):
        done = await _proc.run([prog, *argv[1:]])
    if done.returncode != 0:
        detail = " | ".join((done.stderr.strip() or done.stdout.strip()).splitlines()[-3:])
        raise _ShadowError(
            f"{' '.join(argv)} exited with status {done.returncode}"
            + (f": {detail}" if detail else ""),
            done.returncode,
        )


class _ShadowError(ResourceError):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


#: useradd/usermod: "group does not exist", "name already in use": what a
#: userdel or groupdel running at the same time (by hand) can cause
_RACY_STATUS = (6, 9)


#: seconds to wait for a missing group (or user) that may be being made right now
MISSING_GRACE = 2.0


async def _wait_until(
    res: Resource, ready: Callable[[], bool], paths: tuple[str, ...], timeout: float
) -> bool:
    """Wait (on inotify, not a poll) until `ready()`; False after `timeout` seconds."""
    # (no asyncio.timeout: an eager check_apply may be running outside a task)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    changed = asyncio.Event()
    subs = [res.handle.watcher.subscribe(p, lambda _mask: changed.set()) for p in paths]
    try:
        while not ready():  # checked after subscribing: no change slips by
            try:
                await asyncio.wait_for(changed.wait(), deadline - loop.time())
            except TimeoutError:
                return ready()
            changed.clear()
        return True
    finally:
        for s in subs:
            s()


def _home_mode() -> int:
    """The mode useradd gives a new home: HOME_MODE, else 0777 & ~UMASK (login.defs)."""
    found: dict[str, str] = {}
    try:
        with open("/etc/login.defs") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] in ("HOME_MODE", "UMASK"):
                    found[parts[0]] = parts[1]
    except OSError:
        pass
    try:
        if "HOME_MODE" in found:
            return int(found["HOME_MODE"], 8) & 0o7777
        return 0o777 & ~int(found.get("UMASK", "022"), 8)
    except ValueError:
        return 0o755


def _make_home(home: str, uid: int, gid: int) -> None:
    """A home from /etc/skel, as `useradd -m` makes it (for a user that lost its home)."""
    try:
        os.makedirs(os.path.dirname(home), 0o755, exist_ok=True)
        try:
            os.mkdir(home, 0o700)  # root's until filled, so nothing can be slipped in
        except FileExistsError:
            return  # made meanwhile (by the user's own tools?): leave it as it is
        if os.path.isdir("/etc/skel"):
            shutil.copytree("/etc/skel", home, symlinks=True, dirs_exist_ok=True)
        for root, dirs, files in os.walk(home):
            for name in (*dirs, *files):
                os.lchown(os.path.join(root, name), uid, gid)
        os.chmod(home, _home_mode())
        os.chown(home, uid, gid)
    except OSError as e:
        raise os_error(f"cannot make home directory {home}", e) from None


class _MissingGroup(Exception):
    """A group the user needs does not exist (yet): `wanted`, named in `field`."""

    def __init__(self, message: str, field: str, wanted: object) -> None:
        super().__init__(message)
        self.field = field
        self.wanted = wanted


#: useradd/usermod options, as the fields they change
_FLAG_FIELDS = {"-u": "uid", "-g": "gid", "-G": "groups", "-d": "home", "-s": "shell"}


def _subscribe_all(res: Resource, paths: tuple[str, ...]) -> Callable[[], None]:
    subs = [res.handle.watcher.subscribe(p, lambda _mask: res.handle.event()) for p in paths]

    def unsubscribe() -> None:
        for s in subs:
            s()

    return unsubscribe


# -- kinds ----------------------------------------------------------------------------


@register("user")
class User(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A local user account (the name is the login name), made with useradd/usermod/userdel."""

    eager = True  # a clean check only reads two files; changes suspend on a subprocess

    state: Annotated[
        Literal["exists", "absent"], doc("`exists` creates the user; `absent` removes it")
    ] = "exists"
    uid: Annotated[int | None, doc("numeric user id; unset = chosen by useradd, then kept")] = None
    gid: Annotated[
        int | str | None,
        doc("primary group, name or number (must exist); unset = a group named like the user"),
    ] = None
    group: Annotated[
        str | None, doc("primary group by name (mgmt's spelling of `gid`); not with gid")
    ] = None
    groups: Annotated[
        list[str] | None,
        doc("the exact supplementary groups (names or numbers); unset = not managed"),
    ] = None
    home: Annotated[
        str | None, doc("home directory path; unset = useradd's default, then kept")
    ] = None
    shell: Annotated[str | None, doc("login shell; unset = useradd's default, then kept")] = None
    managehome: Annotated[
        bool,
        doc("keep the home directory: made from /etc/skel when missing; removed with the user"),
    ] = False
    allowduplicateuid: Annotated[
        bool, doc("let `uid` be one another user has too (useradd/usermod -o)")
    ] = False

    # -- contract -----------------------------------------------------------
    def validate(self) -> None:
        if (why := name_problem(self.name)) is not None:
            raise self.bad("name", why)
        if self.uid is not None and not 0 <= self.uid <= ID_MAX:
            raise self.bad("uid", f"{self.uid} is not between 0 and {ID_MAX}")
        if self.gid is not None and self.group is not None:
            raise self.bad("group", "names the primary group, as gid does: give one of them")
        gid, field = (self.gid, "gid") if self.group is None else (self.group, "group")
        if isinstance(gid, int) and not 0 <= gid <= ID_MAX:
            raise self.bad(field, f"{gid} is not between 0 and {ID_MAX}")
        if isinstance(gid, str) and (why := _id_or_name_problem(gid)) is not None:
            raise self.bad(field, why)
        for g in self.groups or ():
            if (why := _id_or_name_problem(g)) is not None:
                raise self.bad("groups", why)
        for field in ("home", "shell"):
            value = getattr(self, field)
            if value is not None and (why := _path_problem(value)) is not None:
                raise self.bad(field, why)

    def claims(self) -> list[str]:
        return [f"user:{self.name}"]

    def autoedge_provides(self) -> list[str]:
        return [f"user:{self.name}"]

    def autoedge_wants(self) -> list[list[str]]:
        if self.state == "absent":
            return []  # nothing of ours needs a group to exist
        wants: list[list[str]] = []
        primary = self._gid_key()
        if primary is not None:
            wants.append([primary])
        for g in self.groups or ():
            wants.append([f"gid:{int(g)}" if g.isdigit() else f"group:{g}"])
        return wants

    def _gid_key(self) -> str | None:
        gid = self.gid if self.group is None else self.group
        if gid is None:
            return f"group:{self.name}"  # an existing group of our name becomes primary
        if isinstance(gid, int) or gid.isdigit():
            return f"gid:{int(gid)}"
        return f"group:{gid}"

    def reversal(self) -> User:
        """Absent if the user does not exist now; else its current ids, home, shell, groups."""
        pw = read_passwd().get(self.name)
        if pw is None:
            return User(name=self.name, state="absent", managehome=self.managehome)
        return User(
            name=self.name,
            uid=pw.uid,
            gid=pw.gid,
            groups=sorted(read_group().member_of(self.name)),
            home=pw.home if _path_problem(pw.home) is None else None,
            shell=pw.shell if pw.shell and _path_problem(pw.shell) is None else None,
        )

    def subscribe(self) -> Callable[[], None]:
        watcher = self.handle.watcher
        subs = [
            watcher.subscribe(PASSWD, self._passwd_changed),
            watcher.subscribe(GROUP, self._changed),
        ]
        self._home_watch: tuple[str, Callable[[], None]] | None = None
        self._watch_home()

        def unsubscribe() -> None:
            for s in subs:
                s()
            if self._home_watch is not None:
                self._home_watch[1]()
                self._home_watch = None

        return unsubscribe

    def _watch_home(self) -> None:
        """With managehome, the home directory too: its removal is drift."""
        path = self._home_path(read_passwd().get(self.name))
        if (self._home_watch[0] if self._home_watch else None) == path:
            return
        if self._home_watch is not None:
            self._home_watch[1]()
        self._home_watch = None
        if path is not None:
            self._home_watch = (path, self.handle.watcher.subscribe(path, self._changed))

    def _passwd_changed(self, _mask: int) -> None:
        self._watch_home()  # the home of a user made just now becomes known
        self.handle.event()

    def _changed(self, _mask: int) -> None:
        self.handle.event()

    async def check_apply(self, apply: bool) -> bool:
        pw = read_passwd().get(self.name)
        if self.state == "absent":
            if pw is None:
                return True
            self.handle.changed("state", "exists", "absent")
            if apply:
                await _shadow(self, ["userdel", *(["-r"] if self.managehome else []), self.name])
            return False
        for attempt in (1, 2):
            try:
                flags = self._flags(pw, read_group())
            except _MissingGroup as e:
                if not apply:  # in noop, a group still to be made is a would-change
                    if pw is None:
                        self.handle.changed("state", None, "exists")
                    self.handle.changed(e.field, None, f"{e.wanted} (does not exist yet)")
                    return False
                # A group resource may be re-creating it right now: we ran on an
                # older event while the group's own event is still queued. Give
                # /etc/group a moment before calling it a failure.
                if not await self._group_appears():
                    raise ResourceError(str(e)) from None
                pw = read_passwd().get(self.name)
                flags = self._flags(pw, read_group())
            home = self._home_path(pw)
            home_missing = pw is not None and home is not None and not os.path.isdir(home)
            if pw is not None and not flags and not home_missing:
                return True
            if attempt == 1:
                self._report(pw, flags, home if home_missing else None)
            if not apply:
                return False
            try:
                await self._apply(pw, flags, home if home_missing else None)
                break
            except _ShadowError as e:
                if attempt == 2 or e.status not in _RACY_STATUS:
                    raise
                # e.g. a userdel by hand was still removing the user's group
                # when we read /etc/group: read again, try once more
                pw = read_passwd().get(self.name)
        return False

    def _report(self, pw: PwEntry | None, flags: list[str], make_home: str | None) -> None:
        """Report what the useradd/usermod `flags` change, and a home to make."""
        h = self.handle
        old: dict[str, object] = {}
        if pw is None:
            h.changed("state", None, "exists")
        else:
            gdb = read_group()
            old = {
                "-u": pw.uid,
                "-g": pw.gid,
                "-G": sorted(gdb.member_of(self.name)),
                "-d": pw.home,
                "-s": pw.shell,
            }
        for flag, value in zip(flags[::2], flags[1::2], strict=True):
            new: object = value
            if flag == "-G":
                new = sorted(value.split(",")) if value else []
            h.changed(_FLAG_FIELDS[flag], old.get(flag), new)
        if make_home is not None:
            h.changed("home directory", None, make_home)

    async def _apply(self, pw: PwEntry | None, flags: list[str], make_home: str | None) -> None:
        if self.allowduplicateuid and "-u" in flags:
            flags = ["-o", *flags]  # a uid in use by another account is meant
        if pw is None:
            await _shadow(self, ["useradd", *flags, "-m" if self.managehome else "-M", self.name])
            return
        if flags:
            await _shadow(self, ["usermod", *flags, self.name])
        if make_home is not None:
            now = read_passwd().get(self.name, pw)
            await asyncio.to_thread(_make_home, make_home, now.uid, now.gid)

    def _home_path(self, pw: PwEntry | None) -> str | None:
        """The home directory we keep (managehome), once known."""
        if not self.managehome or self.state == "absent":
            return None
        home = self.home if self.home is not None else (pw.home if pw else "")
        return os.path.normpath(home) if home.startswith("/") else None

    async def _group_appears(self) -> bool:
        def ready() -> bool:
            try:
                self._flags(None, read_group())
            except _MissingGroup:
                return False
            return True

        return await _wait_until(self, ready, (GROUP,), MISSING_GRACE)

    def _flags(self, pw: PwEntry | None, gdb: GroupDb) -> list[str]:
        """Options for useradd (pw None) or usermod that make the account as declared."""
        flags: list[str] = []
        if self.uid is not None and (pw is None or pw.uid != self.uid):
            flags += ["-u", str(self.uid)]
        primary = self._primary_gid(pw, gdb)
        if primary is not None and (pw is None or pw.gid != primary):
            flags += ["-g", str(primary)]
        if self.groups is not None:
            want = {self._group_name(g, gdb) for g in self.groups}
            if want != gdb.member_of(self.name) and (pw is not None or want):
                flags += ["-G", ",".join(sorted(want))]
        if self.home is not None and (
            pw is None or os.path.normpath(pw.home) != os.path.normpath(self.home)
        ):
            flags += ["-d", self.home]
        if self.shell is not None and (pw is None or pw.shell != self.shell):
            flags += ["-s", self.shell]
        return flags

    def _primary_gid(self, pw: PwEntry | None, gdb: GroupDb) -> int | None:
        gid, field = (self.gid, "gid") if self.group is None else (self.group, "group")
        if gid is None:
            # useradd refuses to make a user group over an existing group of
            # that name: make that group the primary one, as the user meant
            own = gdb.by_name.get(self.name)
            return own.gid if pw is None and own is not None else None
        if isinstance(gid, int) or gid.isdigit():
            if int(gid) not in gdb.by_gid:
                raise _MissingGroup(f"primary group {gid} does not exist", field, gid)
            return int(gid)
        entry = gdb.by_name.get(gid)
        if entry is None:
            raise _MissingGroup(f"primary group {gid!r} does not exist", field, gid)
        return entry.gid

    @staticmethod
    def _group_name(g: str, gdb: GroupDb) -> str:
        entry = gdb.by_gid.get(int(g)) if g.isdigit() else gdb.by_name.get(g)
        if entry is None:
            raise _MissingGroup(f"group {g!r} in groups does not exist", "groups", g)
        return entry.name


@register("group")
class Group(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A local group (the name is the group name), made with groupadd/groupmod/groupdel."""

    eager = True

    state: Annotated[
        Literal["exists", "absent"], doc("`exists` creates the group; `absent` removes it")
    ] = "exists"
    gid: Annotated[int | None, doc("numeric group id; unset = chosen by groupadd, then kept")] = (
        None
    )

    def validate(self) -> None:
        if (why := name_problem(self.name)) is not None:
            raise self.bad("name", why)
        if self.gid is not None and not 0 <= self.gid <= ID_MAX:
            raise self.bad("gid", f"{self.gid} is not between 0 and {ID_MAX}")

    def claims(self) -> list[str]:
        return [f"group:{self.name}"]

    def autoedge_provides(self) -> list[str]:
        if self.state == "absent":
            return []
        keys = [f"group:{self.name}"]
        if self.gid is not None:
            keys.append(f"gid:{self.gid}")
        return keys

    def reversal(self) -> Group:
        """Absent if the group does not exist now; else its current gid."""
        gr = read_group().by_name.get(self.name)
        if gr is None:
            return Group(name=self.name, state="absent")
        return Group(name=self.name, gid=gr.gid)

    def subscribe(self) -> Callable[[], None]:
        return _subscribe_all(self, (GROUP,))

    async def check_apply(self, apply: bool) -> bool:
        gr = read_group().by_name.get(self.name)
        if self.state == "absent":
            if gr is None:
                return True
            self.handle.changed("state", "exists", "absent")
            if apply:
                await _shadow(self, ["groupdel", self.name])
            return False
        if gr is not None and (self.gid is None or gr.gid == self.gid):
            return True
        if gr is None:
            self.handle.changed("state", None, "exists")
        if self.gid is not None:
            self.handle.changed("gid", None if gr is None else gr.gid, self.gid)
        if not apply:
            return False
        gid = [] if self.gid is None else ["-g", str(self.gid)]
        await _shadow(self, ["groupadd" if gr is None else "groupmod", *gid, self.name])
        return False
