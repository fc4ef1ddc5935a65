"""Serving an ASGI app inside the agent's event loop, as one of its services.

The socket is bound here, before uvicorn sees it, so a bad or taken address is
an input error naming `--http` (uvicorn itself would log and `sys.exit(1)`).
uvicorn's own signal handling is switched off: the agent owns SIGINT/SIGTERM,
and cancelling the service stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
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
        sock: socket.socket,
        on_stop: Callable[[], None] | None = None,
        max_body: int = limits.MAX_BODY,
    ) -> None:
        self.sock = sock
        self.on_stop = on_stop
        host, port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        cap = limits.connection_cap()
        protocol = type("Protocol", (limits.BoundedProtocol,), {"max_connections": cap})
        # what one client may cost: http/limits.py
        config = uvicorn.Config(
            limits.BodyLimit(app, max_body),
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=1,
            http=protocol,
            timeout_keep_alive=int(limits.IDLE_TIMEOUT),
            h11_max_incomplete_event_size=limits.MAX_HEADER_BYTES,
            limit_concurrency=cap + 16,
            backlog=128,
        )
        self.server = _Server(config)

    async def run(self) -> None:
        log.info("HTTP API on %s", self.url)
        serving = asyncio.create_task(self.server.serve(sockets=[self.sock]), name="uvicorn")
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            if self.on_stop is not None:
                self.on_stop()
            self.server.should_exit = True
            with contextlib.suppress(Exception):
                await serving
            raise
        finally:
            self.sock.close()
