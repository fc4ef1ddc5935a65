"""What a collector knows of one exporter's index for one target (`PairIndex`): the
head and buckets as the World has them, those verified and in effect, and the
highest sequence seen for each, so that an older one put back is refused and one
deleted behind its exporter's back keeps its last verified value (see index.py).
"""

from __future__ import annotations

import logging

from evergraph.cluster.exports.index import (
    Bucket,
    Entry,
    Index,
    Pair,
    bucket_key,
    bucket_of,
    index_key,
    open_bucket,
    open_index,
)
from evergraph.world.kv import KeyValue

log = logging.getLogger("evergraph.exports")


class PairIndex:
    """One exporter's index for one target, as a collector follows it.

    `lookup(name)` is what the index in effect says of an entry; `judge()` verifies
    what changed and says which entries that changed. The highest sequences stay
    when the pair is withdrawn (a withdrawn index put back is older than them)."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        #: as the World has them now
        self.head_raw: KeyValue | None = None
        self.bucket_raw: dict[int, KeyValue] = {}
        #: verified and in effect
        self.head: Index | None = None
        self.buckets: dict[int, Bucket] = {}
        #: the highest sequence verified, of the head and of each bucket
        self.high = 0
        self.bhigh: dict[int, int] = {}
        #: the values last judged (one verification per change)
        self._judged: bytes | None = None
        self._bjudged: dict[int, bytes] = {}
        #: deletions not explained by a withdrawal, logged once
        self._head_kept = False
        self._bkept: set[int] = set()
        #: buckets whose raw record changed since the last judge
        self.touched: set[int] = set()
        #: a head or bucket was deleted since the last judge
        self.deleted = False
        #: heads and buckets verified; refused as replayed (the collector's counters)
        self.verified = 0
        self.refused = 0

    def put_raw(self, bucket: int | None, kv: KeyValue | None) -> None:
        """The World's head (`bucket` None) or bucket changed to `kv` (None: gone)."""
        if kv is None:
            self.deleted = True
        if bucket is None:
            self.head_raw = kv
            return
        if kv is None:
            self.bucket_raw.pop(bucket, None)
        else:
            self.bucket_raw[bucket] = kv
        self.touched.add(bucket)

    def empty(self) -> bool:
        """Nothing of this index in the World."""
        return self.head_raw is None and not self.bucket_raw

    def lookup(self, name: str) -> tuple[bool, Entry | None]:
        """(known, entry) of an entry name under the head in effect: known False when
        its bucket is not verified (not arrived yet, or deleted before any was)."""
        head = self.head
        if head is None:
            return True, None
        if head.of == 1:
            return True, head.entries.get(name)
        bk = self.buckets.get(bucket_of(name, head.of))
        if bk is None or bk.of != head.of:
            return False, None
        return True, bk.entries.get(name)

    def head_current(self) -> bool:
        """The head in effect is the one the World has (none waits to be judged)."""
        return (
            self.head is not None
            and self.head_raw is not None
            and (self._judged == self.head_raw.value)
        )

    def applied(self, name: str, seq: int) -> None:
        """A record was applied at `seq` on its own signature (its index records not
        verified yet): the head or bucket naming it was written after it, so one
        older than `seq` put back is refused like any older one."""
        head = self.head
        if head is None:
            return
        # (and the one judged last is not the newest any more: judged again if put back)
        if head.of == 1:
            self.high = max(self.high, seq)
            self._judged = None
        else:
            b = bucket_of(name, head.of)
            self.bhigh[b] = max(self.bhigh.get(b, 0), seq)
            self._bjudged.pop(b, None)

    def forget(self) -> None:
        """Verify everything again (the exporter's trusted key changed)."""
        self.head = None
        self.buckets.clear()
        self.high = 0
        self.bhigh.clear()
        self._judged = None
        self._bjudged.clear()
        self.touched.clear()

    def judge(self, verify: str, records_remain: bool, full: bool) -> tuple[bool, set[str]]:
        """Verify what changed of the head and the touched buckets (`full`: all of
        them). (whole, names): whole when every record must be looked at again (the
        head or the layout came or went), else the entry names whose entry changed."""
        self.deleted = False
        before = self.head
        self._judge_head(verify, records_remain)
        head = self.head
        whole = (head is None) != (before is None) or (
            head is not None and before is not None and head.of != before.of
        )
        names: set[str] = set()
        if not whole and head is not before and head is not None and before is not None:
            old, new = before.entries, head.entries
            names = {e for e, n in new.items() if old.get(e) != n} | (old.keys() - new.keys())
        todo = set(self.bucket_raw) | set(self.buckets) if full or whole else self.touched
        self.touched = set()
        if head is None:  # judged again (all of them) when a head comes back
            self.buckets.clear()
            self._bjudged.clear()
            return whole, names
        for b in sorted(todo):
            was = self.buckets.get(b)
            self._judge_bucket(b, verify, head)
            now = self.buckets.get(b)
            if now is was:
                continue
            if was is None or now is None or was.of != now.of:
                whole = True
                continue
            old, new = was.entries, now.entries
            names |= {e for e, n in new.items() if old.get(e) != n} | (old.keys() - new.keys())
        return whole, names

    def _judge_head(self, verify: str, records_remain: bool) -> None:
        kv = self.head_raw
        if kv is None:
            self._judged = None
            if self.head is None:
                return
            if records_remain:
                if not self._head_kept:
                    self._head_kept = True
                    log.error(
                        "%s deleted while records of its exporter remain: keeping what it "
                        "named until the exporter withdraws it",
                        index_key(*self.pair),
                    )
            else:  # index and records gone: withdrawn (or the exporter's lease ended)
                self.head = None
            return
        self._head_kept = False
        if self._judged == kv.value:
            return
        self._judged = kv.value
        self.verified += 1
        try:
            idx = open_index(kv, verify)
        except ValueError as e:
            log.error("rejected export index: %s", e)
            return
        if idx.seq < self.high or (idx.seq == self.high and self.head != idx):
            self.refused += 1
            log.error(
                "%s: replayed export index refused: sequence %d, %d already seen",
                kv.key,
                idx.seq,
                self.high,
            )
            return
        self.head = idx
        self.high = idx.seq

    def _judge_bucket(self, b: int, verify: str, head: Index) -> None:
        kv = self.bucket_raw.get(b)
        if kv is None:
            self._bjudged.pop(b, None)
            have = self.buckets.get(b)
            if have is None:
                return
            if have.of == head.of and b < head.of:
                if b not in self._bkept:
                    self._bkept.add(b)
                    log.error(
                        "%s deleted while its head stands: keeping what it named until "
                        "the exporter withdraws it",
                        bucket_key(self.pair[0], self.pair[1], b),
                    )
            else:  # a bucket of an earlier layout, deleted by its exporter
                del self.buckets[b]
            return
        self._bkept.discard(b)
        if self._bjudged.get(b) == kv.value:
            return
        self._bjudged[b] = kv.value
        self.verified += 1
        try:
            bk = open_bucket(kv, verify)
        except ValueError as e:
            log.error("rejected export index: %s", e)
            return
        # the same sequence is the same bucket (its exporter signs each sequence once):
        # judged again after its head came back, it is not older
        high = self.bhigh.get(b, 0)
        if bk.seq < high:
            self.refused += 1
            log.error(
                "%s: replayed export index refused: sequence %d, %d already seen",
                kv.key,
                bk.seq,
                high,
            )
            return
        self.buckets[b] = bk
        self.bhigh[b] = bk.seq
