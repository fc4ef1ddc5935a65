"""Serving an ASGI app inside the agent's event loop, as one of its services.

The socket is bound here, before uvicorn sees it, so a bad or taken address is
an input error naming `--http` (uvicorn itself would log and `sys.exit(1)`).
`--http-socket PATH` serves the same app on a Unix socket too: each connection's
peer is read with SO_PEERCRED when it is accepted, and its uid reaches the app as
`request.scope["state"][PEER_UID]` (never set for a TCP connection), so that a
connection from root needs no token for what only admins may read.
uvicorn's own signal handling is switched off: the agent owns SIGINT/SIGTERM,
and cancelling the service stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

from evergraph.errors import InputError
from evergraph.http import limits

log = logging.getLogger("evergraph.http")


def parse_addr(addr: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT` or `:PORT` (loopback); InputError naming --http."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InputError(f"{addr!r} is not HOST:PORT (e.g. 127.0.0.1:9233)", "--http")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def bind(addr: str) -> socket.socket:
    host, port = parse_addr(addr)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # inherited by accepted connections: uvicorn writes a response's head and
        # body apart, and with Nagle the body waited for the client's delayed ACK
        # (~40 ms a request)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {addr}: {e.strerror}", "--http") from None
    sock.setblocking(False)
    return sock


#: the key, in a request's ASGI state, of a Unix socket peer's uid (SO_PEERCRED)
PEER_UID = "evergraph.peer_uid"


def bind_unix(path: str) -> socket.socket:
    """A listening Unix socket at `path` (mode 0666: every local user may connect;
    what a peer may read is decided by its uid). A socket left there by an agent
    that died is replaced; anything else at `path` is an InputError naming
    --http-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise InputError(f"{path}: {e.strerror}", "--http-socket") from None
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise InputError(f"{path}: exists and is not a socket", "--http-socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a dead agent's
        else:
            raise InputError(f"{path}: another server listens there", "--http-socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {path}: {e.strerror}", "--http-socket") from None
    sock.setblocking(False)
    return sock


def _peer_uid(transport: Any) -> int | None:
    """The uid of a Unix socket connection's peer (None: not a Unix socket)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _protocol(cap: int) -> type[Any]:
    """uvicorn's h11 protocol, bounded (`limits.BoundedProtocol`: at most `cap`
    connections, a deadline for headers), which also puts a Unix socket peer's uid
    into each request's state."""

    class PeerProtocol(limits.BoundedProtocol):
        max_connections = cap

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            uid = _peer_uid(transport)
            if uid is not None:  # per connection: this protocol object is this connection's
                state: dict[str, Any] = getattr(self, "app_state", {})
                self.app_state = {**state, PEER_UID: uid}

    return PeerProtocol


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the agent handles signals

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, but polling for the connections to end (its version always
        sleeps 100 ms first: a tenth of a second on every `--converged-exit` run)."""
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        state = self.server_state
        for connection in list(state.connections):
            connection.shutdown()  # idle ones close now, busy ones after their response
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.timeout_graceful_shutdown or 0)
        while (state.connections or state.tasks) and loop.time() < deadline:
            await asyncio.sleep(0.005)
        if state.tasks:
            log.warning("HTTP: cancelling %d response(s) still running", len(state.tasks))
            for t in state.tasks:
                t.cancel()
        await self.lifespan.shutdown()


class HttpServer:
    """One listening socket and the app behind it; `run()` until cancelled.
    `on_stop`: called first when cancelled (to end endless responses, such as
    event streams, which would otherwise hold the shutdown for its grace)."""

    def __init__(
        self,
        app: Any,
        sock: socket.socket | None,
        on_stop: Callable[[], None] | None = None,
        unix: socket.socket | None = None,
        max_body: int = limits.MAX_BODY,
    ) -> None:
        self.socks = [s for s in (sock, unix) if s is not None]
        self.on_stop = on_stop
        self.url = ""
        if sock is not None:
            host, port = sock.getsockname()[:2]
            self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        self.unix = unix.getsockname() if unix is not None else ""
        cap = limits.connection_cap()
        # what one client may cost: http/limits.py
        config = uvicorn.Config(
            limits.BodyLimit(app, max_body),
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=1,
            http=_protocol(cap),
            timeout_keep_alive=int(limits.IDLE_TIMEOUT),
            h11_max_incomplete_event_size=limits.MAX_HEADER_BYTES,
            limit_concurrency=cap + 16,
            backlog=128,
        )
        self.server = _Server(config)

    async def _serve(self) -> None:
        try:
            await self.server.serve(sockets=self.socks)
        except Exception as e:
            if not self.server.should_exit:
                raise
            log.debug("HTTP API: while stopping: %r", e)

    async def run(self) -> None:
        """Serve until cancelled, then stop gracefully: `on_stop`, uvicorn's own
        shutdown (its connections closed, a grace of 1 s), and the cancellation goes
        on. uvicorn's serve runs as a task owned here, so that the cancellation
        reaches this method and not uvicorn's shutdown; a failure while stopping is
        no error (the stop goes on)."""
        if self.url:
            log.info("HTTP API on %s", self.url)
        if self.unix:
            log.info("HTTP API on unix:%s (root's connections read parameters)", self.unix)
        try:
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(self._serve(), name="uvicorn")
                try:
                    await asyncio.wait([serving])  # cancelled here: serving is not
                except asyncio.CancelledError:
                    if self.on_stop is not None:
                        self.on_stop()
                    self.server.should_exit = True
                    await asyncio.wait([serving])  # cancelled again: the group cancels it
                    raise
        finally:
            for sock in self.socks:
                sock.close()
            if self.unix:
                with contextlib.suppress(OSError):
                    os.unlink(self.unix)
