"""PackageKit over D-Bus for the pkg kind: Resolve, then one transaction per change.

Talks to org.freedesktop.PackageKit on the system bus with plain messages
(no introspection round trips): CreateTransaction, then one method on the new
transaction object, collecting its Package/ErrorCode signals until Finished.
Root needs no polkit agent; bus activation starts packagekitd on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus

from evergraph.errors import ResourceError
from evergraph.resources._dpkg import Found, base_name, compare_versions

PK = "org.freedesktop.PackageKit"
PK_PATH = "/org/freedesktop/PackageKit"
TX = "org.freedesktop.PackageKit.Transaction"
SYSTEM_SOCKET = "/run/dbus/system_bus_socket"

# enum values from PackageKit's pk-enum.h; bitfields are 1 << value
INFO_INSTALLED = 1
INFO_AVAILABLE = 2
EXIT_SUCCESS = 1
EXIT_GONE = -1  # ours: the transaction vanished without Finished
FLAG_ONLY_TRUSTED = 1 << 1
FLAG_ALLOW_DOWNGRADE = 1 << 6


def system_bus_present() -> bool:
    """Whether a system bus may be listening (its address is set or its socket exists)."""
    return bool(os.environ.get("DBUS_SYSTEM_BUS_ADDRESS")) or os.path.exists(SYSTEM_SOCKET)


@dataclass
class _Resolved:
    installed: list[str] = field(default_factory=list)  # package ids
    available: list[str] = field(default_factory=list)


def _version(package_id: str) -> str:
    return package_id.split(";")[1] if package_id.count(";") >= 3 else ""


def _arch(package_id: str) -> str:
    return package_id.split(";")[2] if package_id.count(";") >= 3 else ""


class PackageKit:
    """One connection to the system bus, opened by `connect` (raises if PackageKit is not there)."""

    name = "packagekit"

    def __init__(self, bus: MessageBus) -> None:
        self._bus = bus
        self._resolved: dict[str, _Resolved] = {}

    @classmethod
    async def connect(cls, timeout: float) -> PackageKit:
        """Connect and ask PackageKit its version (activating it if needed) within `timeout`."""
        bus: MessageBus | None = None
        try:
            async with asyncio.timeout(timeout):
                bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
                reply = await bus.call(
                    Message(
                        destination=PK,
                        path=PK_PATH,
                        interface="org.freedesktop.DBus.Properties",
                        member="Get",
                        signature="ss",
                        body=[PK, "VersionMajor"],
                    )
                )
        except BaseException:
            if bus is not None:
                bus.disconnect()
            raise
        if reply.message_type != MessageType.METHOD_RETURN:
            bus.disconnect()
            raise ResourceError(f"PackageKit does not answer: {reply.error_name} {reply.body}")
        return cls(bus)

    def alive(self) -> bool:
        return bool(self._bus.connected)

    def close(self) -> None:
        self._bus.disconnect()

    # -- backend interface -------------------------------------------------------
    async def query(self, names: Sequence[str], candidates: bool) -> dict[str, Found]:
        """One Resolve for all names: installed versions and the best available one."""
        resolved = await self._resolve(names)
        # merged, not replaced: vertices of other names may query in between
        self._resolved.update(resolved)
        found: dict[str, Found] = {}
        for name in names:
            r = resolved.get(name, _Resolved())
            installed = _version(r.installed[0]) if r.installed else None
            best = installed
            for pid in r.available:
                v = _version(pid)
                if best is None or compare_versions(v, best) > 0:
                    best = v
            found[name] = Found(installed, best)
        return found

    async def change(
        self,
        install: Sequence[tuple[str, str | None]],
        remove: Sequence[str],
        allowuntrusted: bool,
    ) -> list[str]:
        """Install (name, version or None = best) and remove; one transaction per method."""
        resolved = self._resolved
        flags = 0 if allowuntrusted else FLAG_ONLY_TRUSTED
        fresh: list[str] = []  # not installed: InstallPackages
        upgrade: list[str] = []  # installed, to a newer version: UpdatePackages
        downgrade: list[str] = []  # installed, to an older version: InstallPackages + flag
        for name, version in install:
            r = resolved.get(name, _Resolved())
            pid = self._target(name, version, r)
            if not r.installed:
                fresh.append(pid)
            elif compare_versions(_version(pid), _version(r.installed[0])) > 0:
                upgrade.append(pid)
            else:
                downgrade.append(pid)
        removing = []
        for name in remove:
            r = resolved.get(name, _Resolved())
            removing.extend(r.installed[:1])
        done: list[str] = []
        if fresh:
            await self._transaction("InstallPackages", "tas", [flags, fresh])
            done.append("PackageKit InstallPackages " + " ".join(fresh))
        if downgrade:
            flags_down = flags | FLAG_ALLOW_DOWNGRADE
            await self._transaction("InstallPackages", "tas", [flags_down, downgrade])
            done.append("PackageKit InstallPackages (downgrade) " + " ".join(downgrade))
        if upgrade:
            await self._transaction("UpdatePackages", "tas", [flags, upgrade])
            done.append("PackageKit UpdatePackages " + " ".join(upgrade))
        if removing:
            await self._transaction("RemovePackages", "tasbb", [flags, removing, False, False])
            done.append("PackageKit RemovePackages " + " ".join(removing))
        return done

    @staticmethod
    def _target(name: str, version: str | None, r: _Resolved) -> str:
        known = [*r.available, *r.installed]
        if version is None:
            if not r.available:
                raise ResourceError(f"{name}: PackageKit finds no package to install")
            return max(r.available, key=_VersionKey)
        for pid in known:
            if _version(pid) == version:
                return pid
        # Resolve lists only the candidate; PackageKit's apt backend finds any
        # version by name;version;arch (the data part may stay empty).
        arch = _arch(known[0]) if known else ""
        if not arch:
            raise ResourceError(f"{name}: PackageKit finds no package to install")
        return f"{base_name(name)};{version};{arch};"

    # -- D-Bus -------------------------------------------------------------------
    async def _resolve(self, names: Sequence[str]) -> dict[str, _Resolved]:
        packages = await self._transaction("Resolve", "tas", [0, list(names)])
        by_base: dict[str, _Resolved] = {}
        for info, pid in packages:
            r = by_base.setdefault(pid.split(";", 1)[0], _Resolved())
            if info == INFO_INSTALLED and pid not in r.installed:
                r.installed.append(pid)
            elif info == INFO_AVAILABLE and pid not in r.available:
                r.available.append(pid)
        out: dict[str, _Resolved] = {}
        for name in names:
            base, _, arch = name.partition(":")
            r = by_base.get(base, _Resolved())
            if arch:
                r = _Resolved(
                    [p for p in r.installed if _arch(p) == arch],
                    [p for p in r.available if _arch(p) == arch],
                )
            out[name] = r
        return out

    async def _call(self, msg: Message) -> Message:
        reply = await self._bus.call(msg)
        if reply.message_type == MessageType.ERROR:
            raise ResourceError(f"PackageKit {msg.member}: {reply.error_name}: {reply.body}")
        return reply

    async def _transaction(
        self, method: str, signature: str, body: list[Any]
    ) -> list[tuple[int, str]]:
        """Run one transaction; the (info, package_id) it reported. Raises on failure."""
        reply = await self._call(
            Message(destination=PK, path=PK_PATH, interface=PK, member="CreateTransaction")
        )
        tid: str = reply.body[0]
        rules = [
            f"type='signal',sender='{PK}',interface='{TX}',path='{tid}'",
            # packagekitd dying mid-transaction would never send Finished
            f"type='signal',sender='org.freedesktop.DBus',member='NameOwnerChanged',arg0='{PK}'",
        ]
        packages: list[tuple[int, str]] = []
        errors: list[str] = []
        finished: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_message(msg: Message) -> None:
            if msg.message_type != MessageType.SIGNAL or finished.done():
                return
            if msg.member == "NameOwnerChanged" and msg.body and msg.body[0] == PK:
                if not msg.body[2]:
                    errors.append("packagekitd left the bus")
                    finished.set_result(EXIT_GONE)
                return
            if msg.path != tid:
                return
            if msg.member == "Package":
                packages.append((int(msg.body[0]), str(msg.body[1])))
            elif msg.member == "Packages":  # newer daemons batch them
                packages.extend((int(i), str(p)) for i, p, _summary in msg.body[0])
            elif msg.member == "ErrorCode":
                errors.append(str(msg.body[1]))
            elif msg.member == "Finished":
                finished.set_result(int(msg.body[0]))
            elif msg.member == "Destroy":
                finished.set_result(EXIT_GONE)

        self._bus.add_message_handler(on_message)
        try:
            for rule in rules:
                await self._dbus("AddMatch", rule)
            await self._call(
                Message(
                    destination=PK,
                    path=tid,
                    interface=TX,
                    member=method,
                    signature=signature,
                    body=body,
                )
            )
            code = await finished
        except asyncio.CancelledError:
            # stop the daemon's work too; do not wait for it
            self._send(Message(destination=PK, path=tid, interface=TX, member="Cancel"))
            raise
        finally:
            self._bus.remove_message_handler(on_message)
            for rule in rules:
                self._send(
                    Message(
                        destination="org.freedesktop.DBus",
                        path="/org/freedesktop/DBus",
                        interface="org.freedesktop.DBus",
                        member="RemoveMatch",
                        signature="s",
                        body=[rule],
                    )
                )
        if code != EXIT_SUCCESS:
            why = "; ".join(errors) or f"exit code {code}"
            raise ResourceError(f"PackageKit {method} failed: {why}")
        return packages

    def _send(self, msg: Message) -> None:
        """Fire and forget (clean-up on the way out): a broken bus is not our error here."""
        if not self._bus.connected:
            return
        with contextlib.suppress(Exception):
            sent = self._bus.send(msg)
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _dbus(self, member: str, arg: str) -> None:
        await self._call(
            Message(
                destination="org.freedesktop.DBus",
                path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus",
                member=member,
                signature="s",
                body=[arg],
            )
        )


class _VersionKey:
    """Sort package ids by Debian version."""

    __slots__ = ("v",)

    def __init__(self, package_id: str) -> None:
        self.v = _version(package_id)

    def __lt__(self, other: _VersionKey) -> bool:
        return compare_versions(self.v, other.v) < 0
