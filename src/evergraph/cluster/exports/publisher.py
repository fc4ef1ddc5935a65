"""The publisher: keeps this host's export records in the World equal to the set
the graph (and the farm's job keys) want, level-triggered, under the agent's lease,
each with its sequence, and each target's signed index (index.py) written in the
same transaction as the records it names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, MutableSet
from collections.abc import Set as AbstractSet
from typing import Any

from evergraph.cluster.exports.index import (
    Content,
    Entry,
    entry_name,
    index_contents,
    index_key,
    layout,
    make_content,
    parse_bucket_key,
    parse_index_key,
    record_digest,
)
from evergraph.cluster.exports.record import (
    EVERYONE,
    EXPORTED,
    SeqCounter,
    export_key,
    make_record,
    parse_key,
)
from evergraph.cluster.hostbook import HostKeyBook
from evergraph.cluster.hostkeys import HostKeys, KeyError_
from evergraph.world.kv import KV, Delete, KeyValue, Put, WorldError

log = logging.getLogger("evergraph.exports")

#: a txn's ops at most (etcd's default limit is 128)
TXN_OPS = 100
#: seconds between full checks of this host's records in the World (anti-entropy:
#: a record deleted or altered by someone else is put back)
RECHECK = 30.0

#: (to, kind, name, params) of one export
ExportItem = tuple[str, str, str, dict[str, Any]]


class Publisher:
    """Keeps this host's export records in the World equal to the set it is given.

    Level-triggered: `set()` records what is wanted and wakes `run()`, which
    reconciles until the World acknowledged every put and delete; a World error
    is retried with backoff, so a change made during an outage is published when
    the World returns. Records are put under `lease()` (the agent's member
    lease): an agent that dies has its exports withdrawn within the TTL. After a
    restart every wanted record is put again under the new lease (collectors see
    equal parameters: no flap) and stale ones of the previous run are deleted.
    """

    def __init__(
        self,
        kv: KV,
        keys: HostKeys,
        host: str,
        book: HostKeyBook,
        lease: Callable[[], int],
        seq: SeqCounter | None = None,
    ) -> None:
        self.kv = kv
        self.keys = keys
        self.host = host
        self.book = book
        self.lease = lease
        self.seq = seq if seq is not None else SeqCounter()
        self._want: dict[str, ExportItem] = {}
        self._sources: dict[str, list[ExportItem]] = {}
        #: key -> (params, lease, mod revision, index entry) as written by us
        self._written: dict[str, tuple[dict[str, Any], int, int, Entry]] = {}
        #: index key (head or bucket) -> (content, lease, mod revision) as written by us
        self._ikeys: dict[str, tuple[Content, int, int]] = {}
        self._full = True  # the next pass reads the World (start, errors, regrant)
        #: the next pass reads our own records back by key (the periodic check: a
        #: read of all of exported/ every 30 s by every agent does not scale)
        self._recheck = False
        self._wake = asyncio.Event()
        #: set when the World holds exactly what is wanted (tests, --converged)
        self.acknowledged = asyncio.Event()
        #: targets whose key is missing or refused: waiting for the book
        self._waiting: set[str] = set()
        #: our keys someone else may have changed: read back on the next pass
        self._suspects: set[str] = set()
        book.listen(self._key_changed)

    def noticed(self, key: str, kv: KeyValue | None) -> None:
        """A record or index of ours changed in the World (seen by this host's
        collector): unless it is our own write, read it back on the next pass and put
        it right at once, not at the next periodic check."""
        if kv is not None:
            where = parse_key(key)
            if where is not None:
                mine = self._written.get(key)
                if mine is not None and mine[2] == kv.mod_revision:
                    return
            else:
                idx = self._ikeys.get(key)
                if idx is not None and idx[2] == kv.mod_revision:
                    return
        self._suspects.add(key)
        self._wake.set()

    def set(self, exports: list[ExportItem], source: str = "graph") -> None:
        """What `source` (the graph; the farm's job keys) wants exported now."""
        self._sources[source] = exports
        want: dict[str, ExportItem] = {}
        for items in self._sources.values():
            for item in items:
                to, kind, name, _params = item
                want[export_key(to, self.host, kind, name)] = item
        self._want = want
        self.acknowledged.clear()
        self._wake.set()

    def resync(self) -> None:
        """Read the World again on the next pass (after a lease was re-granted)."""
        self._full = True
        self.acknowledged.clear()
        self._wake.set()

    def _key_changed(self, host: str) -> None:
        if host in self._waiting:
            self._wake.set()

    async def run(self) -> None:
        delay = 0.05
        while True:
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for swallows a
                # cancellation that comes as the event is set (the agent's stop
                # right after its graph's exports were set), and this loop then
                # waited 30 s more, holding the agent's exit
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(RECHECK):
                        await self._wake.wait()
                if not self._wake.is_set():
                    self._recheck = True  # periodic anti-entropy pass: our own keys
                self._wake.clear()
                await self._reconcile()
                delay = 0.05
            except WorldError as e:
                log.warning("world: cannot publish exports (%s); retrying in %.2fs", e, delay)
                self._full = True
                self._wake.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _mine_in_world(self) -> dict[str, KeyValue]:
        """Our records and indexes in the World."""
        items, _ = await self.kv.range(EXPORTED)
        out: dict[str, KeyValue] = {}
        for i in items:
            w = parse_key(i.key)
            if w is not None:
                if w[1] == self.host:
                    out[i.key] = i
            elif self._index_target(i.key) is not None:
                out[i.key] = i
        return out

    async def _mine_by_key(self, keys: list[str]) -> dict[str, KeyValue]:
        out: dict[str, KeyValue] = {}
        for key in keys:
            item = await self.kv.get(key)
            if item is not None:
                out[key] = item
        return out

    async def _check_suspect(
        self,
        key: str,
        want: dict[str, ExportItem],
        lease: int,
        stale: MutableSet[str],
        in_world: dict[str, MutableSet[str]],
    ) -> None:
        """Read one of our keys back: what someone else changed is written again this
        pass (a record or index of ours that is not ours any more: deleted)."""
        item = await self.kv.get(key)
        where = parse_key(key)
        if where is not None:
            mine = self._written.get(key)
            if mine is not None and (
                item is None or item.mod_revision != mine[2] or item.lease != lease
            ):
                del self._written[key]
            elif mine is None and item is not None and key not in want:
                stale.add(key)
            else:
                return
        elif (to := self._index_target(key)) is not None:
            idx = self._ikeys.get(key)
            if idx is not None and (
                item is None or item.mod_revision != idx[2] or item.lease != lease
            ):
                del self._ikeys[key]
            elif idx is None and item is not None:
                in_world.setdefault(to, set()).add(key)
            else:
                return
        else:
            return
        log.error(
            "ALARM: %s, this host's export %s, was %s by someone else: putting it right",
            key,
            "record" if where is not None else "index",
            "deleted" if item is None else "changed",
        )

    def _index_target(self, key: str) -> str | None:
        """The target of an index head or bucket of ours, or None."""
        head = parse_index_key(key)
        if head is not None:
            return head[0] if head[1] == self.host else None
        bucket = parse_bucket_key(key)
        return bucket[0] if bucket is not None and bucket[1] == self.host else None

    def _index_keys(self, keys: Iterable[str]) -> dict[str, MutableSet[str]]:
        """Our index keys among `keys`, by target."""
        out: dict[str, MutableSet[str]] = {}
        for key in keys:
            to = self._index_target(key)
            if to is not None:
                out.setdefault(to, set()).add(key)
        return out

    def _plan_index(
        self,
        to: str,
        mine: dict[str, Entry],
        known: AbstractSet[str],
        lease: int,
        ops: dict[str, list[Put | Delete]],
        contents: dict[str, Content],
    ) -> None:
        """Add to `ops` the index records of `to` that differ from what the World has
        (`known`: our index keys there), signed with new sequences, and the deletions
        of those it must not have. New ones go first (a collector applies each record
        as it arrives at the sequence the index names, whatever the txns a pass
        takes), the head first of all (it names the layout); deleted ones last, the
        head after its buckets (its records are gone by then: a withdrawal, not an
        index deleted under remaining records)."""
        host = self.host
        desired: dict[str, Content] = {}
        if mine:
            head = self._ikeys.get(index_key(to, host))
            desired = index_contents(
                to, host, mine, layout(len(mine), head[0][0] if head else None)
            )
        puts: list[Put | Delete] = []
        for key, content in desired.items():
            had = self._ikeys.get(key)
            if had is not None and had[0] == content and had[1] == lease:
                continue
            value = make_content(self.keys, host, to, self.seq.next(), content)
            puts.append(Put(key, value, lease))
            contents[key] = content
        gone = (
            set(known) | {k for k in self._ikeys if self._index_target(k) == to}
        ) - desired.keys()
        dels: list[Put | Delete] = [
            Delete(k) for k in sorted(gone, key=lambda k: (parse_index_key(k) is not None, k))
        ]
        if puts or dels:
            ops[to] = puts + ops.get(to, []) + dels

    async def _reconcile(self) -> None:
        want = self._want
        lease = self.lease()
        host = self.host
        if self._full or self._recheck:
            if self._full:  # everything of ours, also what an earlier run left
                world = await self._mine_in_world()
                stale = {k for k in world if parse_key(k) is not None} - want.keys()
            else:
                mine = want.keys() | self._written.keys() | self._ikeys.keys()
                world = await self._mine_by_key(sorted(mine))
                stale = set(self._written) - want.keys()
            written = self._written
            self._written = {
                k: v
                for k, v in written.items()
                if k in world and world[k].mod_revision == v[2] and world[k].lease == lease
            }
            self._ikeys = {
                k: v
                for k, v in self._ikeys.items()
                if (i := world.get(k)) is not None and i.mod_revision == v[2] and i.lease == lease
            }
            in_world = self._index_keys(world)
            self._full = self._recheck = False
        else:
            stale = set(self._written) - want.keys()
            in_world = self._index_keys(self._ikeys)
        suspects, self._suspects = self._suspects, set()
        for key in sorted(suspects):
            await self._check_suspect(key, want, lease, stale, in_world)
        ops: dict[str, list[Put | Delete]] = {}
        for key in sorted(stale):
            where = parse_key(key)
            assert where is not None
            ops.setdefault(where[0], []).append(Delete(key))
        #: what this pass writes: key -> (params, seq)
        puts: dict[str, tuple[dict[str, Any], Entry]] = {}
        waiting: set[str] = set()
        #: target -> {entry: seq}: the index each target should have
        entries: dict[str, dict[str, Entry]] = {}
        for key, (to, kind, name, params) in sorted(want.items()):
            done = self._written.get(key)
            if done is not None and done[0] == params and done[1] == lease:
                entries.setdefault(to, {})[entry_name(key)] = done[3]
                continue
            public = None
            if to != EVERYONE:
                pair = self.book.trusted(to)
                if pair is None:
                    if to not in self._waiting:
                        log.warning("export %s[%s] to %s waits for that host's key", kind, name, to)
                    waiting.add(to)
                    if done is not None:  # the record of before stays, and so its entry
                        entries.setdefault(to, {})[entry_name(key)] = done[3]
                    continue
                public = pair[0]
            seq = self.seq.next()
            try:
                value = make_record(self.keys, host, to, kind, name, params, public, seq)
            except KeyError_ as e:
                log.error("export %s[%s] to %s: %s", kind, name, to, e)
                if done is not None:
                    entries.setdefault(to, {})[entry_name(key)] = done[3]
                continue
            ops.setdefault(to, []).append(Put(key, value, lease))
            entry = (seq, record_digest(value))
            puts[key] = (params, entry)
            entries.setdefault(to, {})[entry_name(key)] = entry
        # each target whose records changed, or whose index is missing or stale,
        # gets the index records that changed (or loses them: nothing exported there
        # any more), in the same txn as its records (the first of a pass's txns, if it
        # takes several)
        contents: dict[str, Content] = {}
        for to in sorted(set(ops) | set(entries) | set(in_world)):
            self._plan_index(to, entries.get(to, {}), in_world.get(to, set()), lease, ops, contents)
        for to, tops in sorted(ops.items()):
            for at in range(0, len(tops), TXN_OPS):
                chunk = tops[at : at + TXN_OPS]
                rev = await self.kv.txn([], chunk)
                assert rev is not None  # no compares: it always applies
                for o in chunk:
                    if isinstance(o, Delete):
                        if o.key in contents or self._index_target(o.key) is not None:
                            self._ikeys.pop(o.key, None)
                        else:
                            self._written.pop(o.key, None)
                            log.info("export withdrawn: %s", o.key)
                    elif o.key in contents:
                        self._ikeys[o.key] = (contents[o.key], o.lease, rev)
                    else:
                        params, entry = puts[o.key]
                        self._written[o.key] = (params, o.lease, rev, entry)
                        _to, kind, name, _params = want[o.key]
                        log.info("exported %s[%s] to %s", kind, name, to)  # never the parameters
        self._waiting = waiting
        if not waiting and want is self._want and not self._wake.is_set():
            self.acknowledged.set()
