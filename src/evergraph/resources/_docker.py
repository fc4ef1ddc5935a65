"""The Docker Engine API for the docker kinds (`docker:container`, `docker:image`).

One `Engine` per engine address and API version, shared by every docker resource of
the agent (a service: `handle.services.get(DockerEngines).engine(version)`), holds a
client of the `docker` library (the maintained Engine API client; it blocks, so every
call runs in a thread) and ONE event stream, fanned out to the resources' watches.

The address is the one the docker CLI uses: `DOCKER_HOST`, else the local socket.

The stream is read in a thread of its own. When it ends (dockerd stopped or
restarted: a clean end of the stream) or fails, the thread reconnects with a
backoff (0.1 s doubling to 5 s) and every subscriber is told "anything may have
changed" once it is back, so the resources look again and repair what happened
while the engine was away: no restart of the agent is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from evergraph.errors import ResourceError

if TYPE_CHECKING:
    import docker

T = TypeVar("T")
log = logging.getLogger("evergraph.docker")

#: the seconds a single API call may take (a stop waits its own timeout on top)
CALL_TIMEOUT = 60.0
#: reconnect backoff of the event stream, seconds
BACKOFF_FIRST, BACKOFF_MAX = 0.1, 5.0

#: what a subscriber gets: one event (the Engine API's JSON), or None: the stream
#: (re)connected, anything may have changed meanwhile
Listener = Callable[[dict[str, Any] | None], None]


def docker_host() -> str:
    """The engine's address, as the docker CLI finds it."""
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


class Unreachable(ResourceError):
    """The engine does not answer (not running, no socket, refused)."""


class Engine:
    """One Docker engine: a shared client and its event stream (see the module)."""

    def __init__(self, host: str, version: str) -> None:
        self.host, self.version = host, version
        self._client: docker.DockerClient | None = None
        self._client_lock = threading.Lock()
        self._listeners: dict[int, tuple[asyncio.AbstractEventLoop, Listener]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stream: Any = None
        self._lock = threading.Lock()
        #: set once the stream is open (for the first time); the error that kept it shut
        self.connected = threading.Event()

    # -- calls ------------------------------------------------------------------
    def _knock(self) -> None:
        """Unreachable unless the engine's unix socket takes a connection. (The
        library leaks its socket when a connection is refused: asked first, so a
        stopped engine costs no file descriptor per call or reconnect.)"""
        if not self.host.startswith("unix://"):
            return
        path = self.host.removeprefix("unix://")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(CALL_TIMEOUT)
            try:
                s.connect(path)
            except OSError as e:
                raise Unreachable(
                    f"the Docker engine at {self.host} does not answer: {e.strerror or e}"
                ) from None

    def client(self) -> docker.DockerClient:
        """The client (made on first use: with version `auto` it asks the engine)."""
        self._knock()
        with self._client_lock:
            if self._client is None:
                import docker

                try:
                    self._client = docker.DockerClient(
                        base_url=self.host,
                        version=self.version or "auto",
                        timeout=int(CALL_TIMEOUT),
                    )
                except docker.errors.DockerException as e:
                    raise Unreachable(
                        f"the Docker engine at {self.host} does not answer: {e}"
                    ) from None
            return self._client

    async def call(self, what: str, fn: Callable[[docker.DockerClient], T]) -> T:
        """`fn(client)` in a thread; a failure of the engine is a one-line error."""
        return await asyncio.to_thread(self.call_blocking, what, fn)

    def call_blocking(self, what: str, fn: Callable[[docker.DockerClient], T]) -> T:
        import docker
        import requests

        try:
            client = self.client()
        except Unreachable as e:
            raise Unreachable(f"{what}: {e}") from None
        try:
            return fn(client)
        except docker.errors.NotFound:
            raise
        except docker.errors.APIError as e:
            raise ResourceError(f"{what}: {e.explanation or e}") from None
        except (requests.exceptions.ConnectionError, docker.errors.DockerException) as e:
            raise Unreachable(
                f"{what}: the Docker engine at {self.host} does not answer: {e}"
            ) from None
        except requests.exceptions.RequestException as e:
            raise ResourceError(f"{what}: {e}") from None

    # -- events -------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener` (in the caller's event loop) per event of the engine, and
        with None whenever the stream (re)connects; returns the unsubscribe."""
        loop = asyncio.get_running_loop()
        with self._lock:
            key = self._next
            self._next += 1
            self._listeners[key] = (loop, listener)
            if self.connected.is_set():
                loop.call_soon(listener, None)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._follow, name=f"docker events {self.host}", daemon=True
                )
                self._thread.start()

        def unsubscribe() -> None:
            with self._lock:
                self._listeners.pop(key, None)

        return unsubscribe

    def _fan_out(self, event: dict[str, Any] | None) -> None:
        with self._lock:
            listeners = list(self._listeners.values())
        for loop, listener in listeners:
            with contextlib.suppress(RuntimeError):  # that loop is closed
                loop.call_soon_threadsafe(listener, event)

    def _follow(self) -> None:
        """The stream's thread: open, read to its end, reopen with backoff."""
        import docker

        backoff = BACKOFF_FIRST
        #: where a reopened stream resumes (None: after a gap, from now)
        since: float | None = None
        while not self._stop.is_set():
            try:
                api = self.client().api
                opened = time.time()
                stream = api.events(decode=True, since=None if since is None else int(since))
                with self._lock:
                    self._stream = stream
                if self._stop.is_set():
                    stream.close()
                    break
                if since is None:  # a gap (first open, or after a failure): look again
                    self.connected.set()
                    self._fan_out(None)
                since = since or opened
                backoff = BACKOFF_FIRST
                for event in stream:
                    since = max(since, float(event.get("timeNano", 0)) / 1e9)
                    self._fan_out(event)
                # the engine ended the stream: it is stopping (or restarting)
                since = None
            except Exception as e:  # every failure means: reconnect
                # a stream idle for CALL_TIMEOUT s times out (so a socket the engine
                # lost silently cannot hang it): reopened from the last event seen
                if "timeout" in type(e).__name__.lower() and since is not None:
                    continue
                if not self._stop.is_set():
                    log.debug("docker events at %s: %s (reconnecting)", self.host, e)
                since = None
                if isinstance(e, docker.errors.DockerException):
                    with self._client_lock:
                        self._client = None  # version `auto` asks again
            finally:
                with self._lock:
                    self._stream = None
            self._stop.wait(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            stream, self._stream = self._stream, None
            self._listeners.clear()
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()


class DockerEngines:
    """A service (`handle.services.get(DockerEngines)`): one `Engine` per address and
    API version for the agent, closed (streams ended) when the agent ends."""

    def __init__(self) -> None:
        self._engines: dict[tuple[str, str], Engine] = {}

    def engine(self, version: str) -> Engine:
        key = (docker_host(), version)
        found = self._engines.get(key)
        if found is None:
            found = self._engines[key] = Engine(*key)
        return found

    async def aclose(self) -> None:
        engines = list(self._engines.values())
        self._engines.clear()
        for engine in engines:
            engine.close()
        for engine in engines:
            thread = engine._thread
            if thread is not None:
                await asyncio.to_thread(thread.join, 10)
