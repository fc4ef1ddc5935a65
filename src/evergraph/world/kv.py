"""The World's key-value protocol: what every backend (memory, sqlite, etcd) provides.

Modelled on etcd v3, the most demanding backend, so that the others are
strict subsets of its behaviour:

- every write bumps one global `revision`; a key remembers the revision that
  created it and the one that last modified it;
- `txn` applies several puts and deletes in one revision, only if every
  compare holds (each names a key's mod revision; 0: the key must not exist);
  `cas` is a txn of one compare and one write — the building blocks of
  elections and fenced writes (cluster/election.py);
- a lease expires `ttl` seconds after its last keep-alive and takes its keys
  with it (deletions that watchers see);
- `watch(prefix, start)` yields batches of events, one batch per revision, from
  `start` on (so a watcher resumes where it stopped); history older than the
  compaction point raises `Compacted`, and the caller re-lists;
- the World itself may be replaced under a client (etcd's data restored or a
  new cluster at the same URL, `world.sqlite` recreated, `MemoryStore.reset()`):
  its revisions start again and say nothing about the old ones. A backend that
  notices raises `WorldReplaced` (a `Compacted`: the caller re-lists) from its
  watches and bumps `epoch`; reads return the new World's data, so a caller
  that keeps revisions across calls compares `epoch` before and after.
  What the backend cannot see (an etcd replaced under the same cluster id
  whose revision is already past ours; a backup restored in place that others
  wrote past) the World's own id record tells (world/worldid.py): whoever
  finds it changed calls `mark_replaced`, which counts a new epoch just the
  same. `listen_replaced(fn)` is told of every new epoch, with the reason.

Keys are `str`, values `bytes`. World features (members, follow, exports,
deploys) are written once on top of this protocol.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Literal

import msgspec

log = logging.getLogger("evergraph.world")


class WorldError(Exception):
    """The World cannot be reached or refused an operation; the message says which."""


class Compacted(WorldError):
    """The revision a watch asked for is older than the history kept."""

    def __init__(self, revision: int, compact_revision: int) -> None:
        super().__init__(
            f"revision {revision} is compacted (history starts after {compact_revision})"
        )
        self.revision = revision
        self.compact_revision = compact_revision


class WorldReplaced(Compacted):
    """The World behind the client is not the one it was: a new etcd cluster at the
    same address or restored data (cluster id changed, revision went backwards), a
    recreated `world.sqlite`, a reset memory World. Revisions seen before mean
    nothing now; like `Compacted`, the caller reads everything again (and, unlike
    after a compaction, must not trust mod revisions it kept: equal revisions of
    two Worlds are not equal records)."""

    def __init__(self, why: str) -> None:
        WorldError.__init__(self, f"the World was replaced ({why}): resyncing")
        self.why = why
        self.revision = 0
        self.compact_revision = 0


class LeaseExpired(WorldError):
    """A keep-alive came too late: the lease and its keys are gone."""


class KeyValue(msgspec.Struct, frozen=True, gc=False):
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


class Event(msgspec.Struct, frozen=True, gc=False):
    type: Literal["put", "delete"]
    key: str
    #: the new value; for a delete, empty
    value: bytes
    #: the revision of this change (a delete has the deleting revision)
    revision: int
    create_revision: int = 0
    lease: int = 0


class Compare(msgspec.Struct, frozen=True, gc=False):
    """A txn's condition: `key`'s mod revision equals `mod_revision` (0: the key
    must not exist)."""

    key: str
    mod_revision: int


class Put(msgspec.Struct, frozen=True, gc=False):
    """A txn's write of `key` (under `lease`, if not 0)."""

    key: str
    value: bytes
    lease: int = 0


class Delete(msgspec.Struct, frozen=True, gc=False):
    """A txn's deletion of `key` (a key that does not exist: nothing happens)."""

    key: str


def check_ops(ops: Sequence[Put | Delete]) -> None:
    """Raise ValueError if two of a txn's ops name the same key (etcd refuses
    such a txn; every backend does, so that none accepts what another refuses)."""
    seen: set[str] = set()
    for op in ops:
        if op.key in seen:
            raise ValueError(f"a txn writes {op.key!r} more than once")
        seen.add(op.key)


class KV(abc.ABC):
    """One connection to the World. Create it inside the running event loop."""

    #: shown in messages and benchmark tables
    name: str = "kv"

    @property
    def epoch(self) -> int:
        """How many times this client found the World replaced (0: never). Reads
        return the current World's data; compare `epoch` before and after to know
        whether revisions kept from earlier calls still mean anything."""
        return 0

    @property
    def world_id(self) -> str:
        """An identity of the World this client talks to now (etcd: the cluster id;
        sqlite and memory: a random id made with the World); "" if unknown."""
        return ""

    def mark_replaced(self, why: str) -> None:
        """Count a new epoch as if the backend had noticed the World replaced
        (`why` says how it was found): watches raise WorldReplaced, followers
        re-read and compare by content, listeners are told."""
        raise NotImplementedError(f"the {self.name} World cannot be marked replaced")

    def listen_replaced(self, fn: Callable[[str], None]) -> Callable[[], None]:
        """Call `fn(why)` whenever this client counts a new epoch; returns the
        function that stops it."""
        fns: list[Callable[[str], None]] = self.__dict__.setdefault("_replaced_fns", [])
        fns.append(fn)
        return lambda: fns.remove(fn) if fn in fns else None

    def _tell_replaced(self, why: str) -> None:
        """For backends: a new epoch was counted."""
        for fn in list(self.__dict__.get("_replaced_fns", ())):
            fn(why)

    # -- reads ------------------------------------------------------------------
    @abc.abstractmethod
    async def get(self, key: str) -> KeyValue | None: ...

    @abc.abstractmethod
    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key starting with `prefix`, in key order, and the revision read at."""

    # -- writes -----------------------------------------------------------------
    @abc.abstractmethod
    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write; returns the new revision."""

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """True if the key existed."""

    @abc.abstractmethod
    async def delete_prefix(self, prefix: str) -> int:
        """How many keys were deleted (in one revision)."""

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Put | Delete]) -> int | None:
        """If every compare holds, apply every op in ONE revision (watchers see one
        batch, the events in the order of `ops`) and return that revision;
        otherwise change nothing and return None.

        Deleting a key that does not exist does nothing; a txn that changes
        nothing returns the current revision without making a new one. A put
        under a lease that is gone raises LeaseExpired (nothing is applied).
        Two ops on one key raise ValueError. Like `cas`, a txn whose connection
        broke in flight raises a WorldError saying the outcome is unknown."""
        # not abstract, so that wrappers and test doubles without txns still
        # instantiate; every backend (memory, sqlite, etcd) implements it
        raise NotImplementedError(f"the {self.name} World has no transactions")

    async def cas(self, key: str, value: bytes | None, *, expect: int, lease: int = 0) -> bool:
        """Compare-and-swap: if the key's mod revision is `expect` (0 = must not exist),
        put `value` (None = delete; an absent key stays absent) and return True;
        otherwise change nothing. A txn of one compare and one op."""
        op: Put | Delete = Delete(key) if value is None else Put(key, value, lease)
        return await self.txn([Compare(key, expect)], [op]) is not None

    # -- leases -----------------------------------------------------------------
    @abc.abstractmethod
    async def grant(self, ttl: float) -> int:
        """A new lease of `ttl` seconds; returns its id (> 0)."""

    @abc.abstractmethod
    async def keepalive(self, lease: int) -> None:
        """Restart the lease's TTL; raises LeaseExpired if it is gone."""

    @abc.abstractmethod
    async def revoke(self, lease: int) -> None:
        """End the lease now, deleting its keys."""

    # -- watch --------------------------------------------------------------------
    @abc.abstractmethod
    def watch(self, prefix: str, start: int) -> AsyncIterator[list[Event]]:
        """Batches of changes to keys under `prefix`, one batch per revision, from
        revision `start` on. Raises Compacted if `start` is no longer in history.
        The iterator ends only when the KV is closed."""

    @abc.abstractmethod
    async def compact(self, revision: int) -> None:
        """Forget history before `revision` (watchers from older revisions get Compacted)."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> KV:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
