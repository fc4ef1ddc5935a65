"""What the agent offers its observers (the HTTP service's metrics and live view).

`ObserverHub` is the engine's one observer: it hands each `VertexStatus` to
whoever subscribed. The engine calls it on its hot path (twice per check_apply:
20k+ calls for a 10k-file graph), so a subscriber only counts and appends;
formatting and I/O happen later, on the subscriber's own time.

`TimedKV` wraps the World the agent opened: each call's latency goes to a
`Histogram` per operation (watches are streams, not timed).

`ClusterFigures` is what an agent run with `--etcd embedded` tells of its
cluster: its seat's counts and its curator's replacements.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import msgspec

from evergraph.engine.status import Observer, VertexStatus
from evergraph.world.kv import KV, Compare, Delete, Event, KeyValue, Put

log = logging.getLogger("evergraph.agent")

#: upper bounds (seconds) of latency buckets: a file's check is ~20 us, a command's
#: or an etcd round trip's milliseconds, a package install's minutes
#: (few: each is a line per labelled histogram on every scrape)
LATENCY_BUCKETS = (
    2.5e-5,
    1e-4,
    2.5e-4,
    1e-3,
    2.5e-3,
    0.01,
    0.025,
    0.1,
    0.25,
    1.0,
    5.0,
    30.0,
    300.0,
)


class ClusterFigures(msgspec.Struct, frozen=True):
    """The self-forming cluster as this agent sees it (`run --etcd embedded`).
    (A frozen Struct, not a dataclass: a tenth of the import time.)"""

    voters: int
    learners: int
    standbys: int
    #: times the etcd leader was seen to change
    leader_changes: int
    #: dead voters this agent removed while curator (each replaced by a standby)
    replacements: int


class Histogram:
    """Counts per bucket, a sum and a count: `observe` is a bisect and two adds."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        #: per bucket (not cumulative); the last one is +Inf
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it) per bucket, ending with (inf, count)."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class ObserverHub:
    """The engine's observer: a fan-out to the subscribers (none: nothing happens).

    A subscriber that raises is logged and dropped: the engine must not fail
    because a view of it did."""

    __slots__ = ("_subs",)

    def __init__(self) -> None:
        self._subs: tuple[Observer, ...] = ()

    def __call__(self, status: VertexStatus) -> None:
        for sub in self._subs:
            try:
                sub(status)
            except Exception:
                log.exception("an observer failed: dropping it")
                self.unsubscribe(sub)

    @property
    def listening(self) -> bool:
        """Someone subscribed: without, the engine's one-shot lane builds no status
        for it (engine/scheduling.py)."""
        return bool(self._subs)

    def subscribe(self, sub: Observer) -> None:
        self._subs = (*self._subs, sub)

    def unsubscribe(self, sub: Observer) -> None:
        self._subs = tuple(s for s in self._subs if s is not sub)


class TimedKV(KV):
    """`kv` with the latency of each call recorded per operation in `timings`."""

    def __init__(self, kv: KV) -> None:
        self.kv = kv
        self.name = kv.name
        self.timings: dict[str, Histogram] = {}

    def _took(self, op: str, t0: float) -> None:
        h = self.timings.get(op)
        if h is None:
            h = self.timings[op] = Histogram()
        h.observe(time.perf_counter() - t0)

    @property
    def epoch(self) -> int:
        return self.kv.epoch

    @property
    def world_id(self) -> str:
        return self.kv.world_id

    def mark_replaced(self, why: str) -> None:
        self.kv.mark_replaced(why)

    def listen_replaced(self, fn: Callable[[str], None]) -> Callable[[], None]:
        return self.kv.listen_replaced(fn)

    async def get(self, key: str) -> KeyValue | None:
        t0 = time.perf_counter()
        try:
            return await self.kv.get(key)
        finally:
            self._took("get", t0)

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        t0 = time.perf_counter()
        try:
            return await self.kv.range(prefix)
        finally:
            self._took("range", t0)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        t0 = time.perf_counter()
        try:
            return await self.kv.put(key, value, lease=lease)
        finally:
            self._took("put", t0)

    async def delete(self, key: str) -> bool:
        t0 = time.perf_counter()
        try:
            return await self.kv.delete(key)
        finally:
            self._took("delete", t0)

    async def delete_prefix(self, prefix: str) -> int:
        t0 = time.perf_counter()
        try:
            return await self.kv.delete_prefix(prefix)
        finally:
            self._took("delete_prefix", t0)

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Put | Delete]) -> int | None:
        t0 = time.perf_counter()
        try:
            return await self.kv.txn(compares, ops)
        finally:
            self._took("txn", t0)

    async def cas(self, key: str, value: bytes | None, *, expect: int, lease: int = 0) -> bool:
        t0 = time.perf_counter()
        try:
            return await self.kv.cas(key, value, expect=expect, lease=lease)
        finally:
            self._took("cas", t0)

    async def grant(self, ttl: float) -> int:
        t0 = time.perf_counter()
        try:
            return await self.kv.grant(ttl)
        finally:
            self._took("grant", t0)

    async def keepalive(self, lease: int) -> None:
        t0 = time.perf_counter()
        try:
            await self.kv.keepalive(lease)
        finally:
            self._took("keepalive", t0)

    async def revoke(self, lease: int) -> None:
        t0 = time.perf_counter()
        try:
            await self.kv.revoke(lease)
        finally:
            self._took("revoke", t0)

    def watch(self, prefix: str, start: int) -> AsyncIterator[list[Event]]:
        return self.kv.watch(prefix, start)

    async def compact(self, revision: int) -> None:
        t0 = time.perf_counter()
        try:
            await self.kv.compact(revision)
        finally:
            self._took("compact", t0)

    async def close(self) -> None:
        await self.kv.close()
