"""Following World objects: one key (`watch_one`) or a collection (`follow`).

Both are written on the KV protocol alone, so they behave the same on every
backend, and both survive what a long-lived watch meets in practice:

- a broken stream (`WorldError`): retry with backoff;
- compacted history (`Compacted`): the revision we would resume from is gone,
  so re-read the current state and report the difference;
- a replaced World (`WorldReplaced`, the KV's `epoch` changed, or a read at a
  revision lower than one already reported): as after a compaction, except
  that revisions kept from the old World are forgotten (equal mod revisions
  of two Worlds are not equal records), so records are compared by content
  (`equals`; for `watch_one`, value and existence).

`follow(kv, prefix, follower)` keeps, for every key under the prefix, the
decoded object that passed the follower's filter, and turns the World's
changes into callbacks, per batch (one watch batch = one revision):

1. `new(obj)` / `updated(prev, new)` in key order,
2. `deleted(prev)` in key order,
3. `batch_done()` once — only if the batch produced at least one of the above,
   so a batch touching nothing the follower sees (e.g. a key outside the
   filter changing) costs the follower nothing.

Leaving the filter is a deletion, coming back is `new`; `equals(prev, new)`
true means no `updated`. The initial state is one batch like any other,
followed by `synced()` (once, even if the prefix is empty). A record whose
`decode` raises ValueError is bad: a warning names the key (once per
revision) and the key counts as absent, so a bad record never ends a follow.
A callback that raises ends `follow()` with that error.

Callbacks are awaited one at a time in the follow's task: a slow callback
slows the follow (the World keeps the history; if it is compacted meanwhile
the follow resyncs).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar, cast

import msgspec

from evergraph.world.kv import KV, Compacted, Event, KeyValue, WorldError, WorldReplaced, log

T = TypeVar("T")

#: first and longest wait before retrying a World that failed (seconds)
BACKOFF_FIRST = 0.05
BACKOFF_MAX = 5.0


class Tombstone(msgspec.Struct, frozen=True, gc=False):
    """`key` is absent, as of `revision` (the deleting revision, or the revision
    read at if the key was absent when looked at)."""

    key: str
    revision: int


class _Backoff:
    """Exponential backoff with jitter (so many followers of one World that broke
    together do not all come back at the same instant); reset on success."""

    def __init__(self) -> None:
        self.delay = BACKOFF_FIRST

    def next(self) -> float:
        import random  # (a backoff's only: not in every run's start-up)

        d = self.delay * random.uniform(0.75, 1.25)
        self.delay = min(self.delay * 2, BACKOFF_MAX)
        return d

    def reset(self) -> None:
        self.delay = BACKOFF_FIRST


async def _read(kv: KV, prefix: str, backoff: _Backoff, what: str) -> tuple[list[KeyValue], int]:
    """`kv.range(prefix)`, retried with backoff until the World answers."""
    while True:
        try:
            return await kv.range(prefix)
        except WorldError as e:
            delay = backoff.next()
            log.warning("world: %s %s: %s; retrying in %.2fs", what, prefix, e, delay)
            await asyncio.sleep(delay)


async def _aclose(it: AsyncIterator[Any]) -> None:
    # a watch is an async generator in every backend; close it at once rather than
    # leaving it to the garbage collector (which warns, and holds the backend's state)
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()


def _kv_of(ev: Event) -> KeyValue | None:
    if ev.type == "delete":
        return None
    return KeyValue(ev.key, ev.value, ev.create_revision, ev.revision, ev.lease)


# -- one key ------------------------------------------------------------------------


def _changed(
    last: KeyValue | Tombstone | None, cur: KeyValue | Tombstone, by_value: bool = False
) -> bool:
    """Whether `cur` is news after `last`; `by_value`: ignore revisions (after
    the World was replaced they belong to another World)."""
    if last is None:
        return True
    if isinstance(cur, Tombstone):
        return not isinstance(last, Tombstone)
    if isinstance(last, Tombstone):
        return True
    if by_value:
        return cur.value != last.value
    return (cur.mod_revision, cur.value) != (last.mod_revision, last.value)


async def watch_one(kv: KV, key: str) -> AsyncGenerator[KeyValue | Tombstone, None]:
    """The snapshots of `key`: the current one first (a Tombstone if absent), then
    one per change; a deletion yields a Tombstone. After a broken stream or a
    compaction the key is read again and yielded only if it changed meanwhile
    (intermediate values may be skipped: a snapshot stream only promises the
    latest); after the World was replaced, only if its value (or existence)
    differs from the last snapshot yielded. Ends when `kv` is closed."""
    last: KeyValue | Tombstone | None = None
    backoff = _Backoff()
    seen = 0  # the highest revision read or watched
    epoch = kv.epoch
    replaced = False
    while True:
        # range, not get: it also tells the revision to watch from
        items, rev = await _read(kv, key, backoff, "watch")
        if kv.epoch != epoch or rev < seen:
            replaced = True
        epoch, seen = kv.epoch, rev
        found = [i for i in items if i.key == key]  # the range also holds keys key+"…"
        cur: KeyValue | Tombstone = found[0] if found else Tombstone(key, rev)
        if _changed(last, cur, by_value=replaced):
            last = cur
            yield cur
        elif replaced:
            last = cur  # the same value: compare with the new World's revisions from now on
        replaced = False
        if kv.epoch != epoch:
            continue  # replaced meanwhile (another call noticed): read again
        it: AsyncIterator[list[Event]] | None = None
        try:
            it = kv.watch(key, rev + 1)
            while True:
                try:
                    batch = await it.__anext__()
                except StopAsyncIteration:
                    return  # the KV was closed
                backoff.reset()
                seen = max(seen, batch[-1].revision) if batch else seen
                mine = [e for e in batch if e.key == key]
                if not mine:
                    continue
                ev = mine[-1]
                item = _kv_of(ev)
                cur = item if item is not None else Tombstone(key, ev.revision)
                if _changed(last, cur):
                    last = cur
                    yield cur
        except WorldReplaced as e:
            log.warning("world: watch %s: %s", key, e)
            replaced = True
        except Compacted as e:
            log.info("world: watch %s: %s; reading it again", key, e)
        except WorldError as e:
            delay = backoff.next()
            log.warning("world: watch %s broke (%s); reading it again in %.2fs", key, e, delay)
            await asyncio.sleep(delay)
        finally:
            if it is not None:
                with contextlib.suppress(WorldError):
                    await _aclose(it)


# -- collections ----------------------------------------------------------------------


class Follower(Generic[T]):
    """What `follow` reports to. Subclass and override what you need; every
    method has a harmless default. `decode`, `filter` and `equals` must be pure
    (they may run again for the same record after a resync)."""

    def decode(self, kv: KeyValue) -> T:
        """The object in a record (default: the KeyValue itself). Raise ValueError
        for a bad record: it is skipped with a warning."""
        return cast(T, kv)

    def filter(self, obj: T) -> bool:
        """Whether the follower wants this object (default: all)."""
        return True

    def equals(self, a: T, b: T) -> bool:
        """Whether a change is no change for the follower (default: ==; for raw
        KeyValues every write differs, as the revisions do)."""
        return bool(a == b)

    async def new(self, obj: T) -> None:
        """`obj` appeared (or came back into the filter)."""

    async def updated(self, prev: T, new: T) -> None:
        """An object changed and still passes the filter."""

    async def deleted(self, prev: T) -> None:
        """`prev` vanished (deleted, left the filter, or became a bad record)."""

    async def batch_done(self) -> None:
        """The end of a batch that reported something."""

    async def synced(self) -> None:
        """The initial state has been reported (once per follow)."""


async def _call(fn: Callable[..., object] | None, *args: Any) -> None:
    if fn is None:
        return
    result = fn(*args)
    if inspect.isawaitable(result):
        await result


class SimpleFollower(Follower[T]):
    """A Follower from plain functions; each callback may be sync or async.
    `on_new_updated(obj)` gets the new object on both `new` and `updated`."""

    def __init__(
        self,
        filter: Callable[[T], bool] | None = None,
        equals: Callable[[T, T], bool] | None = None,
        on_new_updated: Callable[[T], Awaitable[None] | None] | None = None,
        on_deleted: Callable[[T], Awaitable[None] | None] | None = None,
        on_batch_done: Callable[[], Awaitable[None] | None] | None = None,
        decode: Callable[[KeyValue], T] | None = None,
        on_synced: Callable[[], Awaitable[None] | None] | None = None,
    ) -> None:
        self._filter = filter
        self._equals = equals
        self._on_new_updated = on_new_updated
        self._on_deleted = on_deleted
        self._on_batch_done = on_batch_done
        self._decode = decode
        self._on_synced = on_synced

    def decode(self, kv: KeyValue) -> T:
        return self._decode(kv) if self._decode is not None else super().decode(kv)

    def filter(self, obj: T) -> bool:
        return self._filter(obj) if self._filter is not None else True

    def equals(self, a: T, b: T) -> bool:
        return self._equals(a, b) if self._equals is not None else super().equals(a, b)

    async def new(self, obj: T) -> None:
        await _call(self._on_new_updated, obj)

    async def updated(self, prev: T, new: T) -> None:
        await _call(self._on_new_updated, new)

    async def deleted(self, prev: T) -> None:
        await _call(self._on_deleted, prev)

    async def batch_done(self) -> None:
        await _call(self._on_batch_done)

    async def synced(self) -> None:
        await _call(self._on_synced)


class _State(Generic[T]):
    """What one follow knows: the objects the follower has been told about, and
    the mod revision of every key seen under the prefix (passing or not), so a
    resync re-decodes only what changed and a bad record warns once per revision."""

    def __init__(self, prefix: str, follower: Follower[T]) -> None:
        self.prefix = prefix
        self.follower = follower
        self.known: dict[str, T] = {}
        self.revs: dict[str, int] = {}

    def _accept(self, kv: KeyValue) -> tuple[bool, T | None]:
        """(passes, object): a bad record does not pass."""
        try:
            obj = self.follower.decode(kv)
        except ValueError as e:
            log.warning(
                "world: follow %s: bad record %s (revision %d) skipped: %s",
                self.prefix,
                kv.key,
                kv.mod_revision,
                e,
            )
            return False, None
        return self.follower.filter(obj), obj

    async def apply(self, changes: Iterable[tuple[str, KeyValue | None]]) -> None:
        """Report one batch: each key's new record, or None if it is gone."""
        latest = dict(changes)  # one revision changes a key once; keep the last anyway
        news: list[tuple[str, T]] = []
        updates: list[tuple[str, T, T]] = []
        gone: list[T] = []
        for key in sorted(latest):
            kv = latest[key]
            if kv is None:
                if self.revs.pop(key, None) is None and key not in self.known:
                    continue  # never seen, nothing to report
                passes, obj = False, None
            else:
                if self.revs.get(key) == kv.mod_revision:
                    continue  # already seen (a resync over an unchanged key)
                self.revs[key] = kv.mod_revision
                passes, obj = self._accept(kv)
            had = key in self.known
            if not passes:
                if had:
                    gone.append(self.known.pop(key))
                continue
            new = cast(T, obj)
            if not had:
                news.append((key, new))
            else:
                prev = self.known[key]
                if not self.follower.equals(prev, new):
                    updates.append((key, prev, new))
            # keep the newest even if "equal": later comparisons start from it
            self.known[key] = new
        f = self.follower
        # new and updated together, in key order
        calls: list[tuple[str, T | None, T, bool]] = [(k, None, o, True) for k, o in news]
        calls += [(k, p, o, False) for k, p, o in updates]
        calls.sort(key=lambda c: c[0])
        for _key, before, after, is_new in calls:
            if is_new:
                await f.new(after)
            else:
                await f.updated(cast(T, before), after)
        for before in gone:
            await f.deleted(before)
        if calls or gone:
            await f.batch_done()

    async def resync(self, items: list[KeyValue], replaced: bool = False) -> None:
        """Diff a fresh read against what we know: what vanished is reported too.
        `replaced`: the read is of another World; its mod revisions say nothing
        about ours, so every record is decoded and compared (`equals`) again."""
        present = {i.key for i in items}
        before = set(self.revs) | set(self.known)
        if replaced:
            self.revs.clear()
        changes: list[tuple[str, KeyValue | None]] = [(i.key, i) for i in items]
        changes += [(k, None) for k in sorted(before - present)]
        await self.apply(changes)


async def follow(kv: KV, prefix: str, follower: Follower[T]) -> None:
    """Report the objects under `prefix` to `follower` (see the module doc) until
    cancelled. A broken stream is resumed from the last revision reported (every
    change is then reported as it happened); if that revision is compacted, the
    prefix is read again and the difference reported as one batch, deletions
    included. The same after the World was replaced (WorldReplaced, a new
    `kv.epoch`, or a read older than what was reported), comparing records by
    content. Returns only if `kv` is closed; a callback's error is raised."""
    state = _State(prefix, follower)
    backoff = _Backoff()
    rev = 0
    epoch = kv.epoch
    need_read = True
    replaced = False
    is_synced = False
    while True:
        if need_read:
            items, read_rev = await _read(kv, prefix, backoff, "follow")
            if kv.epoch != epoch or read_rev < rev:
                if not replaced:
                    log.warning(
                        "world: follow %s: the World was replaced (epoch %d -> %d, read at"
                        " revision %d after %d); resyncing",
                        prefix,
                        epoch,
                        kv.epoch,
                        read_rev,
                        rev,
                    )
                replaced = True
            await state.resync(items, replaced)
            rev, epoch, need_read, replaced = read_rev, kv.epoch, False, False
            if not is_synced:
                is_synced = True
                await follower.synced()
        it: AsyncIterator[list[Event]] | None = None
        try:
            while True:
                # only the World's errors are caught here; the callbacks run below,
                # outside the try, so their errors (even a WorldError) end the follow
                try:
                    if it is None:
                        if kv.epoch != epoch:  # noticed by another call meanwhile
                            raise WorldReplaced(
                                f"noticed by another call: epoch {epoch} -> {kv.epoch}"
                            )
                        it = kv.watch(prefix, rev + 1)
                    batch = await it.__anext__()
                except StopAsyncIteration:
                    return  # the KV was closed
                except WorldReplaced as e:
                    log.warning("world: follow %s: %s", prefix, e)
                    need_read = replaced = True
                    break
                except Compacted as e:
                    log.info("world: follow %s: %s; reading it again", prefix, e)
                    need_read = True
                    break
                except WorldError as e:
                    delay = backoff.next()
                    log.warning(
                        "world: follow %s broke (%s); resuming from revision %d in %.2fs",
                        prefix,
                        e,
                        rev + 1,
                        delay,
                    )
                    await asyncio.sleep(delay)
                    break
                backoff.reset()
                if batch:
                    await state.apply((ev.key, _kv_of(ev)) for ev in batch)
                    rev = max(rev, batch[-1].revision)
        finally:
            if it is not None:
                with contextlib.suppress(WorldError):
                    await _aclose(it)
