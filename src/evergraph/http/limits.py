"""What one HTTP client may cost the agent, bounded (the agent's loop also keeps its
World lease and repairs drift: a client must never stall it nor exhaust its
descriptors).

- A request body is read in full before the app sees it, at most `max_body`
  bytes (`--http-max-body`, 1 MiB: farm bodies are a few hundred bytes): a larger
  one is answered 413 at once, from its Content-Length when it gives one, and the
  connection is closed; nothing more of it is read.
- A connection must bring a request's headers within `HEADER_TIMEOUT` seconds of
  opening (or of its last response); headers are at most `MAX_HEADER_BYTES`.
  Idle keep-alive connections close after `IDLE_TIMEOUT` (uvicorn's setting).
- At most `max_connections` connections at once (a quarter of the descriptor
  limit, at most `MAX_CONNECTIONS`): one more is closed as it opens, and one
  line is logged (once a minute at most), never a traceback.
- Requests in flight beyond that are answered 503 by uvicorn (`limit_concurrency`).
"""

from __future__ import annotations

import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("evergraph.http")

#: the default `--http-max-body`
MAX_BODY = 1 << 20
HEADER_TIMEOUT = 10.0
IDLE_TIMEOUT = 5.0
MAX_HEADER_BYTES = 16 << 10
MAX_CONNECTIONS = 512

Scope = dict[str, Any]
Message = dict[str, Any]


def connection_cap() -> int:
    """At most a quarter of this process's descriptors go to HTTP clients (the rest
    are the graph's watches, files, commands and the World's)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft // 4))


class _Once:
    """Log a line at most once a minute per key (a flood must not flood the log)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= 60.0:
            self._last[key] = now
            if len(self._last) > 1000:
                self._last = {k: t for k, t in self._last.items() if now - t < 60.0}
            log.warning(msg, *args)


warn_once = _Once()


#: the connections of each server (keyed by its connection set), oldest first
_OPEN: dict[int, dict[BoundedProtocol, None]] = {}


class BoundedProtocol(H11Protocol):
    """uvicorn's h11 protocol with a cap on connections and a deadline for headers."""

    max_connections = MAX_CONNECTIONS

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        opened = _OPEN.setdefault(id(self.connections), {})
        opened[self] = None
        if len(self.connections) > self.max_connections:
            # make room: the oldest connection with no request under way goes (idle
            # ones cost a descriptor and nothing else); none idle: this one goes
            victim = next((c for c in opened if c is not self and c._idle()), self)
            warn_once(
                "cap",
                "HTTP: more than %d connections at once: closing idle ones",
                self.max_connections,
            )
            victim.connections.discard(victim)
            opened.pop(victim, None)
            victim.transport.abort()
            if victim is self:
                return
        self._arm_header_deadline()

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_deadline(self) -> None:
        old = getattr(self, "_header_deadline", None)
        if old is not None:
            old.cancel()
        self._header_deadline = self.loop.call_later(HEADER_TIMEOUT, self._headers_late)

    def _headers_late(self) -> None:
        # a request under way (its headers came) is left to its response
        if self._idle() and not self.transport.is_closing():
            client = self.client[0] if self.client else "?"
            warn_once(
                f"late:{client}", "HTTP: %s sent no request in %gs: closed", client, HEADER_TIMEOUT
            )
            self.transport.abort()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        deadline = getattr(self, "_header_deadline", None)
        if deadline is not None:
            deadline.cancel()
        opened = _OPEN.get(id(self.connections))
        if opened is not None:
            opened.pop(self, None)
        super().connection_lost(exc)


class AuthFailures:
    """Failed token attempts, per client address and per token presented: each is
    counted over the last minute; past `per_address` (or `per_token`) failures a
    source is answered 429 for the rest of that minute without its token being
    looked up, and each source is logged once a minute (never the token itself)."""

    WINDOW = 60.0

    def __init__(self, per_address: int = 30, per_token: int = 5) -> None:
        self.per_address = per_address
        self.per_token = per_token
        #: source -> failure times (monotonic), oldest first
        self._seen: dict[str, list[float]] = {}

    def _recent(self, source: str, now: float) -> list[float]:
        times = self._seen.get(source)
        if times is None:
            return []
        while times and times[0] <= now - self.WINDOW:
            times.pop(0)
        if not times:
            del self._seen[source]
        return times

    def blocked(self, address: str, token: str) -> float:
        """Seconds to wait before trying again (0: go on)."""
        now = time.monotonic()
        for source, limit in ((f"addr:{address}", self.per_address), (_tok(token), self.per_token)):
            times = self._recent(source, now)
            if len(times) >= limit:
                return max(1.0, times[0] + self.WINDOW - now)
        return 0.0

    def failed(self, address: str, token: str) -> None:
        now = time.monotonic()
        if len(self._seen) > 10_000:  # a flood of sources: forget the oldest half
            for key in list(self._seen)[: len(self._seen) // 2]:
                del self._seen[key]
        for source in (f"addr:{address}", _tok(token)):
            self._seen.setdefault(source, []).append(now)
        n = len(self._recent(f"addr:{address}", now))
        warn_once(
            f"auth:{address}",
            "HTTP: a failed token attempt from %s (%d in the last minute)",
            address,
            n,
        )


def _tok(token: str) -> str:
    """A token's source key: a hash prefix, never the token itself."""
    import hashlib

    return "tok:" + hashlib.sha256(token.encode()).hexdigest()[:16]


#: bodies larger than this are parsed in a thread (the loop keeps its turns)
PARSE_IN_THREAD = 64 << 10


class BodyLimit:
    """ASGI middleware: the request body read in full, at most `limit` bytes, before
    the app runs (413 `{"message": ...}` past it; the app never sees such a request)."""

    def __init__(self, app: Any, limit: int = MAX_BODY) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and (not value.isdigit() or int(value) > self.limit):
                await self._too_large(scope, send)
                return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before it finished sending: nothing to answer
            body += message.get("body", b"")
            if len(body) > self.limit:
                await self._too_large(scope, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return dict(await receive())  # later calls: the client's disconnect

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, send: Any) -> None:
        client = (scope.get("client") or ("?",))[0]
        warn_once(
            f"413:{client}",
            "HTTP: %s sent a body over %d bytes to %s: refused (413)",
            client,
            self.limit,
            scope.get("path", "?"),
        )
        payload = b'{"message":"request body too large: at most %d bytes"}' % self.limit
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
