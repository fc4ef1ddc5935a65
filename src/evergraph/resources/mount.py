"""mount: a file system mounted (or not) at a mount point, and its /etc/fstab entry (mgmt's mount).

The resource's name is the mount point. `state: exists` keeps an fstab line
`device name type options freq passno` for it and the file system mounted
there; `absent` removes every fstab line for it and unmounts it.

/etc/fstab is edited in place: the first line for the mount point is
replaced where it stands (others for it are dropped), or the line is appended;
comments and every other line are kept byte for byte. The file is written
atomically with its mode and owner. A line that says the same thing in other
words (options in another order, freq and passno left out as 0) is left as it is.

Mounting runs mount(8) with the resource's device, type and options, in the
agent's mount namespace (the mount point is made, 0755, when missing);
unmounting runs umount(8), which fails on a busy file system (an error, retried
by `meta.retry`). A mount that is there with another source or type is
unmounted and mounted again; one whose generic flags (`ro`/`rw`, `nosuid`,
`nodev`, `noexec`, `noatime`, ...) differ from `options` is remounted
(`mount -o remount,...`). File-system options with values (`size=` of a
tmpfs, ...) are not compared with what the kernel shows (it rewrites them):
they apply when mounting.

The watch is the kernel's own notice of a mount or unmount in the agent's mount
namespace (POLLPRI on /proc/self/mountinfo) and inotify on /etc/fstab (the
shared hub).

Reversal: where the mount point had no fstab line and nothing mounted, the
reversal removes both (`absent`); where it had a line, that line's mount comes
back. (A mount without an fstab line cannot be told as a resource: no reversal.)
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

from evergraph._util.atomic import atomic_write
from evergraph.engine.contract import Resource, doc, parent_dir_keys, register
from evergraph.errors import ResourceError
from evergraph.resources import _proc
from evergraph.resources._oserror import os_error
from evergraph.resources._pollpri import watch_pri

FSTAB = "/etc/fstab"
MOUNTINFO = "/proc/self/mountinfo"
_SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"

#: generic mount flags the kernel shows in mountinfo when they are set
_SHOWN = frozenset({"ro", "rw", "nosuid", "nodev", "noexec", "noatime", "relatime", "nodiratime"})
#: generic flags it never shows: set when none of these is shown
_UNSHOWN = {
    "suid": ("nosuid",),
    "dev": ("nodev",),
    "exec": ("noexec",),
    "diratime": ("nodiratime",),
    "strictatime": ("noatime", "relatime"),
}


def flag_differs(flag: str, shown: frozenset[str]) -> bool:
    """Does the mount (its `shown` mountinfo flags) lack the generic `flag`?"""
    if flag in _SHOWN:
        return flag not in shown
    return any(f in shown for f in _UNSHOWN.get(flag, ()))


_TYPE = re.compile(r"[a-z0-9][a-z0-9._+-]*")
#: characters fstab and mountinfo write as octal escapes
_ESCAPE = {" ": "\\040", "\t": "\\011", "\n": "\\012", "\\": "\\134"}
_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def _escape(field: str) -> str:
    return "".join(_ESCAPE.get(c, c) for c in field)


def options_text(options: dict[str, str]) -> str:
    """`{"defaults": "", "size": "10m"}` -> `defaults,size=10m`."""
    return ",".join(f"{k}={v}" if v else k for k, v in options.items()) or "defaults"


def parse_options(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split(","):
        if part:
            key, _, value = part.partition("=")
            out[key] = value
    return out


# -- /etc/fstab ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FstabEntry:
    device: str
    point: str
    type: str
    options: dict[str, str]
    freq: int
    passno: int

    def line(self) -> str:
        return " ".join(
            (
                _escape(self.device),
                _escape(self.point),
                self.type,
                _escape(options_text(self.options)),
                str(self.freq),
                str(self.passno),
            )
        )


def parse_fstab_line(line: str) -> FstabEntry | None:
    """One line's entry; None for a comment, a blank or a malformed line."""
    fields = line.split()
    if len(fields) < 4 or fields[0].startswith("#"):
        return None
    try:
        freq = int(fields[4]) if len(fields) > 4 else 0
        passno = int(fields[5]) if len(fields) > 5 else 0
    except ValueError:
        return None
    point = _unescape(fields[1])
    if point != "/" and point != "none":
        point = point.rstrip("/")
    return FstabEntry(
        _unescape(fields[0]),
        point,
        fields[2],
        parse_options(_unescape(fields[3])),
        freq,
        passno,
    )


def fstab_with(text: str, point: str, entry: FstabEntry | None) -> str:
    """`text` with the lines for `point` replaced by `entry` (None: removed)."""
    out: list[str] = []
    placed = entry is None
    for line in text.splitlines():
        found = parse_fstab_line(line)
        if found is not None and found.point == point:
            if not placed:
                assert entry is not None
                out.append(entry.line())
                placed = True
            continue
        out.append(line)
    if not placed:
        assert entry is not None
        out.append(entry.line())
    return "".join(f"{line}\n" for line in out)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def fstab_entries(text: str, point: str) -> list[FstabEntry]:
    return [e for line in text.splitlines() if (e := parse_fstab_line(line)) and e.point == point]


# -- /proc/self/mountinfo ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mounted:
    source: str
    type: str
    flags: frozenset[str]


def mounted_at(point: str, mountinfo: str | None = None) -> Mounted | None:
    """What is mounted at `point` now (the topmost mount), or None."""
    text = mountinfo if mountinfo is not None else _read(MOUNTINFO)
    found: Mounted | None = None
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        rest = right.split()
        if not sep or len(fields) < 6 or len(rest) < 2:
            continue
        if _unescape(fields[4]) == point:
            found = Mounted(_unescape(rest[1]), rest[0], frozenset(fields[5].split(",")))
    return found


def _loop_backing(source: str) -> str | None:
    """The file behind a loop device (`/dev/loop3`), or None."""
    name = os.path.basename(source)
    if not name.startswith("loop"):
        return None
    try:
        with open(f"/sys/block/{name}/loop/backing_file") as f:
            return f.read().strip()
    except OSError:
        return None


def _device_path(device: str) -> str:
    """`UUID=...` and kin as their /dev/disk/by-* link; a path resolved."""
    for tag, where in (
        ("UUID=", "by-uuid"),
        ("LABEL=", "by-label"),
        ("PARTUUID=", "by-partuuid"),
        ("PARTLABEL=", "by-partlabel"),
    ):
        if device.startswith(tag):
            device = f"/dev/disk/{where}/{device[len(tag) :]}"
            break
    return os.path.realpath(device) if device.startswith("/") else device


def same_source(device: str, source: str) -> bool:
    """Is the mount's `source` (from mountinfo) the resource's `device`?"""
    if device == source:
        return True
    if not device.startswith("/") and "=" not in device:
        return False  # a pseudo source (`tmpfs`, `none`): by name only
    want = _device_path(device)
    if want == (os.path.realpath(source) if source.startswith("/") else source):
        return True
    backing = _loop_backing(source)
    return backing is not None and backing == want


# -- the resource -------------------------------------------------------------------------


@register("mount")
class Mount(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A file system mounted at the mount point (the name), with its /etc/fstab line."""

    state: Annotated[
        Literal["exists", "absent"],
        doc("`exists`: in fstab and mounted; `absent`: neither (other fields ignored)"),
    ] = "exists"
    device: Annotated[
        str, doc("what to mount: a device, `UUID=...`, `LABEL=...`, a file, `tmpfs`...")
    ] = ""
    type: Annotated[str, doc("the file system type (`ext4`, `tmpfs`, ...)")] = ""
    options: Annotated[
        dict[str, str], doc("mount options, `{name: value}`; an empty value is a flag")
    ] = msgspec.field(default_factory=lambda: {"defaults": ""})
    freq: Annotated[int, doc("fstab's dump frequency (5th field)")] = 0
    passno: Annotated[int, doc("fstab's fsck order (6th field; 0: not checked)")] = 0

    def _point(self) -> str:
        return self.name if self.name == "/" else self.name.rstrip("/")

    def validate(self) -> None:
        point = self.name
        if not point.startswith("/"):
            raise self.bad("name", f"{point!r} is not an absolute path (the mount point)")
        if "//" in point or "/./" in point or "/../" in point or point.endswith(("/.", "/..")):
            raise self.bad("name", f"{point!r} is not a normalised path")
        if any(c in point for c in "\0\n"):
            raise self.bad("name", "contains a NUL or a newline")
        if self.state == "absent":
            return
        if not self.device:
            raise self.bad("device", "needs a device to mount (or `tmpfs`, `none`...)")
        if any(c in self.device for c in "\0\n"):
            raise self.bad("device", "contains a NUL or a newline")
        if not _TYPE.fullmatch(self.type):
            why = "needs a file system type" if not self.type else f"{self.type!r} is not one"
            raise self.bad("type", f"{why} (`ext4`, `tmpfs`, ... see /proc/filesystems)")
        for key, value in self.options.items():
            if not key or any(c in key for c in ",= \t\n\0"):
                raise self.bad("options", f"{key!r} is not an option name")
            if any(c in value for c in ", \t\n\0"):
                raise self.bad("options", f"{key}: {value!r} holds a comma or a space")
        for field in ("freq", "passno"):
            if not 0 <= getattr(self, field) <= 9:
                raise self.bad(field, f"must be between 0 and 9, not {getattr(self, field)}")

    def claims(self) -> list[str]:
        return [f"mount:{self._point()}"]

    def autoedge_wants(self) -> Iterator[Iterator[str]]:
        point = self._point()

        def keys() -> Iterator[str]:
            yield f"dir:{point.rstrip('/')}/"  # the mount point itself, if managed
            yield from parent_dir_keys(point)

        yield keys()
        if self.device.startswith("/"):
            yield iter((f"path:{os.path.normpath(self.device)}",))  # an image file

    def _entry(self) -> FstabEntry:
        return FstabEntry(
            self.device, self._point(), self.type, dict(self.options), self.freq, self.passno
        )

    def reversal(self) -> Mount | None:
        point = self._point()
        entries = fstab_entries(_read(FSTAB), point)
        if entries:
            e = entries[0]
            return Mount(
                name=self.name,
                device=e.device,
                type=e.type,
                options=e.options,
                freq=e.freq,
                passno=e.passno,
            )
        if mounted_at(point) is None:
            return Mount(name=self.name, state="absent")
        return None

    def subscribe(self) -> Callable[[], None]:
        event = self.handle.event
        fstab = self.handle.watcher.subscribe(FSTAB, lambda _mask: event())
        try:
            mounts = watch_pri(MOUNTINFO, event)
        except OSError as e:
            fstab()
            raise os_error(f"cannot watch {MOUNTINFO}", e) from None

        def unsubscribe() -> None:
            fstab()
            mounts()

        return unsubscribe

    async def check_apply(self, apply: bool) -> bool:
        clean = self._fstab(apply)
        return await self._mount(apply) and clean

    def _fstab(self, apply: bool) -> bool:
        point = self._point()
        text = _read(FSTAB)
        entries = fstab_entries(text, point)
        if self.state == "absent":
            if not entries:
                return True
            self.handle.changed("fstab", [e.line() for e in entries], None)
        else:
            want = self._entry()
            if len(entries) == 1 and entries[0] == want:
                return True
            self.handle.changed("fstab", [e.line() for e in entries] or None, want.line())
        if apply:
            new = fstab_with(text, point, None if self.state == "absent" else self._entry())
            try:
                st = os.stat(FSTAB)
                mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
            except FileNotFoundError:
                mode, owner = 0o644, None
            try:
                atomic_write(FSTAB, new.encode("utf-8", "surrogateescape"), mode=mode, owner=owner)
            except OSError as e:
                raise os_error(f"cannot write {FSTAB}", e) from None
            what = "removed from" if self.state == "absent" else "set in"
            self.handle.logger.info("%s: line %s %s", self.ident, what, FSTAB)
        return False

    async def _mount(self, apply: bool) -> bool:
        point = self._point()
        now = mounted_at(point)
        if self.state == "absent":
            if now is None:
                return True
            self.handle.changed("mounted", f"{now.source} ({now.type})", None)
            if apply:
                await self._run("umount", point)
                self.handle.logger.info("%s: unmounted", self.ident)
            return False
        want = f"{self.device} ({self.type})"
        if now is None:
            self.handle.changed("mounted", None, want)
            if apply:
                await self._mount_it()
            return False
        if now.type != self.type or not same_source(self.device, now.source):
            self.handle.changed("mounted", f"{now.source} ({now.type})", want)
            if apply:
                await self._run("umount", point)
                await self._mount_it()
            return False
        differ = [f for f in self.options if flag_differs(f, now.flags)]
        if not differ:
            return True
        shown = ",".join(sorted(now.flags & _SHOWN))
        self.handle.changed("options", shown, ",".join(differ))
        if apply:
            await self._run("mount", "-o", f"remount,{options_text(self.options)}", point)
            self.handle.logger.info("%s: remounted (%s)", self.ident, ",".join(differ))
        return False

    async def _mount_it(self) -> None:
        point = self._point()
        if not os.path.isdir(point):
            try:
                os.makedirs(point, mode=0o755, exist_ok=True)
            except OSError as e:
                raise os_error("cannot make the mount point", e) from None
        opts = options_text(self.options)
        await self._run("mount", "-t", self.type, "-o", opts, "--", self.device, point)
        self.handle.logger.info("%s: mounted %s (%s, %s)", self.ident, self.device, self.type, opts)

    async def _run(self, *argv: str) -> None:
        prog = shutil.which(argv[0], path=os.environ.get("PATH", "") + ":" + _SBIN)
        if prog is None:
            raise ResourceError(f"{argv[0]} not found (install util-linux's mount)")
        done = await _proc.run([prog, *argv[1:]])
        if done.returncode != 0:
            detail = " | ".join((done.stderr.strip() or done.stdout.strip()).splitlines()[-3:])
            raise ResourceError(
                f"{' '.join(argv)} exited with status {done.returncode}"
                + (f": {detail}" if detail else "")
            )
