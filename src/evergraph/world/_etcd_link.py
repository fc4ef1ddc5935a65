"""The etcd World's connection to its cluster: endpoints (each its own `grpc.aio`
channel, TLS or not), auth tokens, failover order, what an RPC error means and
how it is told, and the streaming calls that close() must cancel and see ended.
What the World contract adds on top (failover of calls, watches, a replaced
World) is in world/etcd.py, whose `EtcdKV` is a `_Link`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

# gRPC's C core logs connection and TLS failures straight to stderr; we report
# them as one WorldError line instead (GRPC_VERBOSITY=DEBUG still shows them)
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import grpc  # type: ignore[import-untyped]
import grpc.aio  # type: ignore[import-untyped]
from aetcd import rpc

from evergraph.world.kv import Event, KeyValue, LeaseExpired, WorldError

T = TypeVar("T")

#: gRPC channel options: reconnect fast after a restart (grpc's default backoff
#: grows to 2 minutes), notice dead peers on idle watch streams (etcd accepts
#: pings every 5 s or slower), accept large ranges and watch responses.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", -1),
]
#: seconds the first try of an idempotent call may take (doubling with each retry)
_ATTEMPT_MIN = 0.5
#: seconds between watch reconnect attempts: doubles from min up to max
_BACKOFF_MIN, _BACKOFF_MAX = 0.05, 1.0
#: seconds close() waits for gRPC to finish cancelled calls (a millisecond, usually)
_SETTLE = 1.0
#: cancel a member's watch streams when it loses its leader, so we fail over
_REQUIRE_LEADER = ("hasleader", "true")

# what to do about an RPC error
_SAFE = "safe"  # the request never reached etcd: try another endpoint
_AMBIGUOUS = "ambiguous"  # the connection broke in flight: it may have been applied
_REAUTH = "reauth"  # the auth token expired: fetch a new one and repeat
_FATAL = "fatal"  # retrying will not help


def _b(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


def _s(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    """etcd's [key, range_end) for every key starting with `prefix`."""
    start = _b(prefix)
    end = bytearray(start)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return start, bytes(end)
        end.pop()
    return start or b"\0", b"\0"  # "" or all 0xff: up to the end of the key space


def _kv(kv: Any) -> KeyValue:
    return KeyValue(
        _s(kv.key), bytes(kv.value), int(kv.create_revision), int(kv.mod_revision), int(kv.lease)
    )


def _event(ev: Any) -> Event:
    kv = ev.kv
    if ev.type == rpc.Event.DELETE:
        # etcd's tombstone carries only the key and the deleting revision
        return Event("delete", _s(kv.key), b"", int(kv.mod_revision))
    return Event(
        "put",
        _s(kv.key),
        bytes(kv.value),
        int(kv.mod_revision),
        int(kv.create_revision),
        int(kv.lease),
    )


def _tls_problem(details: str) -> bool:
    low = details.lower()
    if _SLOW_CONNECT in low:
        return False  # grpc's TCP connect ran out of time: no TLS in it
    return any(w in low for w in ("ssl", "tls", "tsi_", "handshake", "certificate"))


#: what grpc says when a connection's TCP set-up did not end within the call's time (an
#: overloaded host, a port whose accept queue is full, packets dropped on the way)
_SLOW_CONNECT = "tcp handshaker"
_SLOW_CONNECT_TEXT = "no connection in time (a busy host, or a port that drops connections)"


def _classify(e: Any) -> str:
    code = e.code()
    details = str(e.details() or "")
    if code == grpc.StatusCode.UNAVAILABLE:
        if _tls_problem(details):
            return _FATAL
        if any(
            w in details
            for w in (
                "failed to connect to all addresses",
                "DNS resolution failed",
                "no leader",
                _SLOW_CONNECT,  # never reached it: try again, or another member
            )
        ):
            return _SAFE
        return _AMBIGUOUS
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "too many requests" in details:
        return _SAFE
    if code == grpc.StatusCode.UNAUTHENTICATED and "invalid auth token" in details:
        return _REAUTH
    return _FATAL


def _reason(e: Any) -> str:
    """grpc's details in a few words."""
    details = " ".join(str(e.details() or e.code()).split())
    low = details.lower()
    if _tls_problem(details):
        for needle, text in (
            ("certificate_verify_failed", "the server's certificate is not trusted"),
            ("wrong_version_number", "the server does not speak TLS"),
            # TLS 1.3: the server checks our certificate after the handshake
            # and answers a missing or foreign one with an alert
            ("tsi_data_corrupted", "the server refused our client certificate (or its absence)"),
            ("alert", "the server refused our client certificate (or its absence)"),
        ):
            if needle in low:
                return f"TLS handshake failed: {text}"
        return f"TLS handshake failed: {details.rsplit(': ', 1)[-1]}"
    for needle, text in (
        ("connection refused", "connection refused"),
        (_SLOW_CONNECT, _SLOW_CONNECT_TEXT),
        ("connect() timed out", _SLOW_CONNECT_TEXT),
        ("connection reset", "connection reset"),
        ("socket closed", "connection closed"),
        ("stream removed", "connection lost"),
        ("deadline exceeded", "no answer in time"),
        ("dns resolution failed", "cannot resolve the host name"),
        ("no leader", "the member has no leader (no quorum?)"),
    ):
        if needle in low:
            return text
    return details.removeprefix("etcdserver: ")


def _hint(details: str) -> str:
    low = details.lower()
    if _tls_problem(details):
        if "certificate_verify_failed" in low:
            return " (is the CA given with --etcd-ca the one that signed its certificate?)"
        if "tsi_data_corrupted" in low or "alert" in low:
            return " (give a client certificate its CA signed: --etcd-cert and --etcd-key)"
        return " (check --etcd-ca/--etcd-cert/--etcd-key and that the URL is https://)"
    if "user name is empty" in details:
        return " (auth is enabled: give --etcd-user and --etcd-password)"
    if "invalid user ID or password" in details:
        return " (check --etcd-user/--etcd-password)"
    return ""


#: answers whose header revision is at least every revision committed before the
#: call (lease answers come from the leader's applied state, not a read index)
_LINEARIZABLE = (rpc.RangeResponse, rpc.PutResponse, rpc.DeleteRangeResponse, rpc.TxnResponse)


class _StreamEnded(Exception):
    """The server closed a watch stream without an error."""


@dataclass(eq=False)
class _Endpoint:
    url: str
    target: str
    secure: bool
    channel: Any = None
    kv: Any = None
    watch: Any = None
    lease: Any = None
    auth: Any = None
    cluster: Any = None
    maintenance: Any = None
    #: None: not authenticated yet (or not needed yet); "": no token needed
    token: str | None = None
    #: calls and watches using this endpoint now (a dropped one is closed at 0)
    users: int = 0

    def metadata(self, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
        return ((("token", self.token),) if self.token else ()) + extra


def _parse_endpoint(url: str, tls_default: bool) -> _Endpoint:
    text = url.strip()
    bare = "://" not in text
    parts = urlsplit(f"{'https' if tls_default else 'http'}://{text}" if bare else text)
    try:
        port = parts.port or 2379
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port < 0:
        raise WorldError(f"bad etcd endpoint {url!r}: expected http(s)://host:port")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return _Endpoint(
        url=f"{parts.scheme}://{host}:{port}",
        target=f"{host}:{port}",
        secure=parts.scheme == "https",
    )


def _read_file(path: str | Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise WorldError(f"cannot read the etcd {what} {path}: {e.strerror}") from None


class _Link:
    """The connection to one etcd cluster, shared by every call of an EtcdKV."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout: float = 5.0,
    ) -> None:
        if not endpoints:
            raise WorldError("no etcd endpoints given")
        if (cert is None) != (key is None):
            raise WorldError("an etcd client certificate needs both cert and key")
        if (user is None) != (password is None):
            raise WorldError("etcd auth needs both a user name and a password")
        self._ca = _read_file(ca, "CA certificate")
        self._cert = _read_file(cert, "client certificate")
        self._key = _read_file(key, "client key")
        self._tls = self._ca is not None or self._cert is not None
        self._endpoints = [_parse_endpoint(u, self._tls) for u in endpoints]
        #: endpoints dropped by set_endpoints whose channel is still open: closed
        #: once no call uses them (or by close())
        self._dropped: list[_Endpoint] = []
        self._user = user
        self._password = password
        self.timeout = timeout
        # start at a random member, as etcd's own clients balance: agents given the
        # same --seeds would otherwise all connect to (and load) the first one
        self._current = random.randrange(len(self._endpoints))
        self._closed = False
        self._closed_event = asyncio.Event()
        #: unfinished streaming calls and the steps awaiting them, cancelled by close()
        self._calls: set[Any] = set()
        self._steps: set[asyncio.Future[Any]] = set()
        #: gRPC's tasks awaiting our streaming calls' final status (see _track)
        self._status: set[asyncio.Task[Any]] = set()

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The client URLs this connection fails over among, in their order."""
        return tuple(ep.url for ep in self._endpoints)

    def set_endpoints(self, urls: Sequence[str]) -> None:
        """Replace the endpoints (the cluster's client URLs changed). The endpoint in
        use stays current if it is still listed; new ones connect when first used;
        a dropped one's channel closes once no call or watch uses it (a watch on it
        moves to a listed endpoint at its next failure)."""
        if self._closed:
            raise WorldError("the World connection is closed")
        fresh = [_parse_endpoint(u, self._tls) for u in urls]
        if not fresh:
            raise WorldError("no etcd endpoints given")
        known = {ep.url: ep for ep in [*self._dropped, *self._endpoints]}
        new: list[_Endpoint] = []
        for ep in fresh:
            if all(ep.url != n.url for n in new):  # the same URL twice: once
                new.append(known.pop(ep.url, ep))
        current = self._endpoints[self._current]
        self._endpoints = new
        self._current = new.index(current) if current in new else random.randrange(len(new))
        self._dropped = [ep for ep in known.values() if ep.channel is not None]

    def _open(self, ep: _Endpoint) -> None:
        if ep.secure:
            creds = grpc.ssl_channel_credentials(
                root_certificates=self._ca, private_key=self._key, certificate_chain=self._cert
            )
            ep.channel = grpc.aio.secure_channel(ep.target, creds, options=_CHANNEL_OPTIONS)
        else:
            ep.channel = grpc.aio.insecure_channel(ep.target, options=_CHANNEL_OPTIONS)
        ep.kv = rpc.KVStub(ep.channel)
        ep.watch = rpc.WatchStub(ep.channel)
        ep.lease = rpc.LeaseStub(ep.channel)
        ep.auth = rpc.AuthStub(ep.channel)
        ep.cluster = rpc.ClusterStub(ep.channel)
        ep.maintenance = rpc.MaintenanceStub(ep.channel)

    def _endpoint(self) -> _Endpoint:
        if self._closed:
            raise WorldError("the World connection is closed")
        ep = self._endpoints[self._current]
        if ep.channel is None:
            self._open(ep)
        return ep

    @contextlib.contextmanager
    def _using(self, ep: _Endpoint) -> Iterator[_Endpoint]:
        """Hold `ep` during a call or a watch's stream: a dropped endpoint's channel
        stays open while someone holds it."""
        ep.users += 1
        try:
            yield ep
        finally:
            ep.users -= 1

    async def _close_dropped(self) -> None:
        """Close the channels of dropped endpoints nobody holds (at each call's start:
        never inside a cancelled call's clean-up)."""
        idle = [ep for ep in self._dropped if ep.users == 0]
        if not idle:
            return
        self._dropped = [ep for ep in self._dropped if ep.users > 0]
        for ep in idle:
            if ep.channel is not None:
                channel, ep.channel = ep.channel, None
                ep.token = None
                await channel.close()

    def _connection(self, url: str) -> tuple[_Endpoint, Any]:
        """A connection to one member (`url`, with this link's TLS settings), for
        questions only that member can answer: the listed endpoint's channel when it
        is open, else one of its own. The caller closes the channel returned
        (None: it is the link's)."""
        ep = _parse_endpoint(url, self._tls)
        for known in self._endpoints:
            if known.url == ep.url and known.channel is not None:
                return known, None
        self._open(ep)
        return ep, ep.channel

    def _rotate(self, failed: _Endpoint) -> None:
        """Move on from an endpoint that failed (unless another task already did)."""
        if self._endpoints[self._current] is failed:
            self._current = (self._current + 1) % len(self._endpoints)

    async def _authenticate(self, ep: _Endpoint, timeout: float) -> None:
        if self._user is None or ep.token is not None:
            return
        try:
            resp = await ep.auth.Authenticate(
                rpc.AuthenticateRequest(name=self._user, password=self._password),
                timeout=timeout,
            )
        except grpc.aio.AioRpcError as e:
            if "authentication is not enabled" in str(e.details()):
                ep.token = ""  # credentials not needed here
                return
            raise
        ep.token = str(resp.token)

    def _error(self, ep: _Endpoint, what: str, e: Any) -> WorldError:
        details = str(e.details() or "")
        if "requested lease not found" in details:
            return LeaseExpired(f"{what}: the lease is gone (expired or revoked)")
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return WorldError(f"etcd at {ep.url} is not reachable: {_reason(e)}{_hint(details)}")
        if "authentication failed" in details:
            what = f"let user {self._user!r} in"
        return WorldError(f"etcd at {ep.url} refused to {what}: {_reason(e)}{_hint(details)}")

    def _unreachable(self, failures: dict[str, str]) -> WorldError:
        for url, why in failures.items():
            if why == "connection closed" and url.startswith("http:"):
                # what a TLS-only server does to a plaintext client
                failures[url] = f"{why} (does it only speak TLS? then use https://)"
        if len(failures) == 1:
            ((url, why),) = failures.items()
            return WorldError(f"etcd at {url} is not reachable: {why}")
        given = [ep.url for ep in self._endpoints]  # in the order given, not tried
        return WorldError(
            "etcd is not reachable at any endpoint: "
            + "; ".join(f"{url}: {failures[url]}" for url in given if url in failures)
        )

    def _cancel(self, calls: list[Any]) -> None:
        """Cancel streaming calls; close() waits until gRPC has finished them."""
        for c in calls:
            if not c.done():
                c.cancel()

    def _track(self, call: Any) -> Any:
        """Remember a streaming call until it ends, and gRPC's task that awaits its
        final status until that task ends, so close() can cancel and wait.

        gRPC finishes a call (even a cancelled one, which says it is done at once)
        in a task of its own, a moment later. Were the event loop closed before
        (the end of `asyncio.run`), the task would be left pending, the next loop
        of the process would receive that completion, log "Event loop is closed"
        and hold back completions of its own calls. The task is made in the
        call's first step, on the loop's next turn: it is adopted then."""
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        before = _grpc_status_tasks_set()

        def adopt() -> None:
            for t in _grpc_status_tasks_set() - before:
                self._status.add(t)
                t.add_done_callback(self._status.discard)

        asyncio.get_running_loop().call_soon(adopt)
        return call

    async def _step(self, aw: Awaitable[T]) -> T:
        """Await one step of a stream in a task that close() can cancel: cancelling
        the call alone leaves a write that waits for its headers hanging."""
        task = asyncio.ensure_future(aw)
        self._steps.add(task)
        try:
            return await task
        finally:
            self._steps.discard(task)

    async def _closed_within(self, seconds: float) -> bool:
        try:
            async with asyncio.timeout(seconds):  # (wait_for may swallow a cancel)
                await self._closed_event.wait()
        except TimeoutError:
            return False
        return True

    async def _close_link(self) -> None:
        """Close the connection: cancel its streams, wait for gRPC to end them, close
        the channels. Later calls raise WorldError."""
        if self._closed:
            return
        self._closed = True
        self._closed_event.set()
        for step in list(self._steps):
            step.cancel()
        self._cancel(list(self._calls))
        await asyncio.sleep(0)  # calls made this turn: their status tasks are adopted
        if self._status:
            await asyncio.wait(list(self._status), timeout=_SETTLE)
        for ep in [*self._endpoints, *self._dropped]:
            if ep.channel is not None:
                await ep.channel.close()
                ep.channel = None
        self._dropped = []


def _ended_early(why: object) -> Any:
    """grpc.aio's internal errors for a step of a stream that had already ended,
    as the deadline they almost always are: `_call` retries an idempotent call."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"Deadline Exceeded (the stream had ended: {why})",
    )


def _grpc_status_tasks_set() -> set[asyncio.Task[Any]]:
    """gRPC's tasks of this loop that wait for a call's final status."""
    return {
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "") == "_AioCall._handle_status_once_received"
    }


def _grpc_status_tasks() -> int:
    """How many gRPC calls of this loop still wait for their final status."""
    return len(_grpc_status_tasks_set())


def _cancelling() -> bool:
    """Whether our own task is being cancelled (rather than a call we cancelled)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
