"""The systemd D-Bus client the svc and cron kinds share: one connection per bus
(system, or the agent user's own with `session`), a service the agent owns
(`SystemdBuses`), with calls, jobs waited for to their end, and the unit and
manager signals dispatched to the watches that asked for them."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from evergraph.errors import ResourceError
from evergraph.resources._dbus import call as dbus_call

if TYPE_CHECKING:
    from dbus_fast import Message
    from dbus_fast.aio import MessageBus

T = TypeVar("T")

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
#: UnitFileState values: on at boot, and ones enable/disable cannot change
ENABLED = frozenset({"enabled", "enabled-runtime", "alias"})
FIXED = frozenset({"static", "generated", "transient"})
MASKED = frozenset({"masked", "masked-runtime"})
RUNNING = frozenset({"active", "reloading"})
STOPPED = frozenset({"inactive", "failed"})
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


def _unusable(fut: asyncio.Future[Systemd]) -> bool:
    """A finished connection attempt that failed, or whose bus is gone since."""
    if not fut.done():
        return False
    return fut.cancelled() or fut.exception() is not None or fut.result().dead


class SystemdBuses:
    """A service (`handle.services.get(SystemdBuses)`): one connection to systemd per
    bus address, shared by every svc and cron resource of the agent; it owns the
    tasks of its connections (connecting, waiting for a disconnect, resubscribing)
    and ends them, and the connections, when the agent closes it."""

    def __init__(self) -> None:
        self._shared: dict[str, asyncio.Future[Systemd]] = {}
        self._tasks: set[asyncio.Future[Any]] = set()

    def spawn(self, aw: Awaitable[T]) -> asyncio.Future[T]:
        """A task of ours: kept until it ends, its exception retrieved (reported by
        whoever awaits it), cancelled by `aclose`."""
        task = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def acquire_for(self, session: bool) -> Systemd:
        """`acquire`, with an unreachable bus as the resource's failure (one line)."""
        try:
            return await self.acquire(session)
        except Unreachable as e:
            bus = "user" if session else "system"
            raise ResourceError(
                f"systemd's D-Bus API is not reachable on the {bus} bus: {e}"
            ) from None

    async def acquire(self, session: bool) -> Systemd:
        """The shared connection on the system (or session) bus: `release()` it."""
        address = bus_address(session)
        fut = self._shared.get(address)
        if fut is None or _unusable(fut):
            fut = self._shared[address] = self.spawn(Systemd.connect(address, self))
        if fut.done():
            sd = fut.result()  # without yielding: a release cannot slip in between
        else:
            try:
                sd = await asyncio.shield(fut)
            except BaseException:
                if self._shared.get(address) is fut and fut.done():
                    del self._shared[address]  # the next one tries again
                raise
        sd.users += 1
        return sd

    def _released(self, sd: Systemd) -> None:
        fut = self._shared.get(sd.address)
        if fut is not None and not _unusable(fut) and fut.result() is sd:
            del self._shared[sd.address]
        sd.bus.disconnect()

    async def aclose(self) -> None:
        for fut in self._shared.values():
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().bus.disconnect()
        self._shared.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))


class Systemd:
    """One connection to systemd (see SystemdBuses).

    It dispatches signals: PropertiesChanged by unit object path, manager
    signals to everyone, JobRemoved to the caller waiting for that job.
    """

    def __init__(self, bus: MessageBus, address: str, owner: SystemdBuses) -> None:
        self.bus = bus
        self.address = address
        self.owner = owner
        self.users = 0
        self._units: dict[str, list[Callable[[], None]]] = {}
        self._everyone: list[Callable[[], None]] = []
        self._jobs: dict[str, asyncio.Future[str]] = {}
        #: JobRemoved results that arrived before the job's caller asked for them
        self._finished: dict[str, str] = {}
        self._expecting = 0
        self.gone: asyncio.Future[None] = owner.spawn(
            bus.wait_for_disconnect()  # type: ignore[no-untyped-call]
        )
        bus.add_message_handler(self._on_message)

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.owner._released(self)

    @property
    def dead(self) -> bool:
        return self.gone.done()

    @classmethod
    async def connect(cls, address: str, owner: SystemdBuses) -> Systemd:
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
        sd = cls(bus, address, owner)
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
                self.owner.spawn(self._resubscribe())
            self._tell_everyone()

    async def _resubscribe(self) -> None:
        await self._subscribe_manager()
        self._tell_everyone()

    def _tell_everyone(self) -> None:
        for cb in list(self._everyone):
            cb()
