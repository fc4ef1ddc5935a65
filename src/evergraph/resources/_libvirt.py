"""The libvirt connections the virt kind shares: one per URI per agent.

`LibvirtLinks` is a service (`handle.services.get(LibvirtLinks)`): it keeps one
`Link` per URI, shared by every virt resource on that URI (mgmt opens two per
resource), and closes them when the agent closes it. A link delivers libvirt's
domain lifecycle events to the resources that subscribed to a domain's name,
and when libvirtd goes away (its close callback) it reconnects by itself with
a doubling backoff and then tells every subscriber to look again: the
resources recover without a restart of the agent.

libvirt's event loop is per process: `virEventRegisterDefaultImpl` once, and a
thread looping `virEventRunDefaultImpl` while any link is open (`_EventThread`,
started by the first link, stopped after the last). Its callbacks hop to the
agent's asyncio loop with `call_soon_threadsafe`. libvirt's calls block: each
runs in a worker thread (`Link.call`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import libvirt

from evergraph.errors import ResourceError

T = TypeVar("T")

log = logging.getLogger("evergraph.resources.virt")

#: seconds between reconnection attempts: the first, doubling up to the last
BACKOFF_FIRST = 0.2
BACKOFF_MAX = 5.0
#: seconds a call waits for a lost connection to come back before it fails
CALL_WAIT = 30.0

#: ids of libvirt's lifecycle events, by name (for the logs)
LIFECYCLE = {
    0: "defined",
    1: "undefined",
    2: "started",
    3: "suspended",
    4: "resumed",
    5: "stopped",
    6: "shutdown",
    7: "pmsuspended",
    8: "crashed",
}

#: a reason of our own: a call found the connection closed before libvirt's callback came
FOUND_CLOSED = -1
#: why libvirt closed a connection (its close callback's reason), for the logs
CLOSE_REASONS = {
    libvirt.VIR_CONNECT_CLOSE_REASON_ERROR: "a socket error",
    libvirt.VIR_CONNECT_CLOSE_REASON_EOF: "end of file (libvirtd closed it, or ended)",
    libvirt.VIR_CONNECT_CLOSE_REASON_KEEPALIVE: "keepalive timeout (libvirtd did not answer)",
    libvirt.VIR_CONNECT_CLOSE_REASON_CLIENT: "closed by the client",
    FOUND_CLOSED: "found closed by a call (libvirtd closed it, or ended)",
}

# libvirt prints every error on stderr besides raising it: we report them ourselves
libvirt.registerErrorHandler(lambda _ctx, _err: None, None)


class _EventThread:
    """libvirt's default event loop, run by one daemon thread while it has users."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registered = False
        self._users = 0
        self._thread: threading.Thread | None = None
        self._stop = False

    def acquire(self) -> None:
        with self._lock:
            if not self._registered:
                libvirt.virEventRegisterDefaultImpl()  # before any connection is opened
                self._registered = True
            self._users += 1
            if self._thread is None:
                self._stop = False
                self._thread = threading.Thread(
                    target=self._run, name="libvirt-events", daemon=True
                )
                self._thread.start()

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users > 0 or self._thread is None:
                return
            thread, self._thread = self._thread, None
            self._stop = True
        # wake the loop: a timer that fires at once (and removes itself)
        libvirt.virEventAddTimeout(0, lambda timer, _o: libvirt.virEventRemoveTimeout(timer), None)
        thread.join(10)

    def _run(self) -> None:
        while not self._stop:
            if libvirt.virEventRunDefaultImpl() < 0:
                log.warning("libvirt's event loop failed an iteration")


#: the process's one event loop thread (libvirt's event implementation is global)
EVENTS = _EventThread()


def _domain_name(dom: Any) -> str | None:
    with contextlib.suppress(libvirt.libvirtError):
        name: str = dom.name()
        return name
    return None


class Link:
    """One connection to a libvirt URI, shared; reconnected when it is lost."""

    def __init__(self, uri: str, owner: LibvirtLinks, auth: tuple[str, str] | None) -> None:
        self.uri = uri
        self._auth = auth
        self._owner = owner
        self._loop = asyncio.get_running_loop()
        self.conn: Any = None  # libvirt.virConnect while connected
        self._connected = asyncio.Event()
        self._subs: dict[str, list[Callable[[], None]]] = {}
        self._everyone: list[Callable[[], None]] = []
        self._reconnecting: asyncio.Future[None] | None = None
        self._closed = False
        #: connections opened so far (1 + reconnections): the tests count them
        self.opened = 0
        #: why the connection was last lost (for the errors of the calls it failed)
        self.lost_why = "connection lost"

    # -- connecting ------------------------------------------------------------------
    async def connect(self) -> None:
        """Open the connection (raises libvirt.libvirtError if it cannot)."""
        conn = await asyncio.to_thread(self._open)
        if self._closed:
            await asyncio.to_thread(_close, conn)
            return
        self.conn = conn
        self.opened += 1
        self._connected.set()

    def _open(self) -> Any:
        if self._auth is None:
            conn = libvirt.open(self.uri)
        else:
            user, password = self._auth

            def answer(creds: list[list[Any]], _o: Any) -> int:
                for cred in creds:
                    if cred[0] == libvirt.VIR_CRED_AUTHNAME:
                        cred[4] = user
                    elif cred[0] == libvirt.VIR_CRED_PASSPHRASE:
                        cred[4] = password
                return 0

            asked = [libvirt.VIR_CRED_AUTHNAME, libvirt.VIR_CRED_PASSPHRASE]
            conn = libvirt.openAuth(self.uri, [asked, answer, None], 0)
        try:
            conn.evergraph_callback = conn.domainEventRegisterAny(
                None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, self._on_lifecycle, None
            )
            conn.registerCloseCallback(self._on_close, None)
        except BaseException:
            _close(conn)
            raise
        return conn

    def _on_lifecycle(self, _conn: Any, dom: Any, event: int, detail: int, _o: Any) -> None:
        # on libvirt's event thread
        name = _domain_name(dom)
        if name is not None and not self._closed:
            self._soon(self._dispatch, name, event)

    def _on_close(self, conn: Any, reason: int, _o: Any) -> None:
        if not self._closed:
            self._soon(self._lost, conn, reason)

    def _soon(self, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` on the agent's loop, from libvirt's event thread; nothing once
        that loop has closed (an event in flight as the agent stops)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            pass

    def _dispatch(self, name: str, event: int) -> None:
        log.debug("libvirt %s: domain %s %s", self.uri, name, LIFECYCLE.get(event, event))
        for cb in list(self._subs.get(name, ())):
            cb()

    def _lost(self, conn: Any, reason: int) -> None:
        if conn is not self.conn or self._closed:
            return
        self.lost_why = f"connection lost: {CLOSE_REASONS.get(reason, reason)}"
        log.warning("libvirt %s: %s: reconnecting", self.uri, self.lost_why)
        self.conn = None
        self._connected.clear()
        self._owner.spawn(asyncio.to_thread(_close, conn))
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = self._owner.spawn(self._reconnect())

    async def _reconnect(self) -> None:
        delay = BACKOFF_FIRST
        while not self._closed:
            try:
                await self.connect()
            except libvirt.libvirtError as e:
                log.debug("libvirt %s: reconnecting failed: %s", self.uri, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            log.info("libvirt %s: reconnected", self.uri)
            for cb in [*self._everyone, *(c for cbs in self._subs.values() for c in cbs)]:
                cb()  # anything may have changed while we were away
            return

    # -- what resources use ----------------------------------------------------------
    def subscribe(self, name: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` on every lifecycle event of domain `name`, and after a
        reconnection. Returns the unsubscribe."""
        self._subs.setdefault(name, []).append(callback)

        def unsubscribe() -> None:
            cbs = self._subs.get(name, [])
            with contextlib.suppress(ValueError):
                cbs.remove(callback)
            if not cbs:
                self._subs.pop(name, None)

        return unsubscribe

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(conn, *args)` in a worker thread; waits (a while) for a lost connection
        to come back first. A call that found the connection already closed (it was
        never sent: libvirt checks before it writes) is made again, once, on the
        new connection. libvirt's errors are ResourceErrors (one line)."""
        for attempt in (1, 2):
            if self.conn is None:
                try:
                    await asyncio.wait_for(self._connected.wait(), CALL_WAIT)
                except TimeoutError:
                    raise ResourceError(
                        f"libvirt {self.uri}: not connected (reconnecting for {CALL_WAIT:g} s"
                        f" after {self.lost_why})"
                    ) from None
            conn = self.conn
            try:
                return await asyncio.to_thread(fn, conn, *args)
            except libvirt.libvirtError as e:
                if attempt == 1 and _never_sent(e) and not self._closed:
                    # the close callback may still be on its way: reconnect now
                    self._lost(conn, FOUND_CLOSED)
                    continue
                why = f" ({self.lost_why})" if _never_sent(e) else ""
                raise ResourceError(f"libvirt {self.uri}: {one_line(e)}{why}") from None
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self._closed = True
        conn, self.conn = self.conn, None
        if conn is not None:
            await asyncio.to_thread(_close, conn)


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _never_sent(e: libvirt.libvirtError) -> bool:
    """libvirt refused the call before sending it: its connection was already
    closed (the server's side went away; the call did nothing there)."""
    return (
        e.get_error_code() == libvirt.VIR_ERR_INTERNAL_ERROR and "client socket is closed" in str(e)
    )


def _close(conn: Any) -> None:
    with contextlib.suppress(libvirt.libvirtError):
        conn.unregisterCloseCallback()
    callback = getattr(conn, "evergraph_callback", None)
    if callback is not None:
        with contextlib.suppress(libvirt.libvirtError):
            conn.domainEventDeregisterAny(callback)
    with contextlib.suppress(libvirt.libvirtError):
        conn.close()


class LibvirtLinks:
    """A service: one `Link` per URI for every virt resource of the agent; it owns the
    links' tasks (reconnecting) and closes them, and releases the event thread."""

    def __init__(self) -> None:
        self._links: dict[tuple[str, tuple[str, str] | None], asyncio.Future[Link]] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        self._events = False

    def spawn(self, aw: Any) -> asyncio.Future[Any]:
        task: asyncio.Future[Any] = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def acquire(self, uri: str, auth: tuple[str, str] | None = None) -> Link:
        """The shared link to `uri` (with these credentials), connected
        (libvirt.libvirtError if it cannot be)."""
        fut = self._links.get((uri, auth))
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            if not self._events:
                EVENTS.acquire()
                self._events = True
            fut = self._links[uri, auth] = self.spawn(self._open(uri, auth))
        return await asyncio.shield(fut)

    async def _open(self, uri: str, auth: tuple[str, str] | None) -> Link:
        link = Link(uri, self, auth)
        await link.connect()
        return link

    def links(self) -> dict[str, Link]:
        """The links open now, by URI."""
        return {
            uri: f.result()
            for (uri, _auth), f in self._links.items()
            if f.done() and not f.cancelled() and f.exception() is None
        }

    async def aclose(self) -> None:
        links = self.links()
        for task in list(self._tasks):
            task.cancel()
        for link in links.values():
            link._closed = True
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        for link in links.values():
            await link.aclose()
        self._links.clear()
        if self._events:
            self._events = False
            await asyncio.to_thread(EVENTS.release)
