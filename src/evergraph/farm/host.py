"""This agent as a farm worker (`run --worker`): registers `farm/workers/<uuid>`,
stays alive under the agent's lease, and serves its jobs.

Per job it makes a fresh RSA key pair; the agent installs the public key (an
`ssh_authorized_key` resource) and the request's graph fragment for the job's
lifetime (`job` / `listen`); the private key goes, sealed and signed, only to the
agents that ask for it to serve `acquire_worker` (`farm/demand/<id>/<host>`), as
an export of kind `farm.access`. When the job ends (closed, timed out, failed)
the resources leave the graph (the key is revoked) and the export is withdrawn.

Nothing in the World is acted on as found (`farm.signed`): a job starts only when
the worker record is signed by the farm's current leader (a farm server this
worker pins, `--farm-server NAME=KEY`) with the current term of the `farm`
election, is not older than a version already seen, and the job's request is
signed by a pinned farm server, IN PROGRESS on this worker. Anything else is
refused before any effect (no key made, no fragment applied), logged once per
record revision. The worker keeps its own record: gone (deleted, a World wiped)
or failing verification, it is registered again (and `farm/alive/<uuid>` too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from evergraph._util.atomic import ThrottledFile
from evergraph._util.clock import SYSTEM, Clock
from evergraph.cluster.election import election_key
from evergraph.cluster.exports import Publisher
from evergraph.farm import model
from evergraph.farm.access import new_key_pair
from evergraph.farm.model import Worker
from evergraph.farm.service import (
    ACCESS,
    ALIVE,
    DEMAND,
    alive_value,
    encode,
    open_request,
    open_worker,
    req_key,
    worker_key,
)
from evergraph.farm.signed import Envelope, FarmTrust, Untrusted
from evergraph.world.follow import SimpleFollower, Tombstone, follow, watch_one
from evergraph.world.kv import KV, Compare, KeyValue, Put, WorldError

#: the file in the state dir holding the worker's replay mark
MARKS_FILE = "farm-marks.json"


class _Mark(msgspec.Struct, frozen=True):
    """The newest version (mod revision) of this worker's record seen, in `world`."""

    world: str
    high: int


_marks_dec = msgspec.json.Decoder(_Mark)

#: the election whose leader assigns jobs (and whose term an assignment carries)
FARM_ELECTION = "farm"

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
        trust: FarmTrust,
        clock: Clock = SYSTEM,
        state_dir: Path | None = None,
    ) -> None:
        """`key_servers`: the agents this worker hands job keys to (`--farm-server`):
        a demand names a host, and anyone may write one, so only these (whose keys
        are pinned explicitly) ever receive a key, sealed to them. `trust`: this
        host's signer and the farm servers it pins. `state_dir`: where the replay
        mark (the newest version of our record seen, per World) is kept across
        restarts."""
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
        self.trust = trust
        self.clock = clock
        #: the newest trusted version of our record: its mod revision (an older
        #: version put back is a replay) and its content (what a restore keeps)
        self._high = 0
        self._marks_path = state_dir / MARKS_FILE if state_dir is not None else None
        self._marks: ThrottledFile | None = None
        self._load_marks()
        #: the alive key's value as this host wrote it last
        self._alive = b""
        self._last: Worker | None = None
        self._epoch = kv.epoch
        self._refused: set[str] = set()
        #: the running job (None between jobs)
        self.job: Job | None = None
        self._private: bytes = b""
        self._listeners: list[Callable[[], None]] = []
        self._demands: set[str] = set()

    def _load_marks(self) -> None:
        """The replay mark an earlier run kept, if it is of this World (a World
        replaced since, or another one: its revisions mean nothing here)."""
        if self._marks_path is None:
            return
        try:
            mark = _marks_dec.decode(self._marks_path.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, msgspec.DecodeError) as e:
            log.error("farm: %s: cannot read the replay mark (%s)", self._marks_path, e)
            return
        if mark.world and mark.world == self.kv.world_id:
            self._high = mark.high

    def _high_changed(self) -> None:
        if self._marks_path is None:
            return
        if self._marks is None:
            world = self.kv.world_id
            self._marks = ThrottledFile(
                self._marks_path, lambda: msgspec.json.encode(_Mark(world=world, high=self._high))
            )
        self._marks.changed()

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
            prev: Worker | None = self._last
            if item is not None:
                try:
                    prev = open_worker(self.trust, item)[0]
                except Untrusted as e:
                    self.trust.refuse(item, f"{e}; registering this worker again")
            if prev is None:
                w = model.register_worker(
                    uuid=self.uuid,
                    caps=self.caps,
                    address=self.address,
                    port=self.port,
                    username=self.username,
                    now=now,
                    groups=self.groups,
                )
            else:
                w = model.reregister_worker(
                    prev,
                    caps=self.caps,
                    address=self.address,
                    port=self.port,
                    username=self.username,
                    now=now,
                )
            mod = item.mod_revision if item is not None else 0
            value = self.trust.seal(key, encode(w), prev=mod)
            if await self.kv.txn([Compare(key, mod)], [Put(key, value)]):
                if prev is None:
                    log.info("farm: registered as worker %s (MAINTENANCE)", self.uuid)
                return
        raise RuntimeError(f"{key} kept changing while it was registered")

    async def alive(self) -> None:
        """(Re)write `farm/alive/<uuid>` under the agent's lease."""
        value = self._alive = alive_value(self.trust, self.uuid, sorted(self.key_servers))
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
            tg.create_task(self._keep_alive_key())
            demands = SimpleFollower(
                on_new_updated=self._seen, on_deleted=self._gone, on_batch_done=self._demanded
            )
            tg.create_task(follow(self.kv, DEMAND, demands))

    async def _keep_alive_key(self) -> None:
        """Put `farm/alive/<uuid>` back whenever it vanishes or someone else changes it
        while we live (readers ignore one not signed by this host: a forged one would
        not keep us alive)."""
        async with contextlib.aclosing(watch_one(self.kv, f"{ALIVE}{self.uuid}")) as snaps:
            async for snap in snaps:
                if not self.lease():
                    continue
                gone = isinstance(snap, Tombstone)
                if gone or (isinstance(snap, KeyValue) and snap.value != self._alive):
                    what = "vanished" if gone else "changed by someone else"
                    log.warning("farm: %s%s %s: put back", ALIVE, self.uuid, what)
                    try:
                        await self.alive()
                    except WorldError as e:
                        log.warning("farm: cannot put back %s%s: %s", ALIVE, self.uuid, e)

    # -- the job ----------------------------------------------------------------------------
    async def _follow_record(self) -> None:
        async with contextlib.aclosing(watch_one(self.kv, worker_key(self.uuid))) as snaps:
            async for snap in snaps:
                if self.kv.epoch != self._epoch or (
                    isinstance(snap, KeyValue) and snap.mod_revision < self._high
                ):
                    # another World (revisions started again): what we saw is void
                    self._epoch, self._high = self.kv.epoch, 0
                    self._marks = None  # (a mark of the World now)
                # neither a vanished nor an untrusted record changes the job: the
                # record is put back (as last seen) and the leader, finding it
                # ours, signs it again or releases the job
                if isinstance(snap, Tombstone):
                    log.warning("farm: %s vanished: registering again", snap.key)
                    await self._restore()
                    continue
                try:
                    w, env = open_worker(self.trust, snap)
                    if not self.trust.is_server(env):  # this host or a pinned server
                        raise Untrusted(f"signed by {env.signer!r}, not by a farm server")
                    if env.prev < self._high and not (env.prev == 0 and w.job is None):
                        raise Untrusted("older than a version already seen (put back: a replay)")
                except Untrusted as e:
                    self.trust.refuse(snap, str(e))
                    await self._restore()
                    continue
                high, self._high = self._high, snap.mod_revision
                self._high_changed()
                running = w.job if w.state == model.RUNNING else None
                if running is not None and self.job is not None and self.job.request == running:
                    self._last = w
                    continue  # the job we run, signed again or prolonged
                if running is None:
                    self._last = w
                    await self._set_job(None)
                    continue
                job = await self._admit(snap, w, env, running, high)
                if job is not None:
                    self._last = w  # (a refused assignment is never what we restore)
                await self._set_job(job)

    async def _restore(self) -> None:
        try:
            await self.register()
        except (WorldError, RuntimeError, model.Refused) as e:
            log.warning("farm: cannot register this worker again: %s", e)

    async def _admit(
        self, item: KeyValue, w: Worker, env: Envelope, rid: int, high: int
    ) -> tuple[int, str | None] | None:
        """(request, fragment) if this assignment may start a job; None (refused,
        logged once) otherwise. Nothing is made before every check passed."""
        why = await self._assignment_problem(env, rid, high)
        if isinstance(why, str):
            self.trust.refuse(item, why)
            return None
        return rid, why[0]

    async def _assignment_problem(
        self, env: Envelope, rid: int, high: int
    ) -> str | tuple[str | None]:
        """Why the assignment of request `rid` is not to be acted on, or (fragment,)."""
        if not self.trust.is_server(env):
            return (
                f"assigns request {rid}, but is signed by {env.signer!r}, not by the farm's leader"
            )
        lead = await self.kv.get(election_key(FARM_ELECTION))
        if lead is None:
            return f"assigns request {rid}, but the farm has no leader now"
        leader = lead.value.decode("utf-8", "replace")
        if env.signer != leader:
            return f"assigns request {rid}, signed by {env.signer!r}, but {leader!r} leads the farm"
        if env.term != lead.mod_revision:
            return (
                f"assigns request {rid} in term {env.term}, but the farm's term is "
                f"{lead.mod_revision} (an old assignment)"
            )
        if env.prev < high:
            return f"assigns request {rid}, but is older than a version already seen (replayed)"
        item = await self.kv.get(req_key(rid))
        if item is None:
            return f"assigns request {rid}, which does not exist"
        try:
            req, renv = open_request(self.trust, item)
        except Untrusted as e:
            return f"assigns request {rid}, whose record is refused: {e}"
        if req.state != model.IN_PROGRESS or req.job is None or req.job.worker != self.uuid:
            return f"assigns request {rid}, which is {req.state}, not IN PROGRESS on this worker"
        if renv.term not in (0, env.term):
            return (
                f"assigns request {rid} in term {env.term}, but the request was started in "
                f"term {renv.term}"
            )
        return (req.fragment,)

    async def _set_job(self, job: tuple[int, str | None] | None) -> None:
        rid = job[0] if job is not None else None
        if (self.job.request if self.job else None) == rid:
            return
        if job is None:
            if self.job is not None:
                log.info("farm: job of request %d ended: access revoked", self.job.request)
            self.job, self._private = None, b""
        else:
            rid, fragment = job
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
