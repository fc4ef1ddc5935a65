"""The collector: what other hosts export to this one, checked. It follows
`exported/<me>/` and `exported/*/` with `follow()` (no record is missed between the
first read and the watch), verifies each changed record once, and applies a record
only at the sequence its exporter's newest verified index names (index.py,
pairindex.py): no replay, and a deletion behind the exporter's back keeps the last
verified value.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from evergraph.cluster.exports.index import (
    INDEX,
    Pair,
    entry_name,
    parse_bucket_key,
    record_digest,
)
from evergraph.cluster.exports.record import (
    EVERYONE,
    EXPORTED,
    Exported,
    open_record_seq,
    parse_key,
)
from evergraph.cluster.hostbook import HostKeyBook
from evergraph.cluster.hostkeys import HostKeys
from evergraph.world.follow import Follower, follow
from evergraph.world.kv import KV, KeyValue

if TYPE_CHECKING:  # imported with the first index seen: a run that is sent no export
    from evergraph.cluster.exports.pairindex import PairIndex  # has no PairIndex

log = logging.getLogger("evergraph.exports")


#: the file in the state dir holding the collector's replay marks
MARKS_FILE = "export-marks.json"
#: replay marks: pair -> (head's highest sequence, {bucket: highest sequence})
Marks = dict[Pair, tuple[int, dict[int, int]]]
_marks_decoder = msgspec.json.Decoder(list[tuple[str, str, int, dict[int, int]]])


def encode_marks(marks: Marks) -> bytes:
    rows = [(to, src, h, b) for (to, src), (h, b) in sorted(marks.items())]
    return msgspec.json.encode(rows)


def load_marks(state_dir: Path) -> Marks:
    """The marks an earlier run kept in `state_dir` (none if absent or unreadable:
    logged; the exporters' indexes are then trusted from their first sight, as on a
    host that never ran)."""
    path = state_dir / MARKS_FILE
    try:
        rows = _marks_decoder.decode(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, msgspec.DecodeError) as e:
        log.error("%s: cannot read the export replay marks (%s): starting without", path, e)
        return {}
    return {(to, src): (h, b) for to, src, h, b in rows}


class Collector(Follower[KeyValue]):
    """What other hosts export to this one, checked: follows `exported/<me>/` and
    `exported/*/`. Each changed record is verified (signature by the exporter's
    pinned key, sealed to us) once; a record that cannot be verified yet (its
    exporter's key unknown) is kept aside and verified when the key arrives.

    No replay: a record is applied only when its sequence is the one named by the
    newest verified index of its exporter for that target (see the package's doc);
    an older record or index is refused (logged once per change), a record deleted
    while the index lists it keeps its last verified value, a record the index does
    not list is not applied.

    `current()` is the checked set, by World key; listeners are called after each
    batch that changed it."""

    def __init__(
        self,
        kv: KV,
        keys: HostKeys,
        host: str,
        book: HostKeyBook,
        own: Callable[[str, KeyValue | None], None] | None = None,
    ) -> None:
        self.kv = kv
        self.keys = keys
        self.host = host
        self.book = book
        #: told of every change to a record or index of this host's that the
        #: collector sees (its `*` exports): the publisher puts them right
        self._own = own
        #: what is applied: key -> (export, its sequence)
        self._items: dict[str, tuple[Exported, int]] = {}
        #: records waiting for their exporter's key (by exporter)
        self._pending: dict[str, dict[str, KeyValue]] = {}
        #: the records as the World has them now
        self._raw: dict[str, KeyValue] = {}
        #: each record's verification, kept while its value stays: key -> (value,
        #: export or None if refused, sequence)
        self._checked: dict[str, tuple[bytes, Exported | None, int]] = {}
        #: each pair's index: head and buckets, raw and verified, replay marks
        self._index: dict[Pair, PairIndex] = {}
        #: record keys (in the World or applied) by pair, and pairs by exporter (a
        #: key that arrives re-verifies its exporter's records: O(theirs), not O(all))
        self._keys: dict[Pair, set[str]] = {}
        self._by_src: dict[str, set[Pair]] = {}
        #: records kept after a deletion the index does not explain (logged once)
        self._kept: set[str] = set()
        #: pairs changed in the batch being reported, with their changed records
        self._touched: dict[Pair, set[str]] = {}
        self._listeners: list[Callable[[], None]] = []
        self._synced = 0
        self.ready = asyncio.Event()
        self._dirty = False
        #: records verified (benchmarks: one change must cost one)
        self.verified = 0
        #: records the fast path (`_newer`) verified but left to the other one
        self._fresh: set[str] = set()
        #: called with (pair, index) whenever an index's replay marks may have grown
        #: (the agent keeps them in its state dir)
        self.on_marks: Callable[[Pair, PairIndex], None] | None = None
        #: replay marks carried over from an earlier run, or of pairs gone
        self._marks: Marks = {}
        book.listen(self._key_changed)

    @property
    def verified_indexes(self) -> int:
        """Index heads and buckets verified (benchmarks: one change must cost one)."""
        return sum(p.verified for p in self._index.values()) + self._gone_verified

    @property
    def refused(self) -> int:
        """Records and indexes refused as replayed or stale (tests)."""
        return self._refused + sum(p.refused for p in self._index.values())

    _gone_verified = 0
    _refused = 0

    def restore_marks(self, marks: Marks) -> None:
        """The highest sequences seen by an earlier run (before `run()`): an index
        older than them is refused after a restart too."""
        self._marks = dict(marks)

    def marks(self) -> Marks:
        """The highest sequences seen, by pair (to keep across restarts)."""
        out = dict(self._marks)
        for pair, p in self._index.items():
            if p.high or p.bhigh:
                out[pair] = (p.high, dict(p.bhigh))
        return out

    def current(self) -> list[Exported]:
        """The collected exports, in (kind, name, exporter) order."""
        return sorted((e for e, _ in self._items.values()), key=lambda e: (e.kind, e.name, e.src))

    def listen(self, fn: Callable[[], None]) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow(self.kv, f"{EXPORTED}{self.host}/", self))
            tg.create_task(follow(self.kv, f"{EXPORTED}{EVERYONE}/", self))

    def _pair_index(self, pair: Pair) -> PairIndex:
        p = self._index.get(pair)
        if p is None:
            from evergraph.cluster.exports.pairindex import PairIndex

            p = self._index[pair] = PairIndex(pair)
            mark = self._marks.pop(pair, None)
            if mark is not None:
                p.high, p.bhigh = mark[0], dict(mark[1])
        return p

    def _touch(self, kv: KeyValue | None, key: str) -> None:
        # (split once: a change is a record and an index record, each parsed here)
        parts = key[len(EXPORTED) :].split("/", 3) if key.startswith(EXPORTED) else ()
        where = parse_key(key) if len(parts) == 4 else None
        bucket: int | None = None
        if where is not None:
            pair: Pair = (where[0], where[1])
        elif len(parts) == 3 and parts[2] == INDEX and parts[0] and parts[1]:
            pair = (parts[0], parts[1])
        elif len(parts) == 3 and (bwhere := parse_bucket_key(key)) is not None:
            pair, bucket = (bwhere[0], bwhere[1]), bwhere[2]
        else:
            return
        if pair[1] == self.host:
            if self._own is not None:
                self._own(key, kv)
            return
        touched = self._touched.setdefault(pair, set())
        if where is None:
            self._pair_index(pair).put_raw(bucket, kv)
        else:
            if kv is None:
                self._raw.pop(key, None)
            else:
                self._raw[key] = kv
                self._kept.discard(key)
            self._keys.setdefault(pair, set()).add(key)
            touched.add(key)
        self._by_src.setdefault(pair[1], set()).add(pair)

    def _drop(self, key: str) -> None:
        if self._items.pop(key, None) is not None:
            self._dirty = True

    def _settle(self, pair: Pair, changed: set[str] | None = None) -> None:
        """Bring what is applied of `pair` in line with its records and index.
        `changed`: the records that changed (None: look at all of them); with the
        records whose entry the index changed, the only ones looked at, so that one
        change among N costs O(1) records, not O(N)."""
        src = pair[1]
        keys = self._keys.get(pair, set())
        trusted = self.book.trusted(src)
        if trusted is None:
            waiting = self._pending.setdefault(src, {})
            for key in sorted(keys):
                self._drop(key)
                kv = self._raw.get(key)
                if kv is None:
                    waiting.pop(key, None)
                elif waiting.get(key) != kv:
                    waiting[key] = kv
                    log.warning("export %s waits for the key of its exporter %s", key, src)
            if not waiting:
                del self._pending[src]
            return
        if (held := self._pending.get(src)) is not None:
            for key in keys:
                held.pop(key, None)
            if not held:
                del self._pending[src]
        verify = trusted[1]
        idx = self._pair_index(pair)
        if changed is not None and self._newer(idx, changed, verify):
            if self.on_marks is not None:
                self.on_marks(pair, idx)
            return
        # (whether records remain matters only once the head is gone: not O(N) a change)
        remain = idx.head_raw is None and any(k in self._raw for k in keys)
        whole, names = idx.judge(verify, remain, changed is None)
        todo: set[str]
        if changed is None or whole:
            todo = keys
        else:
            head = f"{EXPORTED}{pair[0]}/{pair[1]}/"
            todo = changed | {head + e for e in names}
        for key in sorted(todo):
            self._settle_record(key, idx, verify)
        self._fresh.clear()
        gone = [k for k in todo if k in keys and k not in self._raw and k not in self._items]
        for key in gone:
            keys.discard(key)
            self._checked.pop(key, None)
            self._kept.discard(key)
        if not keys and idx.empty():
            self._keys.pop(pair, None)
            if idx.high or idx.bhigh:  # its replay marks outlive it
                self._marks[pair] = (idx.high, dict(idx.bhigh))
            self._gone_verified += idx.verified
            self._refused += idx.refused
            del self._index[pair]
            mine = self._by_src.get(src)
            if mine is not None:
                mine.discard(pair)
                if not mine:
                    del self._by_src[src]
        if self.on_marks is not None:
            self.on_marks(pair, idx)

    def _newer(self, idx: PairIndex, changed: set[str], verify: str) -> bool:
        """Apply the changed records at once if each is a newer version, signed by its
        exporter, of one applied now (the usual change: one record and its bucket):
        its own signature and its sequence above the applied one's settle it, and the
        index records that came with it are verified when a decision needs them (a
        deletion, a record not applied, an older one: the other path). One signature
        check per change, as without an index. False: nothing applied, take the
        other path."""
        head = idx.head
        self._fresh.clear()
        if not changed or head is None or idx.deleted:
            return False
        if head.of > 1 and not idx.head_current():
            return False  # the layout may be changing: which bucket names what is open
        done: list[tuple[str, Exported, int]] = []
        for key in changed:
            kv = self._raw.get(key)
            cur = self._items.get(key)
            if kv is None or cur is None:
                return False
            checked = self._checked.get(key)
            if checked is None or checked[0] != kv.value:
                self.verified += 1
                try:
                    exp, seq = open_record_seq(self.keys, self.host, kv, verify)
                    checked = (kv.value, exp, seq)
                except ValueError:
                    checked = (kv.value, None, 0)  # (the other path logs it)
                self._checked[key] = checked
                self._fresh.add(key)  # (for the other path: checked here, judged there)
            if checked[1] is None or checked[2] <= cur[1]:
                return False
            done.append((key, checked[1], checked[2]))
        for key, exp, seq in done:
            if self._items[key][0] != exp:
                self._dirty = True
            self._items[key] = (exp, seq)
            idx.applied(entry_name(key), seq)
        return True

    def _settle_record(self, key: str, idx: PairIndex, verify: str) -> None:
        kv = self._raw.get(key)
        known, entry = idx.lookup(entry_name(key))
        checked: tuple[bytes, Exported | None, int] | None = None
        fresh = key in self._fresh
        if kv is not None:
            checked = self._checked.get(key)
            if checked is None or checked[0] != kv.value:
                fresh = True
                self.verified += 1
                # the bytes a verified index names need no second signature check
                vouched = entry is not None and entry[1] == record_digest(kv.value)
                try:
                    exp, seq = open_record_seq(self.keys, self.host, kv, verify, vouched)
                    checked = (kv.value, exp, seq)
                except ValueError as e:
                    log.error("rejected export: %s", e)
                    checked = (kv.value, None, 0)
                self._checked[key] = checked
        if idx.head is None:
            self._drop(key)
            if fresh and checked is not None and checked[1] is not None:
                log.warning("export %s waits for its exporter's index", key)
            return
        valid = checked is not None and checked[1] is not None
        cur = self._items.get(key)
        if not known:  # its bucket is not verified (yet): keep what is applied
            return
        if entry is None:
            self._drop(key)
            if fresh and valid:
                self._refused += 1
                log.error(
                    "stale export refused: %s is not in its exporter's index "
                    "(withdrawn, or put back by someone else)",
                    key,
                )
            return
        want = entry[0]
        # (an index verified before the record applied on its own signature names an
        # older sequence: never go back to it)
        floor = cur[1] if cur is not None else 0
        if fresh and valid and checked is not None and checked[2] < max(want, floor):
            self._refused += 1
            log.error(
                "replayed export refused: %s has sequence %d, its exporter's index "
                "names %d: keeping the last verified value",
                key,
                checked[2],
                max(want, floor),
            )
        if (
            checked is not None
            and checked[1] is not None
            and checked[2] == want
            and checked[2] >= floor
        ):
            if cur is None or cur[0] != checked[1]:
                self._dirty = True
            self._items[key] = (checked[1], want)
            return
        # the record is older, newer (its index follows) or gone: keep what is applied
        if kv is None and cur is not None and key not in self._kept:
            self._kept.add(key)
            log.error(
                "export %s deleted, but its exporter's index still lists it: keeping "
                "the last verified value until the exporter withdraws it",
                key,
            )

    def _key_changed(self, host: str) -> None:
        # a key that arrived (or a pin that changed): verify that exporter's records
        # and indexes again, with the key now trusted
        pairs = list(self._by_src.get(host, ()))
        was_dirty = self._dirty
        for pair in pairs:
            before = {k: self._items[k] for k in self._keys.get(pair, ()) if k in self._items}
            for key in self._keys.get(pair, ()):
                self._checked.pop(key, None)
                self._items.pop(key, None)
            if (idx := self._index.get(pair)) is not None:
                idx.forget()
            self._marks.pop(pair, None)
            self._settle(pair)
            after = {k: self._items[k] for k in self._keys.get(pair, ()) if k in self._items}
            # the same records verified again with the same key: no change to report
            was_dirty = was_dirty or before != after
        self._dirty = was_dirty
        self._notify()

    def _notify(self) -> None:
        if self._dirty and self.ready.is_set():
            self._dirty = False
            for fn in list(self._listeners):
                fn()

    # follower callbacks: the raw record; checks happen at the batch's end, once per
    # change, with the index of the same batch (written in the same txn) at hand
    async def new(self, obj: KeyValue) -> None:
        self._touch(obj, obj.key)

    async def updated(self, prev: KeyValue, new: KeyValue) -> None:
        self._touch(new, new.key)

    def equals(self, a: KeyValue, b: KeyValue) -> bool:
        return a.value == b.value

    async def deleted(self, prev: KeyValue) -> None:
        self._touch(None, prev.key)

    async def batch_done(self) -> None:
        touched, self._touched = self._touched, {}
        for pair, changed in sorted(touched.items()):
            self._settle(pair, changed)
        self._notify()

    async def synced(self) -> None:
        self._synced += 1
        if self._synced == 2:  # both prefixes read
            self.ready.set()
            self._dirty = False
