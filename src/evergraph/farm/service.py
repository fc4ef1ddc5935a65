"""The farm's state in the World, and the operations users and admins call on it
(what the HTTP API v1 serves). Any agent may serve them: every write is one
transaction conditioned on the mod revision of each record it read, so two
servers (or a server and the leader's matcher) never both win a race.

World layout:

Every request and worker record is a signed envelope (`farm.signed`): written by
an API server (signed by it, after the token check), by the elected matcher
(signed with its term) or by a worker registering itself; a record whose signer
is not trusted here is treated as absent, and logged once.

- `farm/seq`: the last request id handed out (requests are numbered 1, 2, ...,
  with no gaps);
- `farm/queued`: the last queue position handed out (a new request, or one whose
  priority changed, goes to the tail of its priority's FIFO); apart from
  `farm/seq` so that a priority change does not take an id;
- `farm/requests/<id, 10 digits>`: a `Request` (JSON);
- `farm/workers/<uuid>`: a `Worker` (JSON), registered by the worker's agent;
- `farm/alive/<uuid>`: present while the worker's agent lives (under its lease),
  signed by the worker's host (`alive_value`, `open_alive`);
  its value `{"servers": [...]}` names the agents the worker hands job keys to
  (`--farm-server` and itself), so that another answers acquire_worker at once;
- `farm/demand/<id>/<host>`: agent `host` serves `acquire_worker` for request `id`
  and asks the job's worker for the key; the worker exports it (kind `farm.access`)
  sealed to that host's pinned key, so the private key is never plain in the World.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from evergraph._util.clock import SYSTEM, Clock
from evergraph.cluster.exports import Collector
from evergraph.farm import model
from evergraph.farm.model import Refused, Request, Worker
from evergraph.farm.signed import Envelope, FarmTrust, UnknownSigner, Untrusted, open_envelope
from evergraph.farm.tokens import User
from evergraph.world.follow import Tombstone, watch_one
from evergraph.world.kv import KV, Compare, Delete, KeyValue, Put, WorldError

log = logging.getLogger("evergraph.farm")

FARM = "farm/"
SEQ = "farm/seq"
QUEUED = "farm/queued"
REQS = "farm/requests/"
WORKERS = "farm/workers/"
ALIVE = "farm/alive/"
DEMAND = "farm/demand/"
#: the export kind that carries a job's private key to the agent serving it
ACCESS = "farm.access"
#: optimistic transactions retried this often before giving up
ATTEMPTS = 50
#: checked records remembered (then forgotten all at once)
_CHECKED_MAX = 100_000


class NotFound(Exception):
    """No such request or worker (or not one this user may see); `what` is
    "request" or "worker"."""

    def __init__(self, what: str, ident: object) -> None:
        super().__init__(f"{what} {ident} not found")
        self.what = what


class Forbidden(Exception):
    """An admin route, and the caller is no admin."""


@dataclass(frozen=True)
class FarmSettings:
    #: a request's deadline when none is given
    deadline_period: float = model.DEFAULT_DEADLINE_PERIOD
    #: a job's length, and what one prolong adds
    job_period: float = model.DEFAULT_JOB_PERIOD
    max_prolong: int = 3
    #: acquire_worker waits this long at most for a WAITING request
    acquire_wait: float = 60.0
    #: a WAITING request becomes INVALID only once no registered worker could serve
    #: it for this long (a worker re-registering, or deregistered by mistake and
    #: back, does not kill the queue)
    invalid_grace: float = 60.0
    #: the farm election's lease: a dead leader's matcher is replaced within it
    election_ttl: float = 10.0
    #: a worker becomes FAILED only once its alive key (under its agent's lease)
    #: has been gone this long: a World too slow to keep leases alive for a while
    #: (a locked sqlite file) fails no live worker
    alive_grace: float = 10.0

    def __post_init__(self) -> None:
        for name in ("deadline_period", "job_period", "acquire_wait", "election_ttl"):
            if not getattr(self, name) > 0:
                raise ValueError(f"farm settings: {name} must be positive")
        if self.max_prolong < 0 or not self.invalid_grace >= 0 or not self.alive_grace >= 0:
            raise ValueError(
                "farm settings: max_prolong, invalid_grace and alive_grace may not be negative"
            )


@dataclass(frozen=True)
class Access:
    """What acquire_worker returns: where to ssh, as whom, with which key."""

    ip: str
    port: int
    username: str
    key: str


class LocalWorker(Protocol):
    """The worker this very agent runs (`farm.host.WorkerHost`): the key of its job
    goes straight to the acquire_worker served here (its own exports never come
    back to it through the World)."""

    uuid: str

    def job_key(self, rid: int) -> str | None: ...

    def listen(self, fn: Callable[[], None]) -> Callable[[], None]: ...


class Alive(msgspec.Struct, frozen=True):
    """The value of `farm/alive/<uuid>`."""

    servers: list[str] = []


_alive_dec = msgspec.json.Decoder(Alive)
_req_dec = msgspec.json.Decoder(Request)
_worker_dec = msgspec.json.Decoder(Worker)


def req_key(rid: int) -> str:
    return f"{REQS}{rid:010d}"


def worker_key(uuid: str) -> str:
    return f"{WORKERS}{uuid}"


def decode_request(value: bytes, where: str) -> Request:
    try:
        return _req_dec.decode(value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{where}: not a request record: {e}") from None


def decode_worker(value: bytes, where: str) -> Worker:
    try:
        return _worker_dec.decode(value)
    except msgspec.DecodeError as e:
        raise ValueError(f"{where}: not a worker record: {e}") from None


def encode(obj: Request | Worker) -> bytes:
    """A record's JSON (the body of its signed envelope)."""
    return msgspec.json.encode(obj)


def open_request(trust: FarmTrust, item: KeyValue) -> tuple[Request, Envelope]:
    """A request record signed by a farm server `trust` pins, stored under its own
    id; Untrusted (the reason) otherwise."""
    env = open_envelope(item.key, item.value)
    if not trust.is_server(env):
        raise Untrusted(f"signed by {env.signer!r}, not by a farm server this host pins")
    try:
        req = decode_request(env.body.encode(), item.key)
    except ValueError as e:
        raise Untrusted(str(e)) from None
    if req_key(req.id) != item.key:
        raise Untrusted(f"it holds request {req.id}, not the one of its key")
    if req.state == model.WAITING and env.term != 0:
        # only API servers write a WAITING request; the matcher never does
        raise Untrusted(f"a WAITING request signed with a matcher's term ({env.term})")
    return req, env


def alive_value(trust: FarmTrust, uuid: str, servers: list[str]) -> bytes:
    """The value of `farm/alive/<uuid>`: the servers the worker hands its job keys
    to, signed by the worker's host (nobody else can keep a dead worker alive nor
    send its acquires elsewhere)."""
    body = msgspec.json.encode(Alive(servers=sorted(servers)))
    return trust.seal(f"{ALIVE}{uuid}", body)


def open_alive(trust: FarmTrust, item: KeyValue, worker: Worker) -> Alive:
    """An alive key signed by `worker`'s own host (its pinned key) or a farm server
    `trust` pins (as a worker record may be), stored under its uuid; Untrusted (the
    reason) otherwise: a reader takes it for absent."""
    if item.key != f"{ALIVE}{worker.uuid}":
        raise Untrusted(f"not the alive key of worker {worker.uuid}")
    env = open_envelope(item.key, item.value)
    if not (trust.is_server(env) or trust.is_host(env, worker.caps.get("hostname", ""))):
        raise Untrusted(
            f"signed by {env.signer!r}, neither the worker's own host nor a farm server "
            "this host pins"
        )
    try:
        return _alive_dec.decode(env.body)
    except msgspec.DecodeError:
        raise Untrusted("not an alive record") from None


def open_worker(trust: FarmTrust, item: KeyValue) -> tuple[Worker, Envelope]:
    """A worker record signed by a farm server `trust` pins, or by the worker's own
    host (its pinned key), stored under its own uuid; Untrusted otherwise."""
    env = open_envelope(item.key, item.value)
    try:
        w = decode_worker(env.body.encode(), item.key)
    except ValueError as e:
        raise Untrusted(str(e)) from None
    if worker_key(w.uuid) != item.key:
        raise Untrusted(f"it holds worker {w.uuid}, not the one of its key")
    if not (trust.is_server(env) or trust.is_host(env, w.caps.get("hostname", ""))):
        raise Untrusted(
            f"signed by {env.signer!r}, neither a farm server this host pins nor the "
            "worker's own host"
        )
    return w, env


class Farm:
    """The operations, for one serving agent (`host`), which signs what it writes
    and trusts what `trust` does. `collector` brings the keys workers export to
    this host (None: acquire_worker is not served here)."""

    def __init__(
        self,
        kv: KV,
        *,
        trust: FarmTrust,
        host: str = "",
        collector: Collector | None = None,
        settings: FarmSettings | None = None,
        clock: Clock = SYSTEM,
        local: LocalWorker | None = None,
    ) -> None:
        self.kv = kv
        self.trust = trust
        self.host = host or trust.me
        self.collector = collector
        self.local = local
        #: key -> (mod revision, value, the checked record or None)
        self._checked: dict[str, tuple[int, bytes, Request | Worker | None]] = {}
        self.settings = settings or FarmSettings()
        self.clock = clock

    # -- reading ------------------------------------------------------------------------
    async def _seq(self, key: str = SEQ) -> tuple[int, int]:
        """A counter (`farm/seq`, `farm/queued`) and its mod revision (0: none yet)."""
        item = await self.kv.get(key)
        if item is None:
            return 0, 0
        try:
            return int(item.value), item.mod_revision
        except ValueError:
            raise WorldError(f"{key}: not a number") from None

    async def _queued(self) -> tuple[int, int]:
        """The last queue position and its mod revision: at least the last id (a
        World from before `farm/queued` ordered its queue by id)."""
        (q, mod), (n, _) = await asyncio.gather(self._seq(QUEUED), self._seq(SEQ))
        return max(q, n), mod

    def _sealed(self, key: str, obj: Request | Worker, prev: int) -> Put:
        return Put(key, self.trust.seal(key, encode(obj), prev=prev))

    def trusted_request(self, item: KeyValue) -> Request | None:
        """The request record if trusted; None (logged once) otherwise."""
        return self._open_request(item)

    def trusted_worker(self, item: KeyValue) -> Worker | None:
        """The worker record if trusted; None (logged once) otherwise."""
        return self._open_worker(item)

    def _opened(self, item: KeyValue, is_request: bool) -> Request | Worker | None:
        """The trusted record, or None (refused, logged once). Checked once per
        version: a list of many records verifies only what changed."""
        hit = self._checked.get(item.key)
        if hit is not None and hit[0] == item.mod_revision and hit[1] == item.value:
            return hit[2]
        rec: Request | Worker | None
        try:
            if is_request:
                rec = open_request(self.trust, item)[0]
            else:
                rec = open_worker(self.trust, item)[0]
        except UnknownSigner as e:
            self.trust.refuse(item, str(e))
            return None  # not remembered: the signer's key may come in a moment
        except Untrusted as e:
            self.trust.refuse(item, str(e))
            rec = None
        if len(self._checked) >= _CHECKED_MAX:
            self._checked.clear()
        self._checked[item.key] = (item.mod_revision, item.value, rec)
        return rec

    def _open_request(self, item: KeyValue) -> Request | None:
        rec = self._opened(item, True)
        return rec if isinstance(rec, Request) else None

    def _open_worker(self, item: KeyValue) -> Worker | None:
        rec = self._opened(item, False)
        return rec if isinstance(rec, Worker) else None

    async def _request(self, rid: int) -> tuple[Request, int]:
        """A trusted request record (one that is not is absent)."""
        item = await self.kv.get(req_key(rid))
        req = self._open_request(item) if item is not None else None
        if item is None or req is None:
            raise NotFound("request", rid)
        return req, item.mod_revision

    async def _worker(self, uuid: str) -> tuple[Worker, int]:
        item = await self.kv.get(worker_key(uuid))
        w = self._open_worker(item) if item is not None else None
        if item is None or w is None:
            raise NotFound("worker", uuid)
        return w, item.mod_revision

    @staticmethod
    def may_send_fragment(user: User) -> None:
        """Forbidden unless `user` may send a graph fragment: a worker applies it as
        root, so it is a right given with the token (`--fragment`), or an admin's."""
        if not (user.admin or user.fragment):
            raise Forbidden(
                "a graph fragment needs a token created with --fragment (or an admin's)"
            )

    @staticmethod
    def _may_see(user: User, req: Request) -> None:
        if not user.admin and req.owner != user.name:
            raise NotFound("request", req.id)  # others' requests do not exist

    async def request(self, user: User, rid: int) -> Request:
        req, _ = await self._request(rid)
        self._may_see(user, req)
        return req

    async def requests(self, user: User) -> list[Request]:
        """Every request this user may see (an admin: all), by id."""
        items, _ = await self.kv.range(REQS)
        out = []
        for item in items:
            req = self._open_request(item)
            if req is None:
                continue
            if user.admin or req.owner == user.name:
                out.append(req)
        return out

    async def workers(self) -> list[Worker]:
        items, _ = await self.kv.range(WORKERS)
        return [w for item in items if (w := self._open_worker(item)) is not None]

    async def worker(self, uuid: str) -> Worker:
        return (await self._worker(uuid))[0]

    # -- requests -------------------------------------------------------------------------
    async def new_request(
        self,
        user: User,
        *,
        priority: int,
        caps: dict[str, str] | None = None,
        valid_after: float = 0.0,
        deadline: float = 0.0,
        fragment: str | None = None,
    ) -> int:
        """A new WAITING request owned by `user` (groups from the token); its id."""
        if fragment:
            self.may_send_fragment(user)
        for _ in range(ATTEMPTS):
            n, mod = await self._seq()
            q, qmod = await self._queued()
            req = model.new_request(
                id=n + 1,
                owner=user.name,
                priority=priority,
                now=self.clock.time(),
                queued=q + 1,
                groups=user.groups,
                caps=caps,
                valid_after=valid_after,
                deadline=deadline,
                fragment=fragment,
                deadline_period=self.settings.deadline_period,
            )
            ops = [
                Put(SEQ, str(n + 1).encode()),
                Put(QUEUED, str(q + 1).encode()),
                self._sealed(req_key(n + 1), req, 0),
            ]
            compares = [Compare(SEQ, mod), Compare(QUEUED, qmod)]
            if await self.kv.txn(compares, ops) is not None:
                log.info("farm: request %d by %s (priority %d)", n + 1, user.name, priority)
                return n + 1
        raise WorldError("farm: the request counter kept changing; try again")

    async def update_request(
        self,
        user: User,
        rid: int,
        *,
        priority: int = 0,
        valid_after: float = 0.0,
        deadline: float = 0.0,
    ) -> None:
        for _ in range(ATTEMPTS):
            req, mod = await self._request(rid)
            self._may_see(user, req)
            q, qmod = await self._queued()
            new = model.update_request(
                req,
                self.clock.time(),
                queued=q + 1,
                priority=priority,
                valid_after=valid_after,
                deadline=deadline,
            )
            if new is req:
                return
            compares = [Compare(req_key(rid), mod)]
            ops: list[Put | Delete] = [self._sealed(req_key(rid), new, mod)]
            if new.queued != req.queued:  # to the tail of its new priority
                compares.append(Compare(QUEUED, qmod))
                ops.append(Put(QUEUED, str(q + 1).encode()))
            if await self.kv.txn(compares, ops) is not None:
                return
        raise WorldError(f"farm: request {rid} kept changing; try again")

    async def close_request(self, user: User, rid: int) -> None:
        """WAITING -> CANCELLED; IN PROGRESS -> DONE (the worker is released: its
        agent revokes the job's key)."""
        for _ in range(ATTEMPTS):
            req, mod = await self._request(rid)
            self._may_see(user, req)
            new = model.close_request(req)
            compares = [Compare(req_key(rid), mod)]
            ops: list[Put | Delete] = [self._sealed(req_key(rid), new, mod)]
            if req.job is not None:
                with contextlib.suppress(NotFound):
                    w, wmod = await self._worker(req.job.worker)
                    if w.job == rid and w.state == model.RUNNING:
                        compares.append(Compare(worker_key(w.uuid), wmod))
                        ops.append(self._sealed(worker_key(w.uuid), model.release_worker(w), wmod))
            if await self.kv.txn(compares, ops) is not None:
                log.info("farm: request %d closed by %s: %s", rid, user.name, new.state)
                return
        raise WorldError(f"farm: request {rid} kept changing; try again")

    async def prolong(self, user: User, rid: int) -> None:
        for _ in range(ATTEMPTS):
            req, mod = await self._request(rid)
            self._may_see(user, req)
            new = model.prolong(
                req, self.clock.time(), self.settings.job_period, self.settings.max_prolong
            )
            ops: list[Put | Delete] = [self._sealed(req_key(rid), new, mod)]
            if await self.kv.txn([Compare(req_key(rid), mod)], ops) is not None:
                return
        raise WorldError(f"farm: request {rid} kept changing; try again")

    async def wait_started(self, user: User, rid: int, wait: float) -> Request:
        """The request once it left WAITING (or as it is when `wait` runs out)."""
        req = await self.request(user, rid)
        if req.state != model.WAITING or wait <= 0:
            return req
        with contextlib.suppress(TimeoutError):
            async with (
                self.clock.timeout(wait),
                contextlib.aclosing(watch_one(self.kv, req_key(rid))) as snaps,
            ):
                async for snap in snaps:
                    if isinstance(snap, Tombstone):
                        raise NotFound("request", rid)
                    seen = self._open_request(snap)
                    if seen is None:
                        continue  # untrusted: as if absent; wait for a signed one
                    req = seen
                    if req.state != model.WAITING:
                        break
        return req

    async def acquire(self, user: User, rid: int, wait: float | None = None) -> Access:
        """Where and how to reach the worker of an IN PROGRESS request: waits while it
        is WAITING (up to `wait`; 0 = answer at once), then fetches the job's key."""
        wait = self.settings.acquire_wait if wait is None else wait
        started = self.clock.monotonic()
        req = await self.wait_started(user, rid, wait)
        if req.state != model.IN_PROGRESS or req.job is None:
            raise Refused(f"request {rid} is {req.state}: only an IN PROGRESS request has a worker")
        w = await self.worker(req.job.worker)
        if self.collector is None:
            raise Refused("this agent does not serve worker keys (it has no World identity)")
        await self._serves(w)
        left = max(1.0, wait - (self.clock.monotonic() - started)) if wait > 0 else 10.0
        key = await self._key_for(rid, w, left)
        return Access(ip=w.address, port=w.port, username=w.username, key=key)

    async def _key_for(self, rid: int, w: Worker, wait: float) -> str:
        """Ask the worker for the job's key (a demand record) and wait for it to arrive,
        sealed to this host and signed by the worker's pinned key."""
        assert self.collector is not None
        if self.local is not None and self.local.uuid == w.uuid:
            return await self._local_key(rid, self.local, wait)
        collector = self.collector
        src = w.caps.get("hostname", "")

        def found() -> str | None:
            for e in collector.current():
                if e.kind == ACCESS and e.name == str(rid) and e.src == src:
                    key = e.params.get("key")
                    if isinstance(key, str) and e.params.get("worker") == w.uuid:
                        return key
            return None

        key = found()
        if key is not None:
            return key
        changed = asyncio.Event()
        unlisten = collector.listen(changed.set)
        demand = f"{DEMAND}{rid}/{self.host}"
        try:
            await self.kv.put(demand, msgspec.json.encode({"at": self.clock.time()}))
            async with self.clock.timeout(wait):
                while (key := found()) is None:
                    await changed.wait()
                    changed.clear()
        except TimeoutError:
            raise Refused(
                f"the worker of request {rid} did not hand over its key in {wait:.0f} s"
            ) from None
        finally:
            unlisten()
        return key

    async def _serves(self, w: Worker) -> None:
        """Refused at once (naming them) if the worker hands its job keys only to
        other agents than this one: waiting for the key would be in vain."""
        item = await self.kv.get(f"{ALIVE}{w.uuid}")
        if item is None:
            return
        try:
            servers = open_alive(self.trust, item, w).servers
        except Untrusted as e:
            self.trust.refuse(item, str(e))
            return  # forged (or an older worker's): it says nothing
        if servers and self.host not in servers:
            raise Refused(
                f"worker {w.uuid} hands its job keys only to its farm servers "
                f"({', '.join(sorted(servers))}), and this agent ({self.host}) is none "
                "of them: acquire the worker through one of those"
            )

    async def _local_key(self, rid: int, local: LocalWorker, wait: float) -> str:
        """The key of this agent's own worker's job, once the worker started it."""
        changed = asyncio.Event()
        unlisten = local.listen(changed.set)
        try:
            async with self.clock.timeout(wait):
                while (key := local.job_key(rid)) is None:
                    await changed.wait()
                    changed.clear()
        except TimeoutError:
            raise Refused(f"this agent's worker did not start the job of request {rid}") from None
        finally:
            unlisten()
        return key

    # -- workers (admin) ---------------------------------------------------------------------
    @staticmethod
    def _admin(user: User) -> None:
        if not user.admin:
            raise Forbidden("an admin route: this token is not an admin's")

    async def _update_worker(self, uuid: str, change: Callable[[Worker], Worker]) -> Worker:
        for _ in range(ATTEMPTS):
            w, mod = await self._worker(uuid)
            new = change(w)
            ops: list[Put | Delete] = [self._sealed(worker_key(uuid), new, mod)]
            if await self.kv.txn([Compare(worker_key(uuid), mod)], ops) is not None:
                return new
        raise WorldError(f"farm: worker {uuid} kept changing; try again")

    async def set_state(self, user: User, uuid: str, state: str) -> None:
        self._admin(user)
        await self._update_worker(uuid, lambda w: model.set_state(w, state))

    async def set_groups(self, user: User, uuid: str, groups: list[str]) -> None:
        self._admin(user)
        await self._update_worker(uuid, lambda w: model.set_groups(w, groups))

    async def deregister(self, user: User, uuid: str) -> None:
        self._admin(user)
        for _ in range(ATTEMPTS):
            w, mod = await self._worker(uuid)
            model.deregister_worker(w)
            if await self.kv.txn([Compare(worker_key(uuid), mod)], [Delete(worker_key(uuid))]):
                return
        raise WorldError(f"farm: worker {uuid} kept changing; try again")
