"""svc: a systemd unit running or stopped, enabled or disabled at boot.

Talks to systemd over its D-Bus API (`org.freedesktop.systemd1`), on the
system bus, or with `session` on the bus of the agent user's own systemd
(`DBUS_SESSION_BUS_ADDRESS`, else `/run/user/<uid>/bus`). The resource's name
is the unit; without a known unit type suffix `.service` is added, as
systemctl does (`nginx` is `nginx.service`).

- `state: running` starts the unit (StartUnit, mode `replace`) and waits for
  its job to finish; `stopped` stops it. `active`/`reloading` count as
  running, `inactive`/`failed` as stopped. Empty: not managed.
- `startup: enabled` enables the unit file (EnableUnitFiles, then a daemon
  reload, as `systemctl enable` does); `disabled` disables it. Units that
  enabling cannot change (`static`, `generated`, `transient`) are accepted
  either way; a masked unit cannot be enabled (an error). Empty: not managed.
- A refresh (notify edge) reloads the unit if it can reload, else restarts
  it (ReloadOrRestartUnit) — unless it is to be stopped; with `state` empty
  only a running unit is touched (TryReloadOrRestartUnit).
- The watch follows the unit's PropertiesChanged signals, the manager's
  UnitFilesChanged and Reloading, and systemd's own restarts on the bus.

Where systemd's D-Bus API is not reachable (no bus, or no systemd on it),
the vertex fails at start with one line saying so; the rest of the graph
still runs, and the exit status is 1 (the machine, not the graph, is wrong).

All svc resources of an agent share one connection per bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from evergraph.engine.contract import Handle, Resource, doc, register
from evergraph.errors import ResourceError
from evergraph.resources._dbus import call as dbus_call

if TYPE_CHECKING:
    from dbus_fast import Message
    from dbus_fast.aio import MessageBus

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
PROPERTIES = "org.freedesktop.DBus.Properties"
DBUS = "org.freedesktop.DBus"

#: unit types systemd knows; any other suffix is part of a service's name
_UNIT_TYPES = frozenset(
    {"service", "socket", "target", "device", "mount", "automount"}
    | {"swap", "timer", "path", "slice", "scope"}
)
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\@-]+")
#: UnitFileState values: on at boot, and ones enable/disable cannot change
_ENABLED = frozenset({"enabled", "enabled-runtime", "alias"})
_FIXED = frozenset({"static", "generated", "transient"})
_MASKED = frozenset({"masked", "masked-runtime"})
_RUNNING = frozenset({"active", "reloading"})
_STOPPED = frozenset({"inactive", "failed"})
#: seconds to connect and authenticate before calling the bus unreachable
CONNECT_TIMEOUT = 10.0
#: seconds to wait for the answer to a call (libdbus's default), and to a daemon reload;
#: a job (start, stop) is waited for without a bound: `meta.timeout` sets one
CALL_TIMEOUT = 25.0
RELOAD_TIMEOUT = 120.0


def unit_name(name: str) -> str:
    """`nginx` -> `nginx.service`; a known type suffix is kept."""
    return name if name.rpartition(".")[2] in _UNIT_TYPES and "." in name else f"{name}.service"


def bus_address(session: bool) -> str:
    if session:
        return (
            os.environ.get("DBUS_SESSION_BUS_ADDRESS") or f"unix:path=/run/user/{os.getuid()}/bus"
        )
    return os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or "unix:path=/run/dbus/system_bus_socket"


class CallFailed(ResourceError):
    """systemd (or the bus) answered a call with an error; `name` is the D-Bus error name."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


class Unreachable(ResourceError):
    """systemd's D-Bus API cannot be reached (no bus, or no systemd on it)."""


def _unusable(fut: asyncio.Future[_Systemd]) -> bool:
    """A finished connection attempt that failed, or whose bus is gone since."""
    if not fut.done():
        return False
    return fut.cancelled() or fut.exception() is not None or fut.result().dead


class _Systemd:
    """One connection to systemd per bus address and event loop, shared by every svc.

    It dispatches signals: PropertiesChanged by unit object path, manager
    signals to everyone, JobRemoved to the caller waiting for that job.
    """

    _shared: ClassVar[dict[tuple[int, str], asyncio.Future[_Systemd]]] = {}

    def __init__(self, bus: MessageBus, key: tuple[int, str]) -> None:
        self.bus = bus
        self.key = key
        self.users = 0
        self._units: dict[str, list[Callable[[], None]]] = {}
        self._everyone: list[Callable[[], None]] = []
        self._jobs: dict[str, asyncio.Future[str]] = {}
        #: JobRemoved results that arrived before the job's caller asked for them
        self._finished: dict[str, str] = {}
        self._expecting = 0
        self.gone: asyncio.Future[None] = asyncio.ensure_future(
            bus.wait_for_disconnect()  # type: ignore[no-untyped-call]
        )
        self.gone.add_done_callback(self._lost)
        bus.add_message_handler(self._on_message)

    # -- sharing --------------------------------------------------------------
    @classmethod
    async def acquire_for(cls, session: bool) -> _Systemd:
        """`acquire`, with an unreachable bus as the resource's failure (one line)."""
        try:
            return await cls.acquire(session)
        except Unreachable as e:
            bus = "user" if session else "system"
            raise ResourceError(
                f"systemd's D-Bus API is not reachable on the {bus} bus: {e}"
            ) from None

    @classmethod
    async def acquire(cls, session: bool) -> _Systemd:
        address = bus_address(session)
        key = (id(asyncio.get_running_loop()), address)
        fut = cls._shared.get(key)
        if fut is None or _unusable(fut):
            fut = cls._shared[key] = asyncio.ensure_future(cls._connect(address, key))
            # retrieved even if every caller waiting for it was cancelled
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        if fut.done():
            sd = fut.result()  # without yielding: a release cannot slip in between
        else:
            try:
                sd = await asyncio.shield(fut)
            except BaseException:
                if cls._shared.get(key) is fut and fut.done():
                    del cls._shared[key]  # the next one tries again
                raise
        sd.users += 1
        return sd

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            fut = self._shared.get(self.key)
            if fut is not None and not _unusable(fut) and fut.result() is self:
                del self._shared[self.key]
            self.bus.disconnect()

    @property
    def dead(self) -> bool:
        return self.gone.done()

    @staticmethod
    def _lost(fut: asyncio.Future[None]) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved: a lost bus is reported by the watch

    @classmethod
    async def _connect(cls, address: str, key: tuple[int, str]) -> _Systemd:
        from dbus_fast import BusType
        from dbus_fast.aio import MessageBus

        where = address.removeprefix("unix:path=")
        bus = MessageBus(bus_address=address, bus_type=BusType.SYSTEM)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                await bus.connect()
        except TimeoutError:
            raise Unreachable(f"no answer from the bus at {where}") from None
        except OSError as e:
            raise Unreachable(f"no bus at {where} ({e.strerror or e})") from None
        except Exception as e:
            raise Unreachable(f"cannot connect to the bus at {where} ({e})") from None
        sd = cls(bus, key)
        try:
            # Asking for the owner does not activate a service (a call would).
            owned = await sd.call(DBUS, "/org/freedesktop/DBus", DBUS, "NameHasOwner", "s", SYSTEMD)
            if not owned.body[0]:
                raise Unreachable(f"the bus at {where} has no {SYSTEMD} (is systemd running?)")
            await sd._subscribe()
        except BaseException:
            bus.disconnect()
            raise
        return sd

    async def _subscribe(self) -> None:
        """Ask systemd for its signals and the bus for the ones we handle."""
        # by member: the manager also announces every unit loaded or unloaded
        for member in ("JobRemoved", "UnitFilesChanged", "Reloading"):
            await self.add_match(
                f"type='signal',sender='{SYSTEMD}',interface='{MANAGER}',"
                f"path='{MANAGER_PATH}',member='{member}'"
            )
        await self.add_match(
            f"type='signal',sender='{DBUS}',interface='{DBUS}',"
            f"member='NameOwnerChanged',arg0='{SYSTEMD}'"
        )
        await self._subscribe_manager()

    async def _subscribe_manager(self) -> None:
        # Without a subscriber systemd sends no job or unit signals. After its
        # bus restarted, systemd may still know our (reused) name: fine too.
        try:
            await self.call(SYSTEMD, MANAGER_PATH, MANAGER, "Subscribe")
        except CallFailed as e:
            if e.name != "org.freedesktop.systemd1.AlreadySubscribed":
                raise

    async def add_match(self, rule: str) -> None:
        await self.call(DBUS, "/org/freedesktop/DBus", DBUS, "AddMatch", "s", rule)

    def remove_match(self, rule: str) -> None:
        """Without waiting for the answer: called while a watch is being cancelled."""
        from dbus_fast import Message, MessageFlag

        if self.dead:
            return
        msg = Message(
            destination=DBUS,
            path="/org/freedesktop/DBus",
            interface=DBUS,
            member="RemoveMatch",
            signature="s",
            body=[rule],
            flags=MessageFlag.NO_REPLY_EXPECTED,
        )
        with contextlib.suppress(Exception):
            sent = self.bus.send(msg)
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    # -- calls ----------------------------------------------------------------
    async def call(
        self,
        dest: str,
        path: str,
        iface: str,
        member: str,
        signature: str = "",
        *body: Any,
        timeout: float = CALL_TIMEOUT,
    ) -> Message:
        from dbus_fast import MessageType

        reply = await dbus_call(self.bus, dest, path, iface, member, signature, body, timeout)
        if reply.message_type is MessageType.ERROR:
            detail = reply.body[0] if reply.body else ""
            raise CallFailed(f"{member}: {detail or reply.error_name}", reply.error_name or "")
        return reply

    async def manager(
        self, member: str, signature: str = "", *body: Any, timeout: float = CALL_TIMEOUT
    ) -> Message:
        return await self.call(
            SYSTEMD, MANAGER_PATH, MANAGER, member, signature, *body, timeout=timeout
        )

    async def unit_path(self, unit: str) -> str:
        """The unit's object path; LoadUnit (unlike GetUnit) works for unloaded units."""
        reply = await self.manager("LoadUnit", "s", unit)
        return str(reply.body[0])

    async def unit_property(self, path: str, name: str) -> str:
        reply = await self.call(SYSTEMD, path, PROPERTIES, "Get", "ss", UNIT, name)
        return str(reply.body[0].value)

    async def job(self, member: str, unit: str, mode: str = "replace") -> str:
        """Queue a job (StartUnit, StopUnit, ...) and wait until it finished; its result."""
        loop = asyncio.get_running_loop()
        self._expecting += 1
        try:
            reply = await self.manager(member, "ss", unit, mode)
            job = str(reply.body[0])
            result = self._finished.pop(job, None)
            if result is not None:
                return result
            fut: asyncio.Future[str] = loop.create_future()
            self._jobs[job] = fut
            try:
                waits: list[asyncio.Future[Any]] = [fut, self.gone]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._jobs.pop(job, None)
            if not fut.done():
                raise ResourceError(f"lost the bus while waiting for {member} {unit}")
            return fut.result()
        finally:
            self._expecting -= 1
            if not self._expecting:
                self._finished.clear()

    # -- signals --------------------------------------------------------------
    def on_unit(self, path: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` on any change of the unit or of systemd; returns the unsubscribe."""
        self._units.setdefault(path, []).append(callback)
        self._everyone.append(callback)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._units.get(path, []).remove(callback)
            with contextlib.suppress(ValueError):
                self._everyone.remove(callback)
            if not self._units.get(path):
                self._units.pop(path, None)

        return unsubscribe

    def _on_message(self, msg: Message) -> None:
        from dbus_fast import MessageType

        if msg.message_type is not MessageType.SIGNAL:
            return
        if msg.interface == PROPERTIES and msg.member == "PropertiesChanged":
            for cb in list(self._units.get(msg.path or "", ())):
                cb()
        elif msg.interface == MANAGER:
            if msg.member == "JobRemoved":
                _id, job, _unit, result = msg.body
                fut = self._jobs.pop(job, None)
                if fut is not None and not fut.done():
                    fut.set_result(result)
                elif self._expecting:
                    self._finished[job] = result
            elif msg.member in ("UnitFilesChanged", "Reloading"):
                self._tell_everyone()
        elif msg.interface == DBUS and msg.member == "NameOwnerChanged":
            if msg.body[0] == SYSTEMD and msg.body[2]:
                # systemd re-executed: it forgot our subscription
                task = asyncio.ensure_future(self._resubscribe())
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._tell_everyone()

    async def _resubscribe(self) -> None:
        await self._subscribe_manager()
        self._tell_everyone()

    def _tell_everyone(self) -> None:
        for cb in list(self._everyone):
            cb()


@register("svc")
class Svc(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    """A systemd unit (the name; `.service` if no type is given): running, enabled."""

    state: Annotated[
        Literal["running", "stopped", ""], doc("`running` or `stopped`; empty = not managed")
    ] = ""
    startup: Annotated[
        Literal["enabled", "disabled", ""],
        doc("`enabled` or `disabled` at boot; empty = not managed"),
    ] = ""
    session: Annotated[
        bool, doc("the agent user's own systemd (user bus) instead of the system's")
    ] = False

    def validate(self) -> None:
        if len(self.name) > 255 or not _UNIT_NAME.fullmatch(self.name):
            raise self.bad("name", f"{self.name!r} is not a systemd unit name")
        if self.name.startswith(".") or self.name.endswith("."):
            raise self.bad("name", f"{self.name!r} is not a systemd unit name")

    def claims(self) -> list[str]:
        # `nginx` and `nginx.service` are one unit
        return [f"svc:{'session' if self.session else 'system'}:{unit_name(self.name)}"]

    def autoedge_wants(self) -> list[list[str]]:
        unit = unit_name(self.name)
        dirs = (
            ["/etc/systemd/user"]
            if self.session
            else ["/etc/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system"]
        )
        return [[f"path:{d}/{unit}" for d in dirs]]

    async def init(self, handle: Handle) -> None:
        await super().init(handle)
        self._unit = unit_name(self.name)
        self._sd: _Systemd | None = None
        self._sd = await _Systemd.acquire_for(self.session)

    async def _systemd(self) -> _Systemd:
        """The shared connection; a new one if the bus went away since."""
        sd = self._sd
        if sd is not None and not sd.dead:
            return sd
        if sd is not None:
            self._sd = None
            sd.release()
        fresh = await _Systemd.acquire(self.session)
        if self._sd is not None:  # the watch and a check reconnected at once
            fresh.release()
            return self._sd
        self._sd = fresh
        return fresh

    async def cleanup(self) -> None:
        if getattr(self, "_sd", None) is not None:
            assert self._sd is not None
            self._sd.release()
            self._sd = None

    async def watch(self) -> None:
        sd = await self._systemd()
        path = await sd.unit_path(self._unit)
        rule = (
            f"type='signal',sender='{SYSTEMD}',interface='{PROPERTIES}',"
            f"member='PropertiesChanged',path='{path}'"
        )
        await sd.add_match(rule)
        unsubscribe = sd.on_unit(path, self.handle.event)
        try:
            self.handle.ready()
            # After a lost bus the unit may have changed unseen: look again. (At
            # start-up the vertex is pending anyway, so this costs nothing.)
            self.handle.event()
            with contextlib.suppress(Exception):  # how it ended does not matter
                await asyncio.shield(sd.gone)
            raise ResourceError("lost the connection to systemd's D-Bus API")
        finally:
            unsubscribe()
            sd.remove_match(rule)

    async def check_apply(self, apply: bool) -> bool:
        sd = await self._systemd()
        unit = self._unit
        path = await sd.unit_path(unit)
        load = await sd.unit_property(path, "LoadState")
        clean = True
        if self.startup:
            file_state = await sd.unit_property(path, "UnitFileState")
            want = self.startup == "enabled"
            if want and (load == "not-found" or not file_state):
                raise ResourceError(f"{unit}: no such unit file: cannot enable it")
            if want and file_state in _MASKED:
                raise ResourceError(f"{unit} is masked: cannot enable it")
            settled = file_state in _FIXED or (not want and file_state in _MASKED)
            if not settled and (file_state in _ENABLED) != want:
                clean = False
                self.handle.changed("startup", file_state, self.startup)
                if apply:  # (noop goes on: what else would change is reported too)
                    await self._enable(sd, want)
        refresh = self.handle.refresh()
        started = False
        if self.state:
            active = await sd.unit_property(path, "ActiveState")
            want_run = self.state == "running"
            if want_run and load == "not-found":
                raise ResourceError(f"{unit}: no such unit: cannot start it")
            if active not in (_RUNNING if want_run else _STOPPED):
                clean = False
                self.handle.changed("state", active, self.state)
                if apply:
                    verb = "StartUnit" if want_run else "StopUnit"
                    await self._job(sd, verb, "started" if want_run else "stopped")
                started = want_run
        # A unit started just now runs the new configuration already; with
        # `state` empty only a running unit is reloaded.
        if refresh and not started and await self._refreshable(sd, path):
            self.handle.changed("refresh", None, "reload or restart")
            if apply:
                verb = "ReloadOrRestartUnit" if self.state else "TryReloadOrRestartUnit"
                await self._job(sd, verb, "reloaded or restarted (refresh)")
            clean = False
        return clean

    async def _refreshable(self, sd: _Systemd, path: str) -> bool:
        if self.state == "stopped":
            return False
        return self.state == "running" or await sd.unit_property(path, "ActiveState") in _RUNNING

    async def _enable(self, sd: _Systemd, on: bool) -> None:
        unit = self._unit
        if on:
            await sd.manager("EnableUnitFiles", "asbb", [unit], False, True)
        else:
            await sd.manager("DisableUnitFiles", "asb", [unit], False)
        # as `systemctl enable` does: load the new links (a big system takes a while)
        await sd.manager("Reload", timeout=RELOAD_TIMEOUT)
        self.handle.logger.info("%s: %s %s", self.ident, "enabled" if on else "disabled", unit)

    async def _job(self, sd: _Systemd, verb: str, done: str) -> None:
        result = await sd.job(verb, self._unit)
        if result != "done":
            raise ResourceError(
                f"{verb} {self._unit}: job {result} (see `journalctl -u {self._unit}`)"
            )
        self.handle.logger.info("%s: %s %s", self.ident, done, self._unit)
