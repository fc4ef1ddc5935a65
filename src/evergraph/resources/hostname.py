"""hostname: the machine's static, transient and pretty host names (mgmt's hostname).

Three names, as systemd-hostnamed has them:

- the static hostname, kept in `/etc/hostname`;
- the transient hostname, the kernel's (`uname -n`, set with sethostname(2));
- the pretty hostname, free-form text, `PRETTY_HOSTNAME=` in `/etc/machine-info`.

`hostname` is the fallback for each of the three left empty (mgmt's rule); an
empty name is not managed.

Where systemd-hostnamed answers on the system bus (running, or activatable) the
static and pretty names go through it (`SetStaticHostname`,
`SetPrettyHostname`), as `hostnamectl` does. Elsewhere (no systemd, a container)
`/etc/hostname` is written atomically (keeping its mode) and the
`PRETTY_HOSTNAME=` line of `/etc/machine-info` is replaced in place, its other
lines kept. The transient name is always the kernel's own, set with
sethostname(2): hostnamed would not apply one that differs from a static name.

The watch needs no bus: inotify (the shared hub) on `/etc/hostname` and
`/etc/machine-info`, where hostnamed keeps them too, and the kernel's own
change notice for the transient name (POLLPRI on `/proc/sys/kernel/hostname`,
raised by every sethostname(2); it is global, so a change in another UTS
namespace wakes a check that finds nothing to do).

Reversal restores the names found before the first change (a pretty name that
was unset, or a static name without `/etc/hostname`, is left as it is).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from evergraph._util.atomic import atomic_write
from evergraph.engine.contract import Handle, Resource, doc, register
from evergraph.errors import ResourceError
from evergraph.resources._dbus import call as dbus_call
from evergraph.resources._oserror import os_error
from evergraph.resources._pollpri import watch_pri

if TYPE_CHECKING:
    from dbus_fast.aio import MessageBus

HOSTNAME_FILE = "/etc/hostname"
MACHINE_INFO = "/etc/machine-info"
KERNEL_HOSTNAME = "/proc/sys/kernel/hostname"

HOSTNAMED = "org.freedesktop.hostname1"
HOSTNAMED_PATH = "/org/freedesktop/hostname1"
DBUS = "org.freedesktop.DBus"
#: seconds to connect to the system bus, and for one call's answer
BUS_TIMEOUT = 10.0

#: the kernel's limit (HOST_NAME_MAX)
HOSTNAME_MAX = 64
_LABEL = re.compile(r"[A-Za-z0-9-]+")
#: a pretty name is one line of text: no control characters
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
PRETTY_MAX = 255
#: characters that need no quoting in an env-style file (machine-info)
_PLAIN = re.compile(r"[A-Za-z0-9_.,:/@%+-]+")


def hostname_problem(name: str) -> str | None:
    """Why `name` cannot be a static or transient host name (None: it can)."""
    if len(name.encode()) > HOSTNAME_MAX:
        return f"{name!r} is longer than {HOSTNAME_MAX} bytes"
    labels = name.split(".")
    if not all(_LABEL.fullmatch(label) for label in labels):
        return (
            f"{name!r} is not a host name (letters, digits and `-`, in labels separated by"
            " single dots)"
        )
    return None


# -- /etc/machine-info (an env-style file) -------------------------------------------


def _unquote(raw: str) -> str:
    """The value of an env-file assignment's right-hand side (shell-like quoting)."""
    out: list[str] = []
    i, n = 0, len(raw)
    while i < n:
        c = raw[i]
        if c == "'":
            end = raw.find("'", i + 1)
            end = n if end < 0 else end
            out.append(raw[i + 1 : end])
            i = end + 1
        elif c == '"':
            i += 1
            while i < n and raw[i] != '"':
                if raw[i] == "\\" and i + 1 < n and raw[i + 1] in '"\\`$':
                    i += 1
                out.append(raw[i])
                i += 1
            i += 1
        elif c == "\\" and i + 1 < n:
            out.append(raw[i + 1])
            i += 2
        elif c.isspace() or c == "#":
            break  # an unquoted space ends the value; the rest is a comment
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _quote(value: str) -> str:
    if _PLAIN.fullmatch(value):
        return value
    escaped = re.sub(r'(["\\`$])', r"\\\1", value)
    return f'"{escaped}"'


def read_pretty(text: str) -> str:
    """PRETTY_HOSTNAME of a machine-info text (the last assignment wins; "" if none)."""
    value = ""
    for line in text.splitlines():
        key, eq, raw = line.strip().partition("=")
        if eq and key.strip() == "PRETTY_HOSTNAME":
            value = _unquote(raw.strip())
    return value


def with_pretty(text: str, pretty: str) -> str:
    """`text` (machine-info) with PRETTY_HOSTNAME set to `pretty`, other lines kept."""
    line = f"PRETTY_HOSTNAME={_quote(pretty)}"
    out: list[str] = []
    placed = False
    for old in text.splitlines():
        key, eq, _ = old.strip().partition("=")
        if eq and key.strip() == "PRETTY_HOSTNAME":
            if not placed:
                out.append(line)
                placed = True
            continue
        out.append(old)
    if not placed:
        out.append(line)
    return "\n".join(out) + "\n"


def read_static(text: str) -> str:
    """The name in an /etc/hostname text: its first line that is no comment."""
    for line in text.splitlines():
        name = line.strip()
        if name and not name.startswith("#"):
            return name
    return ""


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _write(path: str, text: str) -> None:
    """Atomically, keeping the file's mode and owner (new: 0644, ours)."""
    try:
        st = os.stat(path)
        mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
    except FileNotFoundError:
        mode, owner = 0o644, None
    atomic_write(path, text.encode("utf-8", "surrogateescape"), mode=mode, owner=owner)


# -- systemd-hostnamed ------------------------------------------------------------------


def _system_bus_address() -> str:
    return os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or "unix:path=/run/dbus/system_bus_socket"


class _Hostnamed:
    """A connection to the system bus where hostnamed answers."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus

    @classmethod
    async def connect(cls) -> _Hostnamed | None:
        """The connection, or None: no system bus, or no hostnamed on it."""
        from dbus_fast import BusType
        from dbus_fast.aio import MessageBus

        address = _system_bus_address()
        if address.startswith("unix:path=") and not os.path.exists(address[10:].split(",")[0]):
            return None  # (the common case without systemd: no bus socket at all)
        bus = MessageBus(bus_address=address, bus_type=BusType.SYSTEM)
        try:
            async with asyncio.timeout(BUS_TIMEOUT):
                await bus.connect()
        except Exception:
            return None
        me = cls(bus)
        try:
            owned = await me.call(
                DBUS, "/org/freedesktop/DBus", DBUS, "NameHasOwner", "s", HOSTNAMED
            )
            if not owned[0]:
                # Activatable is not enough: without systemd the activation fails
                # (its service file names a systemd unit). So start it now.
                await me.call(
                    DBUS, "/org/freedesktop/DBus", DBUS, "StartServiceByName", "su", HOSTNAMED, 0
                )
        except ResourceError:
            bus.disconnect()
            return None
        except BaseException:
            bus.disconnect()
            raise
        return me

    @property
    def connected(self) -> bool:
        return bool(self.bus.connected)

    async def call(
        self, dest: str, path: str, iface: str, member: str, signature: str = "", *body: Any
    ) -> list[Any]:
        from dbus_fast import MessageType

        reply = await dbus_call(self.bus, dest, path, iface, member, signature, body, BUS_TIMEOUT)
        if reply.message_type is MessageType.ERROR:
            detail = reply.body[0] if reply.body else reply.error_name
            raise ResourceError(f"hostnamed {member}: {detail}")
        return list(reply.body)

    async def get(self, prop: str) -> str:
        body = await self.call(
            HOSTNAMED,
            HOSTNAMED_PATH,
            "org.freedesktop.DBus.Properties",
            "Get",
            "ss",
            HOSTNAMED,
            prop,
        )
        return str(body[0].value)

    async def set(self, method: str, value: str) -> None:
        # interactive=false: never wait for a password prompt (polkit)
        await self.call(HOSTNAMED, HOSTNAMED_PATH, HOSTNAMED, method, "sb", value, False)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.bus.disconnect()


# -- the resource -------------------------------------------------------------------------


@register("hostname")
class Hostname(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """The host's names: static (/etc/hostname), transient (the kernel's), pretty."""

    hostname: Annotated[str, doc("the fallback for each of the three names below left empty")] = ""
    pretty_hostname: Annotated[
        str, doc("free-form text (one line) shown to users; empty: `hostname`, or not managed")
    ] = ""
    static_hostname: Annotated[
        str, doc("the name in /etc/hostname; empty: `hostname`, or not managed")
    ] = ""
    transient_hostname: Annotated[
        str, doc("the kernel's host name (sethostname(2)); empty: `hostname`, or not managed")
    ] = ""

    def _names(self) -> tuple[str, str, str]:
        """(static, transient, pretty) after the fallback; "" = not managed."""
        fallback = self.hostname
        return (
            self.static_hostname or fallback,
            self.transient_hostname or fallback,
            self.pretty_hostname or fallback,
        )

    def validate(self) -> None:
        static, transient, pretty = self._names()
        if not (static or transient or pretty):
            raise self.bad(
                "hostname",
                "nothing to manage: give hostname, or static_hostname, transient_hostname"
                " or pretty_hostname",
            )
        for field in ("static_hostname", "transient_hostname"):
            value = getattr(self, field)
            where = field if value else "hostname"
            value = value or self.hostname
            if value and (why := hostname_problem(value)):
                raise self.bad(where, why)
        if pretty:
            where = "pretty_hostname" if self.pretty_hostname else "hostname"
            if _CONTROL.search(pretty):
                raise self.bad(where, "must be one line of text, without control characters")
            if len(pretty.encode()) > PRETTY_MAX:
                raise self.bad(where, f"is longer than {PRETTY_MAX} bytes")

    def claims(self) -> list[str]:
        static, transient, pretty = self._names()
        keys = []
        if static:
            keys += ["hostname:static", f"file:{HOSTNAME_FILE}"]
        if transient:
            keys.append("hostname:transient")
        if pretty:
            keys.append("hostname:pretty")
        return keys

    def reversal(self) -> Hostname | None:
        static, transient, pretty = self._names()
        old_static = read_static(_read(HOSTNAME_FILE) or "") if static else ""
        old_pretty = read_pretty(_read(MACHINE_INFO) or "") if pretty else ""
        old_transient = socket.gethostname() if transient else ""
        if not (old_static or old_transient or old_pretty):
            return None
        return Hostname(
            name=self.name,
            static_hostname=old_static,
            transient_hostname=old_transient,
            pretty_hostname=old_pretty,
        )

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._bus: _Hostnamed | None = None
        self._bus_tried = False

    async def cleanup(self) -> None:
        if getattr(self, "_bus", None) is not None:
            assert self._bus is not None
            self._bus.close()
            self._bus = None

    def subscribe(self) -> Callable[[], None]:
        static, transient, pretty = self._names()
        subs: list[Callable[[], None]] = []
        event = self.handle.event
        if static:
            subs.append(self.handle.watcher.subscribe(HOSTNAME_FILE, lambda _m: event()))
        if pretty:
            subs.append(self.handle.watcher.subscribe(MACHINE_INFO, lambda _m: event()))
        if static or transient:
            # hostnamed sets the kernel's name with the static one
            try:
                subs.append(watch_pri(KERNEL_HOSTNAME, event))
            except OSError as e:
                for unsubscribe in subs:
                    unsubscribe()
                raise ResourceError(f"cannot watch {KERNEL_HOSTNAME}: {e}") from None

        def unsubscribe_all() -> None:
            for unsubscribe in subs:
                unsubscribe()

        return unsubscribe_all

    async def _hostnamed(self) -> _Hostnamed | None:
        """hostnamed on the system bus, or None (then the files are used)."""
        if self._bus is not None and not self._bus.connected:
            self._bus.close()
            self._bus, self._bus_tried = None, False  # the bus went away: look again
        if not self._bus_tried:
            self._bus_tried = True
            self._bus = await _Hostnamed.connect()
            self.handle.logger.debug(
                "%s: %s",
                self.ident,
                "through systemd-hostnamed" if self._bus else "no hostnamed: writing the files",
            )
        return self._bus

    async def check_apply(self, apply: bool) -> bool:
        static, transient, pretty = self._names()
        hostnamed = await self._hostnamed() if (static or pretty) else None
        try:
            clean = await self._files(apply, hostnamed, static, pretty)
        except ResourceError:
            if hostnamed is not None:  # (it may have gone: the next check looks again)
                hostnamed.close()
                self._bus, self._bus_tried = None, False
            raise
        if transient:
            clean = self._transient(apply, transient) and clean
        return clean

    async def _files(
        self, apply: bool, hostnamed: _Hostnamed | None, static: str, pretty: str
    ) -> bool:
        """The static and pretty names: through hostnamed, or in their files."""
        clean = True
        if static:
            if hostnamed is not None:
                now = await hostnamed.get("StaticHostname")
            else:
                now = read_static(_read(HOSTNAME_FILE) or "")
            if now != static:
                clean = False
                self.handle.changed("static_hostname", now or None, static)
                if apply:
                    if hostnamed is not None:
                        await hostnamed.set("SetStaticHostname", static)
                    else:
                        self._write_file(HOSTNAME_FILE, f"{static}\n")
                    self.handle.logger.info("%s: static hostname set to %s", self.ident, static)
        if pretty:
            if hostnamed is not None:
                now = await hostnamed.get("PrettyHostname")
            else:
                now = read_pretty(_read(MACHINE_INFO) or "")
            if now != pretty:
                clean = False
                self.handle.changed("pretty_hostname", now or None, pretty)
                if apply:
                    if hostnamed is not None:
                        await hostnamed.set("SetPrettyHostname", pretty)
                    else:
                        text = with_pretty(_read(MACHINE_INFO) or "", pretty)
                        self._write_file(MACHINE_INFO, text)
                    self.handle.logger.info("%s: pretty hostname set to %r", self.ident, pretty)
        return clean

    def _transient(self, apply: bool, transient: str) -> bool:
        now = socket.gethostname()
        if now == transient:
            return True
        self.handle.changed("transient_hostname", now, transient)
        if apply:
            try:
                socket.sethostname(transient)
            except OSError as e:
                raise os_error(f"sethostname {transient}", e) from None
            self.handle.logger.info("%s: transient hostname set to %s", self.ident, transient)
        return False

    def _write_file(self, path: str, text: str) -> None:
        try:
            _write(path, text)
        except OSError as e:
            raise os_error(f"cannot write {path}", e) from None
