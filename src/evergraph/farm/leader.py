"""The farm's matcher loop, run by whichever agent leads the `farm` election.

While it leads, it follows the requests, the workers and their alive keys, and
after every change (or when a timer is due: a valid_after, a deadline, a job
timeout) runs the pure matcher on the snapshot and applies the plan. Every write
is one transaction conditioned on the leader key's revision (the term) and on
the revision of each record it read: a deposed leader, still believing it leads,
cannot write, and a record that changed meanwhile is left for the next pass.
So a worker never holds two jobs, whatever dies when.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

import msgspec

from evergraph._util.clock import SYSTEM, Clock
from evergraph.farm import matcher, model
from evergraph.farm.model import Refused, Request, Worker
from evergraph.farm.service import (
    ALIVE,
    FARM,
    REQS,
    WORKERS,
    FarmSettings,
    decode_request,
    decode_worker,
    encode,
    req_key,
    worker_key,
)
from evergraph.world.election import Election
from evergraph.world.follow import Follower, follow
from evergraph.world.kv import KV, Compare, Delete, KeyValue, Put, WorldError

log = logging.getLogger("evergraph.farm")

T = TypeVar("T")


class _Records(Follower[KeyValue]):
    """Every record under `farm/`, in ONE follow: a transaction is one revision and
    one batch, so the requests, workers and alive keys seen together after a batch
    are a consistent snapshot (followed apart, a request could be seen IN PROGRESS
    before its worker's RUNNING record, and be failed for it)."""

    def __init__(self) -> None:
        self.reqs: dict[str, KeyValue] = {}
        self.workers: dict[str, KeyValue] = {}
        self.alive: dict[str, KeyValue] = {}
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
        settings: FarmSettings | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.kv = kv
        self.election = election
        self.settings = settings or FarmSettings()
        self.clock = clock
        #: passes run and transactions refused (tests, benchmarks)
        self.passes = 0
        self.refused = 0
        #: key -> (mod revision, decoded record): a pass decodes only what changed
        self._cache: dict[str, tuple[int, Any]] = {}
        #: WAITING request -> since when (clock.time) no registered worker could
        #: serve it: INVALID only after `settings.invalid_grace` of that
        self._unfit_since: dict[int, float] = {}

    def _decoded(self, kv: KeyValue, decode: Callable[[bytes, str], T]) -> T | None:
        hit = self._cache.get(kv.key)
        if hit is not None and hit[0] == kv.mod_revision:
            return cast(T, hit[1])
        try:
            obj = decode(kv.value, kv.key)
        except ValueError as e:
            log.warning("farm: %s", e)
            self._cache[kv.key] = (kv.mod_revision, None)
            return None
        self._cache[kv.key] = (kv.mod_revision, obj)
        return obj

    async def run(self) -> None:
        """Lead whenever elected, until cancelled."""
        await self.election.lead(self._lead, "the farm's matcher")

    async def _lead(self) -> None:
        self._unfit_since = {}  # what a past term saw says nothing of the time between
        records = _Records()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow(self.kv, FARM, records))
            await records.ready.wait()
            while True:
                records.changed.clear()
                try:
                    wakeup = await self.step(records.reqs, records.workers, records.alive)
                except WorldError as e:
                    log.warning("farm: matching pass failed (%s); retrying", e)
                    wakeup = self.clock.time() + 0.5
                timeout = None if wakeup is None else max(0.0, wakeup - self.clock.time())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await records.changed.wait()

    async def step(
        self,
        req_items: dict[str, KeyValue],
        worker_items: dict[str, KeyValue],
        alive_items: dict[str, KeyValue],
    ) -> float | None:
        """One matching pass over a snapshot; returns when the next one is due."""
        self.passes += 1
        now = self.clock.time()
        reqs: dict[int, tuple[Request, int]] = {}
        for kv in list(req_items.values()):
            r = self._decoded(kv, decode_request)
            if r is not None:
                reqs[r.id] = (r, kv.mod_revision)
        workers: dict[str, tuple[Worker, int]] = {}
        for kv in list(worker_items.values()):
            w = self._decoded(kv, decode_worker)
            if w is not None:
                workers[w.uuid] = (w, kv.mod_revision)
        if len(self._cache) > 2 * (len(req_items) + len(worker_items)) + 100:
            live = req_items.keys() | worker_items.keys()
            self._cache = {k: v for k, v in self._cache.items() if k in live}
        living = {k[len(ALIVE) :] for k in alive_items}
        await self._housekeeping(reqs, workers, living, now)
        plan = matcher.match([r for r, _ in reqs.values()], [w for w, _ in workers.values()], now)
        plan, wakeup = self._grace(plan, now)
        if plan.empty:
            return wakeup
        for rid in plan.failed:
            r, mod = reqs[rid]
            # conditioned on the worker record the decision was made from, too
            uuid = r.job.worker if r.job is not None else ""
            seen = workers.get(uuid)
            reads = [(req_key(rid), mod), (worker_key(uuid), seen[1] if seen else 0)]
            await self._write(reads, [Put(req_key(rid), encode(model.fail_request(r)))])
        for rid in plan.done:
            r, mod = reqs[rid]
            await self._write(
                [(req_key(rid), mod)], [Put(req_key(rid), encode(model.finish_request(r, now)))]
            )
        for uuid in plan.release:
            w, mod = workers[uuid]
            # conditioned on the job's request record the decision was made from, too
            job = reqs.get(w.job) if w.job is not None else None
            reads = [(worker_key(uuid), mod)]
            if w.job is not None:
                reads.append((req_key(w.job), job[1] if job else 0))
            await self._write(reads, [Put(worker_key(uuid), encode(model.release_worker(w)))])
        for rid in plan.timeout:
            r, mod = reqs[rid]
            await self._write(
                [(req_key(rid), mod)], [Put(req_key(rid), encode(model.expire_request(r, now)))]
            )
        for rid in plan.invalid:
            r, mod = reqs[rid]
            await self._write(
                [(req_key(rid), mod)], [Put(req_key(rid), encode(model.invalidate_request(r)))]
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
                [
                    Put(req_key(a.request), encode(started)),
                    Put(worker_key(a.worker), encode(running)),
                ],
            )
            if ok:
                log.info("farm: request %d -> worker %s", a.request, a.worker)
        return wakeup

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

    async def _housekeeping(
        self,
        reqs: dict[int, tuple[Request, int]],
        workers: dict[str, tuple[Worker, int]],
        living: set[str],
        now: float,
    ) -> None:
        """Liveness and the workers' own intermediate states. A worker whose alive key
        (under its agent's lease) is gone becomes FAILED (the matcher then fails its
        job's request); PREPARE -> IDLE; BUSY -> MAINTENANCE once its job's request is
        no longer IN PROGRESS on it."""
        for uuid, (w, mod) in list(workers.items()):
            new = None
            if uuid not in living and w.state != model.FAILED:
                new = model.heartbeat_lost(w, now, 0.0)
                log.warning("farm: worker %s stopped heart-beating: FAILED", uuid)
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
                [(worker_key(uuid), mod)], [Put(worker_key(uuid), encode(new))]
            ):
                log.info("farm: worker %s is %s", uuid, new.state)

    async def _write(self, reads: list[tuple[str, int]], ops: list[Put | Delete]) -> bool:
        """Apply `ops` if we still lead (the term) and nothing read has changed."""
        term = self.election.term
        if not term:
            return False
        compares = [Compare(self.election.key, term), *(Compare(k, m) for k, m in reads)]
        if await self.kv.txn(compares, ops) is None:
            self.refused += 1
            return False
        return True
