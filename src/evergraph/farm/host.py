"""This agent as a farm worker (`run --worker`): registers `farm/workers/<uuid>`,
stays alive under the agent's lease, and serves its jobs.

Per job it makes a fresh RSA key pair; the agent installs the public key (an
`ssh_authorized_key` resource) and the request's graph fragment for the job's
lifetime (`job` / `listen`); the private key goes, sealed and signed, only to the
agents that ask for it to serve `acquire_worker` (`farm/demand/<id>/<host>`), as
an export of kind `farm.access`. When the job ends (closed, timed out, failed)
the resources leave the graph (the key is revoked) and the export is withdrawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from evergraph._util.clock import SYSTEM, Clock
from evergraph.farm import model
from evergraph.farm.access import new_key_pair
from evergraph.farm.service import (
    ACCESS,
    ALIVE,
    DEMAND,
    Alive,
    decode_request,
    decode_worker,
    encode,
    req_key,
    worker_key,
)
from evergraph.world.exports import Publisher
from evergraph.world.follow import SimpleFollower, Tombstone, follow, watch_one
from evergraph.world.kv import KV, Compare, KeyValue, Put

log = logging.getLogger("evergraph.farm")


@dataclass(frozen=True)
class Job:
    """The job this worker runs now."""

    request: int
    #: the OpenSSH public key line to authorize for the job
    public_key: str
    #: the request's graph fragment (YAML), applied for the job's lifetime
    fragment: str | None


class WorkerHost:
    def __init__(
        self,
        kv: KV,
        *,
        uuid: str,
        host: str,
        caps: dict[str, str],
        groups: list[str],
        address: str,
        port: int,
        username: str,
        lease: Callable[[], int],
        publisher: Publisher,
        key_servers: set[str],
        clock: Clock = SYSTEM,
    ) -> None:
        """`key_servers`: the agents this worker hands job keys to (`--farm-server`):
        a demand names a host, and anyone may write one, so only these (whose keys
        are pinned) ever receive a key, sealed to them."""
        self.kv = kv
        self.uuid = uuid
        self.host = host
        self.caps = caps
        self.groups = groups
        self.address = address
        self.port = port
        self.username = username
        self.lease = lease
        self.publisher = publisher
        self.key_servers = key_servers
        self.clock = clock
        self._refused: set[str] = set()
        #: the running job (None between jobs)
        self.job: Job | None = None
        self._private: bytes = b""
        self._listeners: list[Callable[[], None]] = []
        self._demands: set[str] = set()

    def listen(self, fn: Callable[[], None]) -> Callable[[], None]:
        """`fn()` after the job changed (the agent re-merges the job's resources)."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    async def register(self) -> None:
        """Create the worker's record (MAINTENANCE until an admin makes it IDLE), or
        refresh its caps and address, keeping its state, groups and job."""
        key = worker_key(self.uuid)
        for _ in range(50):
            item = await self.kv.get(key)
            now = self.clock.time()
            if item is None:
                w = model.register_worker(
                    uuid=self.uuid,
                    caps=self.caps,
                    address=self.address,
                    port=self.port,
                    username=self.username,
                    now=now,
                    groups=self.groups,
                )
                if await self.kv.cas(key, encode(w), expect=0):
                    log.info("farm: registered as worker %s (MAINTENANCE)", self.uuid)
                    return
                continue
            prev = decode_worker(item.value, key)
            w = model.reregister_worker(
                prev,
                caps=self.caps,
                address=self.address,
                port=self.port,
                username=self.username,
                now=now,
            )
            if await self.kv.txn([Compare(key, item.mod_revision)], [Put(key, encode(w))]):
                return
        raise RuntimeError(f"{key} kept changing while it was registered")

    async def alive(self) -> None:
        """(Re)write `farm/alive/<uuid>` under the agent's lease."""
        value = msgspec.json.encode(Alive(servers=sorted(self.key_servers)))
        await self.kv.put(f"{ALIVE}{self.uuid}", value, lease=self.lease())

    def job_key(self, rid: int) -> str | None:
        """The private key of request `rid`'s job if this worker runs it now (for the
        acquire_worker this very agent serves)."""
        if self.job is None or self.job.request != rid:
            return None
        return self._private.decode()

    async def run(self) -> None:
        await self.alive()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._follow_record())
            demands = SimpleFollower(
                on_new_updated=self._seen, on_deleted=self._gone, on_batch_done=self._demanded
            )
            tg.create_task(follow(self.kv, DEMAND, demands))

    # -- the job ----------------------------------------------------------------------------
    async def _follow_record(self) -> None:
        async with contextlib.aclosing(watch_one(self.kv, worker_key(self.uuid))) as snaps:
            async for snap in snaps:
                if isinstance(snap, Tombstone):
                    await self._set_job(None)  # deregistered
                    continue
                try:
                    w = decode_worker(snap.value, snap.key)
                except ValueError as e:
                    log.error("farm: %s", e)
                    continue
                await self._set_job(w.job if w.state == model.RUNNING else None)

    async def _set_job(self, rid: int | None) -> None:
        if (self.job.request if self.job else None) == rid:
            return
        if rid is None:
            if self.job is not None:
                log.info("farm: job of request %d ended: access revoked", self.job.request)
            self.job, self._private = None, b""
        else:
            item = await self.kv.get(req_key(rid))
            fragment = None
            if item is not None:
                with contextlib.suppress(ValueError):
                    fragment = decode_request(item.value, item.key).fragment
            private, public = new_key_pair()
            self.job, self._private = Job(rid, f"{public} evergraph-job-{rid}", fragment), private
            log.info("farm: job of request %d started: a fresh key is authorized", rid)
        self._export()
        for fn in list(self._listeners):
            fn()

    # -- handing the key over -----------------------------------------------------------------
    def _seen(self, kv: KeyValue) -> None:
        self._demands.add(kv.key)

    def _gone(self, kv: KeyValue) -> None:
        self._demands.discard(kv.key)

    def _demanded(self) -> None:
        self._export()

    def _export(self) -> None:
        """Export the job's key to every agent that asked for it (sealed to each)."""
        items = []
        if self.job is not None:
            prefix = f"{DEMAND}{self.job.request}/"
            for key in sorted(self._demands):
                if key.startswith(prefix):
                    to = key[len(prefix) :]
                    if to not in self.key_servers:
                        if key not in self._refused:
                            self._refused.add(key)
                            log.warning(
                                "farm: %s asks for the key of request %d, but is not one of "
                                "this worker's --farm-server hosts: refused",
                                to,
                                self.job.request,
                            )
                        continue
                    params = {
                        "key": self._private.decode(),
                        "worker": self.uuid,
                        "request": self.job.request,
                    }
                    items.append((to, ACCESS, str(self.job.request), params))
        self.publisher.set(items, source="farm")
