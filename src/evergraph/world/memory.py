"""The memory World: one process, no persistence. For tests and `--world memory`.

It passes the same contract tests as sqlite and etcd. Several `MemoryKV`
clients may share one `MemoryStore`, standing in for several hosts.
`MemoryStore.reset()` replaces the World under its clients (as a restored etcd
or a recreated `world.sqlite` would): their watches raise `WorldReplaced`.
Its leases run on the store's clock: on a fake one (evergraph.testing.clock), a
test advances the clock past a TTL instead of sleeping through it.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from evergraph._util.clock import SYSTEM, Clock
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

_RESET = "the memory World was reset"


class _Timer(Protocol):
    def cancel(self) -> None: ...


class MemoryStore:
    """One memory World, shared by its clients. `clock` times its leases."""

    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self.revision = 0
        self.compacted = 0
        self.data: dict[str, KeyValue] = {}
        #: (revision, events) in revision order
        self.history: list[tuple[int, list[Event]]] = []
        self.leases: dict[int, tuple[float, set[str], _Timer | None]] = {}
        self._ids = itertools.count(0x1000)
        #: what watches wait on: each a future of its own loop (a store may outlive
        #: the loop of a test, and its clients may run in the next one)
        self._waiters: set[asyncio.Future[None]] = set()
        #: a new one for each World this store holds (see reset)
        self.world_id = secrets.token_hex(8)
        #: how many times the World was replaced (reset)
        self.epoch = 0
        self.why = _RESET
        #: clients' replacement listeners (every client of the store hears a reset)
        self.replaced_fns: list[Callable[[str], None]] = []

    def reset(self) -> None:
        """Replace the World: no keys, no leases, no history, revisions from 0 again,
        a new `world_id`. Clients' watches raise WorldReplaced."""
        for _, _, timer in self.leases.values():
            if timer is not None:
                timer.cancel()
        self.leases.clear()
        self.data.clear()
        self.history.clear()
        self.revision = self.compacted = 0
        self.world_id = secrets.token_hex(8)
        self.new_epoch(_RESET)

    def new_epoch(self, why: str) -> None:
        """Count a new epoch (a reset, or `mark_replaced` by a client)."""
        self.epoch += 1
        self.why = why
        log.warning("world: %s", WorldReplaced(why))
        self.wake()
        for fn in list(self.replaced_fns):
            fn(why)

    def commit(self, events: list[Event]) -> None:
        self.history.append((self.revision, events))
        self.wake()

    def wake(self) -> None:
        """Every watch of every client looks again."""
        waiters, self._waiters = self._waiters, set()
        for f in waiters:
            if not f.done() and not f.get_loop().is_closed():
                f.set_result(None)

    def waiter(self) -> asyncio.Future[None]:
        """A future done at the next `wake` (take it before looking: no race)."""
        f: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(f)
        return f

    def next_rev(self) -> int:
        self.revision += 1
        return self.revision

    def put(self, key: str, value: bytes, lease: int) -> Event:
        """Within a revision the caller opened; the caller checked the lease exists."""
        rev = self.revision
        old = self.data.get(key)
        if old is not None and old.lease and old.lease in self.leases:
            self.leases[old.lease][1].discard(key)
        create = old.create_revision if old is not None else rev
        self.data[key] = KeyValue(key, value, create, rev, lease)
        if lease:
            self.leases[lease][1].add(key)
        return Event("put", key, value, rev, create, lease)

    def delete(self, key: str) -> Event | None:
        old = self.data.pop(key, None)
        if old is None:
            return None
        if old.lease and old.lease in self.leases:
            self.leases[old.lease][1].discard(key)
        return Event("delete", key, b"", self.revision, old.create_revision)

    def arm(self, lease: int, ttl: float) -> None:
        _, keys, timer = self.leases[lease]
        if timer is not None:
            timer.cancel()
        self.leases[lease] = (ttl, keys, self._call_later(ttl, lambda: self.expire(lease)))

    def _call_later(self, seconds: float, fn: Callable[[], None]) -> _Timer:
        # the store's clock fires its own timers: a fake clock's at its time
        timer: _Timer = self.clock.call_later(seconds, fn)
        return timer

    def expire(self, lease: int) -> None:
        entry = self.leases.pop(lease, None)
        if entry is None:
            return
        _, keys, timer = entry
        if timer is not None:
            timer.cancel()
        if keys:
            self.next_rev()
            events = [e for k in sorted(keys) if (e := self.delete(k)) is not None]
            self.commit(events)


class MemoryKV(KV):
    name = "memory"

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.store = store if store is not None else MemoryStore()
        self._closed = asyncio.Event()

    @property
    def epoch(self) -> int:
        return self.store.epoch

    @property
    def world_id(self) -> str:
        return self.store.world_id

    def mark_replaced(self, why: str) -> None:
        self.store.new_epoch(why)

    def listen_replaced(self, fn: Callable[[str], None]) -> Callable[[], None]:
        fns = self.store.replaced_fns
        fns.append(fn)
        return lambda: fns.remove(fn) if fn in fns else None

    def _check(self) -> MemoryStore:
        if self._closed.is_set():
            raise WorldError("the World connection is closed")
        return self.store

    async def get(self, key: str) -> KeyValue | None:
        return self._check().data.get(key)

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        st = self._check()
        return [st.data[k] for k in sorted(st.data) if k.startswith(prefix)], st.revision

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        st = self._check()
        if lease and lease not in st.leases:
            raise LeaseExpired(f"lease {lease:x} not found")
        st.next_rev()
        st.commit([st.put(key, value, lease)])
        return st.revision

    async def delete(self, key: str) -> bool:
        st = self._check()
        if key not in st.data:
            return False
        st.next_rev()
        ev = st.delete(key)
        assert ev is not None
        st.commit([ev])
        return True

    async def delete_prefix(self, prefix: str) -> int:
        st = self._check()
        keys = sorted(k for k in st.data if k.startswith(prefix))
        if keys:
            st.next_rev()
            st.commit([e for k in keys if (e := st.delete(k)) is not None])
        return len(keys)

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Put | Delete]) -> int | None:
        check_ops(ops)
        st = self._check()
        for c in compares:
            cur = st.data.get(c.key)
            if (cur.mod_revision if cur is not None else 0) != c.mod_revision:
                return None
        for op in ops:
            if isinstance(op, Put) and op.lease and op.lease not in st.leases:
                raise LeaseExpired(f"lease {op.lease:x} not found")
        if not any(isinstance(op, Put) or op.key in st.data for op in ops):
            return st.revision  # nothing to change: no new revision
        st.next_rev()
        events: list[Event] = []
        for op in ops:
            if isinstance(op, Put):
                events.append(st.put(op.key, op.value, op.lease))
            elif (ev := st.delete(op.key)) is not None:
                events.append(ev)
        st.commit(events)
        return st.revision

    async def grant(self, ttl: float) -> int:
        st = self._check()
        lease = next(st._ids)
        st.leases[lease] = (ttl, set(), None)
        st.arm(lease, ttl)
        return lease

    async def keepalive(self, lease: int) -> None:
        st = self._check()
        if lease not in st.leases:
            raise LeaseExpired(f"lease {lease:x} expired")
        st.arm(lease, st.leases[lease][0])

    async def revoke(self, lease: int) -> None:
        self._check().expire(lease)

    async def compact(self, revision: int) -> None:
        st = self._check()
        st.compacted = max(st.compacted, min(revision, st.revision))
        cut = bisect.bisect_left(st.history, st.compacted + 1, key=lambda h: h[0])
        del st.history[:cut]

    async def watch(self, prefix: str, start: int) -> AsyncIterator[list[Event]]:
        st = self._check()
        nxt = start
        epoch = st.epoch
        while not self._closed.is_set():
            if st.epoch != epoch:
                raise WorldReplaced(st.why)
            if nxt <= st.compacted and nxt <= st.revision:
                # also when a live watch fell behind a compaction
                raise Compacted(nxt, st.compacted)
            changed = st.waiter()
            i = bisect.bisect_left(st.history, nxt, key=lambda h: h[0])
            for rev, events in st.history[i:]:
                mine = [e for e in events if e.key.startswith(prefix)]
                nxt = rev + 1
                if mine:
                    yield mine
            if nxt <= st.revision:
                st._waiters.discard(changed)
                continue
            try:
                await changed  # a commit, a reset, or a client closed (see close)
            finally:
                st._waiters.discard(changed)

    async def close(self) -> None:
        self._closed.set()
        self.store.wake()  # our watches look again, see us closed and end
