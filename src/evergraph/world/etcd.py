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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

# gRPC's C core logs connection and TLS failures straight to stderr; we report
# them as one WorldError line instead (GRPC_VERBOSITY=DEBUG still shows them)
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import grpc  # type: ignore[import-untyped]
import grpc.aio  # type: ignore[import-untyped]
from aetcd import rpc

from evergraph.world._etcd_link import (
    _AMBIGUOUS,
    _ATTEMPT_MIN,
    _BACKOFF_MAX,
    _BACKOFF_MIN,
    _FATAL,
    _LINEARIZABLE,
    _REAUTH,
    _REQUIRE_LEADER,
    _SAFE,
    T,
    _b,
    _cancelling,
    _classify,
    _ended_early,
    _Endpoint,
    _event,
    _kv,
    _Link,
    _prefix_range,
    _reason,
    _StreamEnded,
)
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


class EtcdKV(_Link, KV):
    """The World on an etcd v3 cluster. Create it inside the running event loop.
    Its connection (endpoints, auth, errors, streams to cancel) is a `_Link`."""

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
        super().__init__(
            endpoints,
            ca=ca,
            cert=cert,
            key=key,
            user=user,
            password=password,
            timeout=timeout,
        )
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
        await self._close_dropped()
        while True:
            ep = self._endpoint()
            left = deadline - loop.time()
            if left <= 0:
                raise self._unreachable(failures or {ep.url: "no answer in time"})
            budget = min(left, attempt) if idempotent else left
            floor, epoch = self._seen_rev, self._epoch
            try:
                with self._using(ep):
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
            await self._close_dropped()
            ep = self._endpoint()
            call = None
            floor, epoch = self._seen_rev, self._epoch
            ep.users += 1  # held until the stream ends (see `_using`)
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
                ep.users -= 1
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

    async def close(self) -> None:
        await self._close_link()
