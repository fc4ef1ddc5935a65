"""The farm's matcher loop, run by whichever agent leads the `farm` election.

While it leads, it follows the requests, the workers and their alive keys, and
after every change (or when a timer is due: a valid_after, a deadline, a job
timeout) runs the pure matcher on the snapshot and applies the plan. Every write
is one transaction conditioned on the leader key's revision (the term) and on
the revision of each record it read: a deposed leader, still believing it leads,
cannot write, and a record that changed meanwhile is left for the next pass.
So a worker never holds two jobs, whatever dies when.

Every record it writes is signed with its host key and its term (`farm.signed`);
records not signed by a farm server it pins (or, for a worker's registration, by
the worker's own host) are treated as absent, logged once. A worker acts only on
an assignment of the current term: on taking office, the leader signs the
records of the jobs still running again, with its own term.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

import msgspec

from evergraph._util.clock import SYSTEM, Clock
from evergraph.cluster.election import Election
from evergraph.farm import matcher, model
from evergraph.farm.model import Refused, Request, Worker
from evergraph.farm.service import (
    ALIVE,
    FARM,
    REQS,
    WORKERS,
    FarmSettings,
    encode,
    open_alive,
    open_request,
    open_worker,
    req_key,
    worker_key,
)
from evergraph.farm.signed import Envelope, FarmTrust, UnknownSigner, Untrusted
from evergraph.world.follow import Follower, follow
from evergraph.world.kv import KV, Compare, Delete, KeyValue, Put, WorldError

log = logging.getLogger("evergraph.farm")

T = TypeVar("T")
#: seconds before a record signed by a host of unknown key is checked again
_UNKNOWN_RETRY = 0.2
#: a record to write: its key, the record, and the mod revision it replaces
Write = tuple[str, Request | Worker, int]


class _Records(Follower[KeyValue]):
    """Every record under `farm/`, in ONE follow: a transaction is one revision and
    one batch, so the requests, workers and alive keys seen together after a batch
    are a consistent snapshot (followed apart, a request could be seen IN PROGRESS
    before its worker's RUNNING record, and be failed for it)."""

    def __init__(self) -> None:
        self.reqs: dict[str, KeyValue] = {}
        self.workers: dict[str, KeyValue] = {}
        self.alive: dict[str, KeyValue] = {}
        #: request records deleted (the farm never deletes one): key -> last version
        self.gone: dict[str, KeyValue] = {}
        self.changed = asyncio.Event()
        self.ready = asyncio.Event()

    def _bucket(self, key: str) -> dict[str, KeyValue] | None:
        if key.startswith(REQS):
            return self.reqs
        if key.startswith(WORKERS):
            return self.workers
        if key.startswith(ALIVE):
            return self.alive
        return None

    def filter(self, obj: KeyValue) -> bool:
        return self._bucket(obj.key) is not None

    def equals(self, a: KeyValue, b: KeyValue) -> bool:
        return a.mod_revision == b.mod_revision

    async def new(self, obj: KeyValue) -> None:
        bucket = self._bucket(obj.key)
        if bucket is not None:
            bucket[obj.key] = obj

    async def updated(self, prev: KeyValue, new: KeyValue) -> None:
        await self.new(new)

    async def deleted(self, prev: KeyValue) -> None:
        bucket = self._bucket(prev.key)
        if bucket is not None:
            bucket.pop(prev.key, None)
        if bucket is self.reqs:
            self.gone[prev.key] = prev

    async def batch_done(self) -> None:
        self.changed.set()

    async def synced(self) -> None:
        self.ready.set()
        self.changed.set()


class FarmLeader:
    def __init__(
        self,
        kv: KV,
        election: Election,
        trust: FarmTrust,
        settings: FarmSettings | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.kv = kv
        self.election = election
        self.trust = trust
        self.settings = settings or FarmSettings()
        self.clock = clock
        #: passes run and transactions refused (tests, benchmarks)
        self.passes = 0
        self.refused = 0
        #: key -> (mod revision, verified record): a pass checks only what changed
        self._cache: dict[str, tuple[int, Any]] = {}
        #: WAITING request -> since when (clock.time) no registered worker could
        #: serve it: INVALID only after `settings.invalid_grace` of that
        self._unfit_since: dict[int, float] = {}
        #: worker uuid -> since when (clock.time) its alive key is gone: FAILED only
        #: after `settings.alive_grace` of that
        self._missing_since: dict[str, float] = {}
        #: the earliest time a grace of this pass ends (a pass is due then)
        self._due_at: float | None = None
        #: key -> mod revision of the newest trusted version seen: a version whose
        #: `prev` is older was put back (a replay) and is refused
        self._high: dict[str, int] = {}
        #: alive key -> (mod revision, worker's host, signed by that host)
        self._alive_seen: dict[str, tuple[int, str, bool]] = {}
        #: running jobs found on taking office, signed by an earlier leader:
        #: worker uuid -> (request id, its mod revision), to sign again for our term
        self._inherited: dict[str, tuple[int, int]] | None = None
        #: a record of this pass was signed by a host whose key is not known yet
        self._unknown = False

    def _decoded(
        self, kv: KeyValue, decode: Callable[[FarmTrust, KeyValue], tuple[T, Envelope]]
    ) -> tuple[T, Envelope] | None:
        """The record if it is trusted; None (as if absent, logged once) otherwise."""
        hit = self._cache.get(kv.key)
        if hit is not None and hit[0] == kv.mod_revision:
            return cast(tuple[T, Envelope] | None, hit[1])
        try:
            obj: tuple[T, Envelope] | None = decode(self.trust, kv)
            assert obj is not None
            self._fresh(kv, obj[0], obj[1])
        except UnknownSigner as e:
            self.trust.refuse(kv, str(e))
            self._unknown = True  # checked again on a pass soon, not cached
            return None
        except Untrusted as e:
            self.trust.refuse(kv, str(e))
            obj = None
        self._cache[kv.key] = (kv.mod_revision, obj)
        return obj

    def _alive_ok(self, kv: KeyValue, w: Worker) -> bool:
        """Whether an alive key is the worker's own (signed by its host): a forged one
        keeps no dead worker from FAILED (refused, logged once)."""
        host = w.caps.get("hostname", "")
        hit = self._alive_seen.get(kv.key)
        if hit is not None and hit[:2] == (kv.mod_revision, host):
            return hit[2]
        try:
            open_alive(self.trust, kv, w)
            ok = True
        except UnknownSigner as e:
            self.trust.refuse(kv, str(e))
            return False  # (not remembered: its host's key may come in a moment)
        except Untrusted as e:
            self.trust.refuse(kv, str(e))
            ok = False
        if len(self._alive_seen) > 2 * len(self._cache) + 100:
            self._alive_seen.clear()
        self._alive_seen[kv.key] = (kv.mod_revision, host, ok)
        return ok

    def _fresh(self, kv: KeyValue, record: object, env: Envelope) -> None:
        """Untrusted if this version is older than one already seen (put back). A
        worker's registration (created, no job) starts its record's history anew."""
        high = self._high.get(kv.key, 0)
        if kv.mod_revision < high:
            high = 0  # revisions went back: another World
        fresh_registration = env.prev == 0 and isinstance(record, Worker) and record.job is None
        if env.prev < high and not fresh_registration:
            raise Untrusted("older than a version already seen (put back: a replay)")
        self._high[kv.key] = kv.mod_revision

    async def run(self) -> None:
        """Lead whenever elected, until cancelled."""
        await self.election.lead(self._lead, "the farm's matcher")

    async def _lead(self) -> None:
        self._unfit_since = {}  # what a past term saw says nothing of the time between
        self._missing_since = {}
        self._inherited = None  # found on the first pass of this term
        records = _Records()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow(self.kv, FARM, records))
            await records.ready.wait()
            while True:
                records.changed.clear()
                try:
                    wakeup = await self.step(
                        records.reqs, records.workers, records.alive, records.gone
                    )
                except WorldError as e:
                    log.warning("farm: matching pass failed (%s); retrying", e)
                    wakeup = self.clock.time() + 0.5
                timeout = None if wakeup is None else max(0.0, wakeup - self.clock.time())
                with contextlib.suppress(TimeoutError):
                    async with self.clock.timeout(timeout):
                        await records.changed.wait()

    async def step(
        self,
        req_items: dict[str, KeyValue],
        worker_items: dict[str, KeyValue],
        alive_items: dict[str, KeyValue],
        gone: dict[str, KeyValue] | None = None,
    ) -> float | None:
        """One matching pass over a snapshot; returns when the next one is due."""
        self.passes += 1
        now = self.clock.time()
        self._unknown = False
        self._due_at = None
        if gone:
            await self._put_back(gone)
        reqs: dict[int, tuple[Request, int]] = {}
        envs: dict[str, Envelope] = {}
        for kv in list(req_items.values()):
            rec = self._decoded(kv, open_request)
            if rec is not None:
                reqs[rec[0].id] = (rec[0], kv.mod_revision)
                envs[kv.key] = rec[1]
        workers: dict[str, tuple[Worker, int]] = {}
        for kv in list(worker_items.values()):
            wrec = self._decoded(kv, open_worker)
            if wrec is not None:
                workers[wrec[0].uuid] = (wrec[0], kv.mod_revision)
                envs[kv.key] = wrec[1]
        if len(self._cache) > 2 * (len(req_items) + len(worker_items)) + 100:
            live = req_items.keys() | worker_items.keys()
            self._cache = {k: v for k, v in self._cache.items() if k in live}
        living = {
            uuid
            for k, kv in alive_items.items()
            if (uuid := k[len(ALIVE) :]) in workers and self._alive_ok(kv, workers[uuid][0])
        }
        await self._housekeeping(reqs, workers, living, now)
        await self._reaffirm(reqs, workers, envs, worker_items)
        plan = matcher.match([r for r, _ in reqs.values()], [w for w, _ in workers.values()], now)
        plan, wakeup = self._grace(plan, now)

        def _mod(key: str) -> int:
            # a record the decision took for absent (none, or one not trusted):
            # conditioned on staying as it was (0 for "none" would never hold
            # while an untrusted record is there: the move would be refused forever)
            item = req_items.get(key) or worker_items.get(key)
            return item.mod_revision if item is not None else 0

        if plan.empty:
            return self._next(wakeup, now)
        for rid in plan.failed:
            r, mod = reqs[rid]
            # conditioned on the worker record the decision was made from, too
            uuid = r.job.worker if r.job is not None else ""
            seen = workers.get(uuid)
            wkey = worker_key(uuid)
            reads = [(req_key(rid), mod), (wkey, seen[1] if seen else _mod(wkey))]
            await self._write(reads, [(req_key(rid), model.fail_request(r), mod)])
        for rid in plan.done:
            r, mod = reqs[rid]
            await self._write(
                [(req_key(rid), mod)], [(req_key(rid), model.finish_request(r, now), mod)]
            )
        for uuid in plan.release:
            w, mod = workers[uuid]
            # conditioned on the job's request record the decision was made from, too
            job = reqs.get(w.job) if w.job is not None else None
            reads = [(worker_key(uuid), mod)]
            if w.job is not None:
                reads.append((req_key(w.job), job[1] if job else _mod(req_key(w.job))))
            await self._write(reads, [(worker_key(uuid), model.release_worker(w), mod)])
        for rid in plan.timeout:
            r, mod = reqs[rid]
            await self._write(
                [(req_key(rid), mod)], [(req_key(rid), model.expire_request(r, now), mod)]
            )
        for rid in plan.invalid:
            r, mod = reqs[rid]
            await self._write(
                [(req_key(rid), mod)], [(req_key(rid), model.invalidate_request(r), mod)]
            )
        released = set(plan.release)
        for a in plan.assign:
            if a.worker in released:
                continue  # it changes in this pass; matched again on the next
            r, rmod = reqs[a.request]
            w, wmod = workers[a.worker]
            try:
                started = model.start_request(r, a.worker, now, self.settings.job_period)
                running = model.assign_worker(w, a.request)
            except Refused as e:
                log.warning("farm: cannot start request %d: %s", a.request, e)
                continue
            ok = await self._write(
                [(req_key(a.request), rmod), (worker_key(a.worker), wmod)],
                [(req_key(a.request), started, rmod), (worker_key(a.worker), running, wmod)],
            )
            if ok:
                log.info("farm: request %d -> worker %s", a.request, a.worker)
        return self._next(wakeup, now)

    def _grace(self, plan: matcher.Plan, now: float) -> tuple[matcher.Plan, float | None]:
        """`plan` with only the INVALID moves whose grace has run out (a request
        no worker fits is kept WAITING for `invalid_grace`: its workers may come
        back), and when the next pass is due."""
        grace = self.settings.invalid_grace
        since = {rid: self._unfit_since.get(rid, now) for rid in plan.invalid}
        self._unfit_since = since
        due = [rid for rid, t in since.items() if t + grace <= now]
        later = [t + grace for t in since.values() if t + grace > now]
        wakeups = [t for t in (plan.next_wakeup, *later) if t is not None]
        if len(due) != len(plan.invalid):
            plan = msgspec.structs.replace(plan, invalid=[r for r in plan.invalid if r in due])
        return plan, min(wakeups) if wakeups else None

    async def _put_back(self, gone: dict[str, KeyValue]) -> None:
        """Requests are never deleted: one that vanished was deleted by someone else,
        and is put back as last verified (signed again, if it is still absent).
        The version the follow last knew may be one no pass has seen: on a busy
        host a write (our own, as often as not) and the delete that follows come
        in one read, and the pass runs after both; it is verified here, not looked
        up in the cache (skipped, the request would be gone for good: no later
        read reports the delete again)."""
        for key, prev in list(gone.items()):
            rec = self._decoded(prev, open_request)
            if rec is None:
                del gone[key]
                continue  # not trusted: nothing of ours to put back
            req = rec[0]
            ok = await self._write([(key, 0)], [(key, req, prev.mod_revision)])
            # forgotten only once written or refused: a World error raises before, and
            # the pass that retries it puts it back then
            del gone[key]
            if ok:
                log.warning(
                    "farm: %s was deleted, by someone else (requests are never deleted): "
                    "put back as last verified",
                    key,
                )

    def _next(self, wakeup: float | None, now: float) -> float | None:
        """When the next pass is due: `wakeup` (the plan's timers and graces), or soon
        if a record's signer was not known yet (its key may have come meanwhile)."""
        due = [t for t in (wakeup, self._due_at) if t is not None]
        if self._unknown:
            due.append(now + _UNKNOWN_RETRY)
        return min(due) if due else None

    def _due(self, at: float) -> None:
        """A pass is due at `at` (a grace ends)."""
        self._due_at = at if self._due_at is None else min(self._due_at, at)

    async def _housekeeping(
        self,
        reqs: dict[int, tuple[Request, int]],
        workers: dict[str, tuple[Worker, int]],
        living: set[str],
        now: float,
    ) -> None:
        """Liveness and the workers' own intermediate states. A worker whose alive key
        (under its agent's lease) has been gone for `settings.alive_grace` becomes
        FAILED (the matcher then fails its job's request): a World too slow to keep
        its lease alive for a moment (a locked sqlite file) fails no live worker. One
        FAILED that way whose key is back returns to its state by itself; PREPARE ->
        IDLE; BUSY -> MAINTENANCE once its job's request is no longer IN PROGRESS."""
        missing = self._missing_since
        for uuid in list(missing):
            if uuid in living or uuid not in workers:
                del missing[uuid]
        for uuid, (w, mod) in list(workers.items()):
            new = None
            if uuid not in living and w.state != model.FAILED:
                since = missing.setdefault(uuid, now)
                if since + self.settings.alive_grace > now:
                    self._due(since + self.settings.alive_grace)
                    continue
                new = model.heartbeat_lost(w, now, 0.0)
                log.warning(
                    "farm: worker %s stopped heart-beating (its alive key gone for %gs): FAILED",
                    uuid,
                    now - since,
                )
            elif uuid in living and w.state == model.FAILED and w.lost_from is not None:
                new = model.heartbeat_back(w)
                log.info("farm: worker %s heart-beats again: back from FAILED", uuid)
            elif w.state == model.PREPARE:
                new = model.complete_prepare(w)
            elif w.state == model.BUSY:
                running = (
                    w.job is not None
                    and w.job in reqs
                    and (reqs[w.job][0].state == model.IN_PROGRESS)
                )
                if not running:
                    new = model.complete_maintenance(w)
            if new is not None and await self._write(
                [(worker_key(uuid), mod)], [(worker_key(uuid), new, mod)]
            ):
                log.info("farm: worker %s is %s", uuid, new.state)

    async def _reaffirm(
        self,
        reqs: dict[int, tuple[Request, int]],
        workers: dict[str, tuple[Worker, int]],
        envs: dict[str, Envelope],
        kv_of: dict[str, KeyValue],
    ) -> None:
        """Sign again, with our term, the records of every job still running whose
        assignment is not of our term (a leader before us signed it, or the worker
        re-registered): a worker acts only on an assignment of the current term."""
        term = self.election.term
        first = self._inherited is None
        inherited = self._inherited if self._inherited is not None else {}
        self._inherited = inherited
        for uuid, (w, wmod) in list(workers.items()):
            if w.state != model.RUNNING or w.job is None or w.job not in reqs:
                continue
            r, rmod = reqs[w.job]
            if r.state != model.IN_PROGRESS or r.job is None or r.job.worker != uuid:
                continue
            wenv, renv = envs[worker_key(uuid)], envs[req_key(r.id)]
            if all(e.term == term and e.signer == self.trust.me for e in (wenv, renv)):
                inherited.pop(uuid, None)
                continue
            if first:
                inherited[uuid] = (r.id, rmod)
            # an earlier term's assignment is signed again only if it was there when
            # we took office: one that shows up later was put back (a replay)
            if inherited.get(uuid) != (r.id, rmod) and not (
                wenv.term in (0, term) and renv.term in (0, term)
            ):
                inherited.pop(uuid, None)
                self.trust.refuse(
                    kv_of[worker_key(uuid)],
                    f"runs request {r.id} by an assignment of term {wenv.term} (its request: "
                    f"term {renv.term}) that was not there when this leader took office in "
                    f"term {term}: put back, not signed again",
                )
                continue
            if await self._write(
                [(req_key(r.id), rmod), (worker_key(uuid), wmod)],
                [(req_key(r.id), r, rmod), (worker_key(uuid), w, wmod)],
            ):
                inherited.pop(uuid, None)
                log.info("farm: request %d on worker %s signed again for term %d", r.id, uuid, term)

    async def _write(self, reads: list[tuple[str, int]], writes: list[Write]) -> bool:
        """Write `writes` (signed with our term) if we still lead (the term) and
        nothing read has changed."""
        term = self.election.term
        if not term:
            return False
        # a WAITING request (one put back) carries no term: only a matcher's own
        # moves do, and a WAITING request signed with a term is refused everywhere
        ops: list[Put | Delete] = [
            Put(key, self.trust.seal(key, encode(obj), term=_term_of(obj, term), prev=prev))
            for key, obj, prev in writes
        ]
        compares = [Compare(self.election.key, term), *(Compare(k, m) for k, m in reads)]
        if await self.kv.txn(compares, ops) is None:
            self.refused += 1
            return False
        return True


def _term_of(obj: Request | Worker, term: int) -> int:
    return 0 if isinstance(obj, Request) and obj.state == model.WAITING else term
