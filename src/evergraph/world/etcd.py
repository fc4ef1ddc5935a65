"""The etcd World: a real etcd v3 cluster, for hosts that share state over a network.

A thin adapter over the gRPC stubs that aetcd ships (`aetcd.rpc`): aetcd's
own `Client` speaks to one plaintext endpoint only and hides the boundaries
between watch responses, and we need TLS, several endpoints and one batch
per revision. So each endpoint gets its own `grpc.aio` channel, and this
module adds what the World contract asks on top:

- **failover**: calls go to the current endpoint; when it cannot be reached
  the next one is tried, with a short backoff once all were tried, until
  `timeout` runs out. A write whose connection broke while in flight may or
  may not have been applied; idempotent ones (put, lease calls) are retried,
  delete and cas raise a WorldError saying the outcome is unknown rather than
  answer wrongly;
- **watch supervision**: a lost stream (server restart, member killed, member
  without a leader) is reopened on the next endpoint from the last revision
  seen + 1, with backoff, forever, until the KV is closed; only a resume point
  that was compacted in the meantime ends the watch (`Compacted`);
- **errors**: every failure is a WorldError with one line naming the endpoint
  and the reason (`etcd at http://h:2379 is not reachable: connection
  refused`), never grpc's multi-line debug strings;
- **auth**: user/password give a token per endpoint, fetched again when etcd
  says it expired;
- **a replaced World**: every answer's header carries the cluster id and the
  revision. The client remembers the first cluster id and the highest revision
  it saw (from linearizable answers: reads, writes, watch events); an answer
  from another cluster id (a new cluster at the same address), or a revision
  lower than one seen before the call started (restored data), starts a new
  `epoch`: reads return the new World's data, watches raise `WorldReplaced`.
  A watch's first answer is not linearizable (a lagging member may be behind),
  so a revision that went back there is confirmed with a read first. A new
  cluster with the same id (same member names, peer URLs and token) whose
  revision is already past ours cannot be told apart here: the World's id
  record does (world/worldid.py), and `mark_replaced` then ends every watch
  of this client at once with `WorldReplaced`.

Revisions are etcd's own (header and mod revisions), so they match what
`etcdctl` shows.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
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

from evergraph.world.kv import (
    KV,
    Compacted,
    Compare,
    Delete,
    Event,
    KeyValue,
    LeaseExpired,
    Put,
    WorldError,
    WorldReplaced,
    check_ops,
    log,
)

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
    #: None: not authenticated yet (or not needed yet); "": no token needed
    token: str | None = None

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


class EtcdKV(KV):
    """The World on an etcd v3 cluster. Create it inside the running event loop."""

    name = "etcd"

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
        """`endpoints`: client URLs of the members (`http://h:2379`, `https://…`);
        `ca`: the CA that signed the servers' certificates (default: the system's);
        `cert`/`key`: a client certificate; `user`/`password`: etcd auth;
        `timeout`: seconds an operation may take, failovers included."""
        if not endpoints:
            raise WorldError("no etcd endpoints given")
        if (cert is None) != (key is None):
            raise WorldError("an etcd client certificate needs both cert and key")
        if (user is None) != (password is None):
            raise WorldError("etcd auth needs both a user name and a password")
        self._ca = _read_file(ca, "CA certificate")
        self._cert = _read_file(cert, "client certificate")
        self._key = _read_file(key, "client key")
        tls = self._ca is not None or self._cert is not None
        self._endpoints = [_parse_endpoint(u, tls) for u in endpoints]
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
        #: the World we talk to: its cluster id (0: none seen yet), the highest
        #: revision seen in it, how many times it was replaced, and why lately
        self._cluster_id = 0
        self._seen_rev = 0
        self._epoch = 0
        self._why = ""
        #: each watch's pending read (cancelled when the World is found replaced)
        self._watch_reads: set[asyncio.Future[Any]] = set()

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def world_id(self) -> str:
        return f"{self._cluster_id:x}" if self._cluster_id else ""

    # -- a replaced World ---------------------------------------------------------
    def _observe(
        self, ep: _Endpoint, header: Any, floor: int, epoch: int, revision: bool = True
    ) -> None:
        """Check an answer's header against the World we know. `floor` and `epoch`:
        the highest revision seen and the epoch when the call started (an answer
        cannot be older than what was seen before it was asked, unless the World
        is another; an answer to a call from an older epoch says nothing).
        `revision`: whether the header's revision is linearizable."""
        cid, rev = int(header.cluster_id), int(header.revision)
        if not cid or epoch != self._epoch:
            return
        if not self._cluster_id:
            self._cluster_id = cid
        elif cid != self._cluster_id:
            self._replace(f"etcd at {ep.url}: cluster id {self._cluster_id:x} -> {cid:x}", cid, rev)
            return
        if not revision:
            return
        if rev < floor:
            self._replace(f"etcd at {ep.url}: revision went back from {floor} to {rev}", cid, rev)
        elif rev > self._seen_rev:
            self._seen_rev = rev

    def _replace(self, why: str, cid: int, rev: int) -> None:
        self._cluster_id, self._seen_rev = cid, rev
        self._epoch += 1
        self._why = why
        log.warning("world: %s", WorldReplaced(why))
        # a watch waiting for its next answer raises WorldReplaced now, not at
        # the World's next change (which, for this watch, may never come)
        for read in list(self._watch_reads):
            read.cancel()
        self._tell_replaced(why)

    def mark_replaced(self, why: str) -> None:
        self._replace(why, self._cluster_id, 0)

    async def _confirm_revision(self, ep: _Endpoint, floor: int, epoch: int) -> None:
        """A watch's first answer said the revision went back below `floor`: ask
        again with a linearizable read (a lagging member has caught up by then)."""
        now = await self._step(
            ep.kv.Range(
                rpc.RangeRequest(key=b"\0", count_only=True),
                timeout=self.timeout,
                metadata=ep.metadata(),
            )
        )
        self._observe(ep, now.header, floor, epoch)

    # -- plumbing ---------------------------------------------------------------
    def _endpoint(self) -> _Endpoint:
        if self._closed:
            raise WorldError("the World connection is closed")
        ep = self._endpoints[self._current]
        if ep.channel is None:
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
        return ep

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

    async def _call(
        self,
        what: str,
        op: Callable[[_Endpoint, float], Awaitable[T]],
        *,
        idempotent: bool = True,
    ) -> T:
        """Run `op(endpoint, seconds)`, failing over between endpoints until `timeout`;
        `what` names the operation in error messages.

        An idempotent op gets a short first attempt (doubling after each): a member
        that forwarded it to a leader that just died never answers, and another
        try after the election succeeds. Other ops may use the whole timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        delay = _BACKOFF_MIN
        attempt = _ATTEMPT_MIN
        failures: dict[str, str] = {}
        attempts = 0
        reauthed = False
        while True:
            ep = self._endpoint()
            left = deadline - loop.time()
            if left <= 0:
                raise self._unreachable(failures or {ep.url: "no answer in time"})
            budget = min(left, attempt) if idempotent else left
            floor, epoch = self._seen_rev, self._epoch
            try:
                await self._authenticate(ep, budget)
                answer = await op(ep, budget)
                header = getattr(answer, "header", None)
                if header is not None:
                    self._observe(ep, header, floor, epoch, isinstance(answer, _LINEARIZABLE))
                return answer
            except grpc.aio.AioRpcError as e:
                kind = _classify(e)
                if kind == _REAUTH and not reauthed:
                    ep.token, reauthed = None, True
                    continue
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    if not idempotent:
                        raise WorldError(
                            f"etcd at {ep.url} did not answer {what} within {self.timeout:g} s;"
                            " it may or may not have been applied"
                        ) from None
                    attempt *= 2
                    kind = _SAFE
                elif kind == _AMBIGUOUS and not idempotent:
                    raise WorldError(
                        f"etcd at {ep.url}: the connection broke during {what} ({_reason(e)});"
                        " it may or may not have been applied"
                    ) from None
                if kind not in (_SAFE, _AMBIGUOUS):
                    raise self._error(ep, what, e) from None
                failures[ep.url] = _reason(e)
            except asyncio.CancelledError:
                if self._closed and not _cancelling():
                    raise WorldError("the World connection is closed") from None
                raise
            self._rotate(ep)
            attempts += 1
            if attempts % len(self._endpoints) == 0:  # all of them failed: back off a little
                await asyncio.sleep(max(0.0, min(delay, deadline - loop.time())))
                delay = min(delay * 2, _BACKOFF_MAX / 2)

    # -- reads ------------------------------------------------------------------
    async def get(self, key: str) -> KeyValue | None:
        req = rpc.RangeRequest(key=_b(key))

        async def op(ep: _Endpoint, t: float) -> Any:
            return await ep.kv.Range(req, timeout=t, metadata=ep.metadata())

        resp = await self._call(f"get {key!r}", op)
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        start, end = _prefix_range(prefix)
        req = rpc.RangeRequest(
            key=start,
            range_end=end,
            sort_order=rpc.RangeRequest.ASCEND,
            sort_target=rpc.RangeRequest.KEY,
        )

        async def op(ep: _Endpoint, t: float) -> Any:
            return await ep.kv.Range(req, timeout=t, metadata=ep.metadata())

        resp = await self._call(f"read {prefix!r}", op)
        return [_kv(kv) for kv in resp.kvs], int(resp.header.revision)

    # -- writes -----------------------------------------------------------------
    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        req = rpc.PutRequest(key=_b(key), value=value, lease=lease)

        async def op(ep: _Endpoint, t: float) -> Any:
            return await ep.kv.Put(req, timeout=t, metadata=ep.metadata())

        what = f"put {key!r}" + (f" with lease {lease:x}" if lease else "")
        return int((await self._call(what, op)).header.revision)

    async def _delete_range(self, what: str, key: bytes, end: bytes = b"") -> int:
        req = rpc.DeleteRangeRequest(key=key, range_end=end)

        async def op(ep: _Endpoint, t: float) -> Any:
            return await ep.kv.DeleteRange(req, timeout=t, metadata=ep.metadata())

        return int((await self._call(what, op, idempotent=False)).deleted)

    async def delete(self, key: str) -> bool:
        return await self._delete_range(f"delete {key!r}", _b(key)) > 0

    async def delete_prefix(self, prefix: str) -> int:
        return await self._delete_range(f"delete {prefix!r}*", *_prefix_range(prefix))

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Put | Delete]) -> int | None:
        check_ops(ops)
        cmps = []
        for c in compares:
            k = _b(c.key)
            if c.mod_revision == 0:  # the key must not exist
                cmps.append(
                    rpc.Compare(
                        key=k,
                        result=rpc.Compare.EQUAL,
                        target=rpc.Compare.CREATE,
                        create_revision=0,
                    )
                )
            else:
                cmps.append(
                    rpc.Compare(
                        key=k,
                        result=rpc.Compare.EQUAL,
                        target=rpc.Compare.MOD,
                        mod_revision=c.mod_revision,
                    )
                )
        then = [
            rpc.RequestOp(
                request_put=rpc.PutRequest(key=_b(op.key), value=op.value, lease=op.lease)
            )
            if isinstance(op, Put)
            else rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=_b(op.key)))
            for op in ops
        ]
        req = rpc.TxnRequest(compare=cmps, success=then)

        async def op(ep: _Endpoint, t: float) -> Any:
            return await ep.kv.Txn(req, timeout=t, metadata=ep.metadata())

        keys = ", ".join(repr(o.key) for o in ops[:3]) + (", ..." if len(ops) > 3 else "")
        resp = await self._call(f"write {keys or 'nothing'} in a txn", op, idempotent=False)
        # a txn that changed nothing answers with the current revision, as the others do
        return int(resp.header.revision) if resp.succeeded else None

    # -- leases -----------------------------------------------------------------
    async def grant(self, ttl: float) -> int:
        # etcd counts whole seconds and may raise a short TTL to its own minimum
        req = rpc.LeaseGrantRequest(TTL=max(1, math.ceil(ttl)))

        async def op(ep: _Endpoint, t: float) -> Any:
            return await ep.lease.LeaseGrant(req, timeout=t, metadata=ep.metadata())

        # a retry after a lost answer leaves an unused lease behind; it just expires
        resp = await self._call("grant a lease", op)
        if resp.error:
            raise WorldError(f"etcd refused to grant a lease: {resp.error}")
        return int(resp.ID)

    async def keepalive(self, lease: int) -> None:
        async def op(ep: _Endpoint, t: float) -> Any:
            call = self._track(ep.lease.LeaseKeepAlive(timeout=t, metadata=ep.metadata()))
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease))
                await call.done_writing()
                resp = await call.read()
                await call.code()  # etcd ends the stream once it saw ours end
            except grpc.aio.AioRpcError as e:
                # a stream whose deadline passed while the event loop was busy (an
                # agent applying 10,000 files at once) ends in one of several ways:
                # etcd's "context deadline exceeded" (UNKNOWN), or grpc's INTERNAL for
                # a step on a call it had ended; all are a deadline, retried
                call.cancel()
                details = str(e.details() or "")
                if e.code() == grpc.StatusCode.INTERNAL or (
                    e.code() == grpc.StatusCode.UNKNOWN and "deadline exceeded" in details
                ):
                    raise _ended_early(details) from None
                raise
            except Exception as e:
                # ... or grpc's ExecuteBatchError (not an RpcError) for such a step
                call.cancel()
                raise _ended_early(type(e).__name__) from None
            except BaseException:
                call.cancel()
                raise
            return resp

        resp = await self._call(f"keep lease {lease:x} alive", op)
        if resp is grpc.aio.EOF:
            raise WorldError(f"etcd ended the keep-alive of lease {lease:x} without an answer")
        if resp.TTL <= 0:
            raise LeaseExpired(f"lease {lease:x} expired")

    async def revoke(self, lease: int) -> None:
        req = rpc.LeaseRevokeRequest(ID=lease)

        async def op(ep: _Endpoint, t: float) -> Any:
            return await ep.lease.LeaseRevoke(req, timeout=t, metadata=ep.metadata())

        try:
            await self._call(f"revoke lease {lease:x}", op)
        except LeaseExpired:
            pass  # already gone: what we wanted

    # -- watch --------------------------------------------------------------------
    async def compact(self, revision: int) -> None:
        if revision <= 1:
            return

        async def op(ep: _Endpoint, t: float) -> None:
            md = ep.metadata()
            try:
                await ep.kv.Compact(
                    rpc.CompactionRequest(revision=revision), timeout=t, metadata=md
                )
            except grpc.aio.AioRpcError as e:
                details = str(e.details())
                if "has been compacted" in details:
                    return  # already forgotten
                if "future revision" not in details:
                    raise
                # as far as there is history (the other backends clamp too)
                now = await ep.kv.Range(
                    rpc.RangeRequest(key=b"\0", count_only=True), timeout=t, metadata=md
                )
                cur = rpc.CompactionRequest(revision=now.header.revision)
                await ep.kv.Compact(cur, timeout=t, metadata=md)

        await self._call(f"compact at revision {revision}", op)

    async def watch(self, prefix: str, start: int) -> AsyncIterator[list[Event]]:
        self._endpoint()  # raises if closed
        key, end = _prefix_range(prefix)
        nxt = max(start, 1)  # etcd reads 0 as "from now"; the contract means from the start
        delay = _BACKOFF_MIN
        lost: str | None = None  # why the stream broke, until it is back
        mine = self._epoch  # the World this watch follows
        while not self._closed:
            ep = self._endpoint()
            call = None
            floor, epoch = self._seen_rev, self._epoch
            try:
                await self._authenticate(ep, self.timeout)
                call = self._track(ep.watch.Watch(metadata=ep.metadata(_REQUIRE_LEADER)))
                create = rpc.WatchCreateRequest(key=key, range_end=end, start_revision=nxt)
                await self._step(call.write(rpc.WatchRequest(create_request=create)))
                while True:
                    read = asyncio.ensure_future(call.read())
                    self._watch_reads.add(read)
                    try:
                        resp = await self._step(read)
                    finally:
                        self._watch_reads.discard(read)
                    if resp is grpc.aio.EOF:
                        raise _StreamEnded
                    self._observe(ep, resp.header, floor, epoch, revision=False)
                    if resp.created and int(resp.header.revision) < floor:
                        await self._confirm_revision(ep, floor, epoch)
                    if self._epoch != mine:
                        raise WorldReplaced(self._why)
                    if resp.compact_revision:
                        # etcd's compact_revision is the oldest revision it still has
                        raise Compacted(nxt, int(resp.compact_revision) - 1)
                    if resp.canceled:
                        raise WorldError(
                            f"etcd at {ep.url} cancelled the watch of {prefix!r}: "
                            f"{resp.cancel_reason or 'no reason given'}"
                        )
                    if resp.created:
                        if lost is not None:
                            log.info("world: watch of %r resumed at %s", prefix, ep.url)
                        lost, delay = None, _BACKOFF_MIN
                    batch: list[Event] = []
                    for ev in resp.events:
                        e = _event(ev)
                        if e.revision < nxt:
                            continue  # already delivered before a reconnect
                        self._seen_rev = max(self._seen_rev, e.revision)
                        if batch and e.revision != batch[0].revision:
                            nxt = batch[0].revision + 1
                            yield batch
                            batch = []
                        batch.append(e)
                    if batch:
                        nxt = batch[0].revision + 1
                        yield batch
            except grpc.aio.AioRpcError as e:
                if self._closed:
                    return
                kind = _classify(e)
                if kind == _FATAL:
                    raise self._error(ep, f"watch {prefix!r}", e) from None
                if kind == _REAUTH:
                    ep.token = None
                why = _reason(e)
            except _StreamEnded:
                why = "the server ended the stream"
            except asyncio.CancelledError:
                if self._closed and not _cancelling():
                    return  # close() cancelled the stream
                if self._epoch != mine and not _cancelling():
                    raise WorldReplaced(self._why) from None  # mark_replaced woke us
                raise
            except Exception:
                if self._closed:
                    return  # whatever a cancelled call raised
                raise
            finally:
                if call is not None:
                    self._cancel([call])
            if lost is None:
                log.warning(
                    "world: watch of %r lost at %s (%s); resuming from revision %d",
                    prefix,
                    ep.url,
                    why,
                    nxt,
                )
            lost = why
            self._rotate(ep)
            if await self._closed_within(delay):
                return
            delay = min(delay * 2, _BACKOFF_MAX)

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

    async def close(self) -> None:
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
        for ep in self._endpoints:
            if ep.channel is not None:
                await ep.channel.close()
                ep.channel = None


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
