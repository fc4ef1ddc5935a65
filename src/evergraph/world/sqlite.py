"""The sqlite World: the default, embedded, zero set-up backend.

One file (`<state>/world.sqlite`, WAL mode) shared by every process of the
host: agents and the CLI open the same file. Each write is one transaction
that bumps the global revision and appends its events to a `log` table, so a
watcher in any process reads what changed after the revision it has seen.

How a watcher learns that another process wrote: inotify on the `-wal` file
(every commit writes it), with a slow poll (30 s) behind it in case an event
is missed (e.g. a checkpoint that truncated the file between our reads),
armed 0.1 s after the first watch starts (`ARM_AFTER`: a short-lived client
never pays an inotify instance's teardown; 2 s for a client that says it is one,
a run that exits once converged). An idle agent wakes for nothing
else than its lease: no fixed tick. That notifier is world/_sqlite_notify.py.

Leases keep their deadline as wall-clock time in the file. Expired leases
are swept by whoever writes, and by every open client with a watch when the
earliest lease expires: a host whose agent was killed loses its member record within
the TTL as long as any process of the host uses the World.

Calls run in the event loop: a WAL commit without fsync takes tens of
microseconds, less than a hop to a thread. `busy_timeout` covers the short
moments another process holds the write lock.

The World may be replaced under a client: another process deletes
`world.sqlite` and creates a new one at the same path. Every call first
compares the file at the path (device and inode) with the one the connection
has open (an open file keeps its inode, so a new file cannot reuse it); when
they differ, the client opens the new file, counts a new `epoch` and its
watches raise `WorldReplaced`. While the path has no file at all, the client
keeps the old one: it does not make a new World itself (it could race with a
deleter still removing the old `-wal`/`-shm` files, and share them with a new
database); the next process that opens the path does. Each World also holds
a random id (`world_id`, made with the file), checked by reads and watches,
and a client remembers the highest revision it saw: a lower one (a backup
restored in place: same file, same id, an older revision) is a replacement
too, noticed by reads, writes, watches and keep-alives.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

from evergraph._util.tasks import first_of
from evergraph.world._sqlite_notify import (
    ARM_AFTER,
    SHORT_LIVED_ARM_AFTER,
    Notified,
    notify_loop,
)
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

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('revision', 0), ('compacted', 0), ('world_id', random());
INSERT OR IGNORE INTO meta VALUES ('lease_seq', 0);
CREATE TABLE IF NOT EXISTS kv(
    key TEXT PRIMARY KEY, value BLOB NOT NULL,
    create_rev INTEGER NOT NULL, mod_rev INTEGER NOT NULL, lease INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS kv_lease ON kv(lease) WHERE lease != 0;
CREATE TABLE IF NOT EXISTS log(
    rev INTEGER NOT NULL, seq INTEGER NOT NULL, type INTEGER NOT NULL, key TEXT NOT NULL,
    value BLOB NOT NULL, create_rev INTEGER NOT NULL, lease INTEGER NOT NULL,
    PRIMARY KEY(rev, seq)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS leases(id INTEGER PRIMARY KEY, ttl REAL NOT NULL, expires REAL NOT NULL);
"""

#: history kept for watchers that fall behind; older revisions are compacted
HISTORY = 10_000
_SWEEP = 0.05  # at least this long between lease sweeps while watching
_IDLE = 30.0  # at most this long between them (a missed inotify event, no leases)
_POLL = 30.0  # fallback poll for other processes' writes (inotify is the way)
_PUT, _DEL = 0, 1


def _upper(prefix: str) -> str:
    return prefix + "\U0010ffff"


class SQLiteKV(KV):
    name = "sqlite"

    def __init__(self, path: str | Path, short_lived: bool = False) -> None:
        """`short_lived`: this client ends soon (a one-shot run): its notifier arms
        later (`SHORT_LIVED_ARM_AFTER`)."""
        self.path = Path(path)
        self._arm_after = SHORT_LIVED_ARM_AFTER if short_lived else ARM_AFTER
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise WorldError(f"world {self.path}: {e.strerror}") from None
        self._db, self._file, self._world_id = self._open()
        self._epoch = 0
        self._why = ""
        #: the highest revision seen in this World (a lower one: a restored backup)
        self._seen = 0
        self._closed = asyncio.Event()
        self._changed = asyncio.Event()
        self._notifier: asyncio.Task[None] | None = None
        self._writes = 0

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def world_id(self) -> str:
        return f"{self._world_id & 0xFFFF_FFFF_FFFF_FFFF:016x}"

    def _open(self) -> tuple[sqlite3.Connection, tuple[int, int], int]:
        """A connection to the file at the path (created if missing), the file's
        (device, inode), and the World's id."""
        db = None
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            st = os.stat(self.path)  # sqlite opened the file: this is its inode
            db.execute("PRAGMA busy_timeout = 5000")
            db.execute("PRAGMA synchronous = NORMAL")
            self._setup(db)
            world_id = int(db.execute("SELECT v FROM meta WHERE k = 'world_id'").fetchone()[0])
        except sqlite3.Error as e:
            if db is not None:
                db.close()
            raise WorldError(f"world {self.path}: {e}") from None
        except OSError as e:
            if db is not None:
                db.close()
            raise WorldError(f"world {self.path}: {e.strerror}") from None
        return db, (st.st_dev, st.st_ino), world_id

    @staticmethod
    def _setup(db: sqlite3.Connection) -> None:
        """WAL mode and the schema. When several processes create the file at once,
        switching to WAL can answer "database is locked" without waiting on
        busy_timeout: retry for as long as busy_timeout would have waited."""
        deadline = time.monotonic() + 5
        while True:
            try:
                db.execute("PRAGMA journal_mode = WAL")
                db.executescript(_SCHEMA)  # idempotent; its own transaction
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                if db.in_transaction:
                    db.execute("ROLLBACK")
                time.sleep(0.01)  # a start-up race, before any event loop work

    # -- a replaced World -------------------------------------------------------
    def _check_file(self) -> None:
        """Before each call (outside any transaction): if the file at the path is
        not the one we have open, open the one that is there now."""
        try:
            st = os.stat(self.path)
        except OSError:
            return  # deleted, not yet created again (see the module doc), or unknown
        if (st.st_dev, st.st_ino) != self._file:
            self._reopen(f"{self.path} was recreated")

    def _reopen(self, why: str) -> None:
        db, self._file, world_id = self._open()
        old, self._db = self._db, db
        # sqlite sees that the old file moved: closing it neither checkpoints nor
        # deletes the `-wal` at the path (the new World's)
        with contextlib.suppress(sqlite3.Error):
            old.close()
        self._replaced(why, world_id)

    def _replaced(self, why: str, world_id: int) -> None:
        self._world_id = world_id
        self._epoch += 1
        self._why = why
        self._seen = 0
        log.warning("world: %s", WorldReplaced(why))
        self._notify()
        self._tell_replaced(why)

    def mark_replaced(self, why: str) -> None:
        self._replaced(why, self._world_id)

    def _saw(self, rev: int) -> None:
        """A revision read from the World: lower than one seen before, the file
        was restored (or overwritten) with an older copy of this World."""
        if rev < self._seen:
            self._replaced(
                f"{self.path}'s revision went back from {self._seen} to {rev}", self._world_id
            )
        self._seen = max(self._seen, rev)

    def _meta(self, db: sqlite3.Connection) -> tuple[int, int]:
        """(revision, compacted), inside a read transaction; a World id other than
        the one we know (the file was overwritten in place) is a replacement."""
        meta = dict(db.execute("SELECT k, v FROM meta").fetchall())
        world_id = int(meta.get("world_id", self._world_id))
        if world_id != self._world_id:
            self._replaced(f"{self.path} was overwritten", world_id)
        rev = int(meta["revision"])
        self._saw(rev)
        return rev, int(meta["compacted"])

    # -- plumbing ---------------------------------------------------------------
    @contextlib.contextmanager
    def _txn(self) -> Iterator[sqlite3.Connection]:
        if self._db is None:
            raise WorldError("the World connection is closed")
        self._check_file()
        db = self._db
        seen = self._seen
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                # revisions counted inside (a sweep's, a refused put's) never were
                # the World's: remembered, the next read would look like a rollback
                self._seen = seen
                raise
            db.execute("COMMIT")
        except sqlite3.Error as e:
            raise WorldError(f"world {self.path}: {e}") from None

    def _read(self) -> sqlite3.Connection:
        if self._closed.is_set():
            raise WorldError("the World connection is closed")
        self._check_file()
        return self._db

    def _rev(self, db: sqlite3.Connection, name: str = "revision") -> int:
        return int(db.execute("SELECT v FROM meta WHERE k = ?", (name,)).fetchone()[0])

    def _bump(self, db: sqlite3.Connection) -> int:
        cur = self._rev(db)
        self._saw(cur)
        rev = cur + 1
        db.execute("UPDATE meta SET v = ? WHERE k = 'revision'", (rev,))
        self._seen = rev
        return rev

    def _sweep(self, db: sqlite3.Connection) -> None:
        """Inside a write transaction: end expired leases (their keys go in one revision)."""
        now = time.time()
        dead = [r[0] for r in db.execute("SELECT id FROM leases WHERE expires < ?", (now,))]
        if dead:
            self._end_leases(db, dead)

    def _end_leases(self, db: sqlite3.Connection, leases: list[int]) -> None:
        marks = ",".join("?" * len(leases))
        keys = [
            r[0]
            for r in db.execute(
                f"SELECT key FROM kv WHERE lease IN ({marks}) ORDER BY key",
                leases,
            )
        ]
        db.execute(f"DELETE FROM leases WHERE id IN ({marks})", leases)
        if keys:
            self._delete_keys(db, self._bump(db), keys)

    def _delete_keys(
        self, db: sqlite3.Connection, rev: int, keys: list[str], first_seq: int = 0
    ) -> None:
        for seq, key in enumerate(keys, first_seq):
            row = db.execute("SELECT create_rev FROM kv WHERE key = ?", (key,)).fetchone()
            db.execute("DELETE FROM kv WHERE key = ?", (key,))
            db.execute(
                "INSERT INTO log VALUES (?, ?, ?, ?, x'', ?, 0)", (rev, seq, _DEL, key, row[0])
            )

    def _put(
        self, db: sqlite3.Connection, rev: int, key: str, value: bytes, lease: int, seq: int = 0
    ) -> None:
        """Inside a write transaction; a lease that is gone raises LeaseExpired (the
        caller's transaction rolls back)."""
        if lease and db.execute("SELECT 1 FROM leases WHERE id = ?", (lease,)).fetchone() is None:
            raise LeaseExpired(f"lease {lease:x} not found")
        row = db.execute("SELECT create_rev FROM kv WHERE key = ?", (key,)).fetchone()
        create = row[0] if row is not None else rev
        db.execute(
            "INSERT OR REPLACE INTO kv VALUES (?, ?, ?, ?, ?)", (key, value, create, rev, lease)
        )
        db.execute(
            "INSERT INTO log VALUES (?, ?, ?, ?, ?, ?, ?)",
            (rev, seq, _PUT, key, value, create, lease),
        )

    def _wrote(self, db: sqlite3.Connection) -> None:
        self._writes += 1
        if self._writes % 1000 == 0:  # keep the history bounded
            rev = self._rev(db)
            if rev > HISTORY:
                self._compact(db, rev - HISTORY)

    def _compact(self, db: sqlite3.Connection, revision: int) -> None:
        cur = self._rev(db, "compacted")
        revision = min(revision, self._rev(db))
        if revision > cur:
            db.execute("DELETE FROM log WHERE rev <= ?", (revision,))
            db.execute("UPDATE meta SET v = ? WHERE k = 'compacted'", (revision,))

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- reads ------------------------------------------------------------------
    async def get(self, key: str) -> KeyValue | None:
        await self._sweep_now()  # a dead host's leased keys must not be read as alive
        row = (
            self._read()
            .execute("SELECT key, value, create_rev, mod_rev, lease FROM kv WHERE key = ?", (key,))
            .fetchone()
        )
        return KeyValue(row[0], bytes(row[1]), row[2], row[3], row[4]) if row else None

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        await self._sweep_now()
        db = self._read()
        try:
            db.execute("BEGIN")
            rows = db.execute(
                "SELECT key, value, create_rev, mod_rev, lease FROM kv"
                " WHERE key >= ? AND key < ? ORDER BY key",
                (prefix, _upper(prefix)),
            ).fetchall()
            rev, _ = self._meta(db)
        finally:
            db.execute("COMMIT")
        return [KeyValue(r[0], bytes(r[1]), r[2], r[3], r[4]) for r in rows], rev

    # -- writes -----------------------------------------------------------------
    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        with self._txn() as db:
            self._sweep(db)
            rev = self._bump(db)
            self._put(db, rev, key, value, lease)
            self._wrote(db)
        self._notify()
        return rev

    async def delete(self, key: str) -> bool:
        return await self._delete_where("key = ?", (key,)) > 0

    async def delete_prefix(self, prefix: str) -> int:
        return await self._delete_where("key >= ? AND key < ?", (prefix, _upper(prefix)))

    async def _delete_where(self, where: str, args: tuple[str, ...]) -> int:
        with self._txn() as db:
            self._sweep(db)
            keys = [
                r[0] for r in db.execute(f"SELECT key FROM kv WHERE {where} ORDER BY key", args)
            ]
            if keys:
                self._delete_keys(db, self._bump(db), keys)
                self._wrote(db)
        if keys:
            self._notify()
        return len(keys)

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Put | Delete]) -> int | None:
        check_ops(ops)
        with self._txn() as db:
            self._sweep(db)
            for c in compares:
                row = db.execute("SELECT mod_rev FROM kv WHERE key = ?", (c.key,)).fetchone()
                if (row[0] if row else 0) != c.mod_revision:
                    return None
            # keys are distinct: whether a delete deletes is known before any op runs
            todo = [
                op
                for op in ops
                if isinstance(op, Put)
                or db.execute("SELECT 1 FROM kv WHERE key = ?", (op.key,)).fetchone()
            ]
            if not todo:
                return self._rev(db)  # nothing to change: no new revision
            rev = self._bump(db)
            for seq, op in enumerate(todo):
                if isinstance(op, Put):
                    self._put(db, rev, op.key, op.value, op.lease, seq)
                else:
                    self._delete_keys(db, rev, [op.key], seq)
            self._wrote(db)
        self._notify()
        return rev

    # -- leases -----------------------------------------------------------------
    async def grant(self, ttl: float) -> int:
        with self._txn() as db:
            # never an id given before (sqlite reuses the highest rowid once it is
            # deleted): a holder of an expired lease would keep another's alive
            top = db.execute("SELECT MAX(id) FROM leases").fetchone()[0] or 0
            lease = max(self._rev(db, "lease_seq"), top) + 1
            db.execute("UPDATE meta SET v = ? WHERE k = 'lease_seq'", (lease,))
            db.execute(
                "INSERT INTO leases(id, ttl, expires) VALUES (?, ?, ?)",
                (lease, ttl, time.time() + ttl),
            )
        return lease

    async def keepalive(self, lease: int) -> None:
        with self._txn() as db:
            self._saw(self._rev(db))
            self._sweep(db)
            cur = db.execute(
                "UPDATE leases SET expires = ? + ttl WHERE id = ?", (time.time(), lease)
            )
            found = cur.rowcount > 0
        self._notify()
        if not found:
            raise LeaseExpired(f"lease {lease:x} expired")

    async def revoke(self, lease: int) -> None:
        with self._txn() as db:
            self._end_leases(db, [lease])
        self._notify()

    async def compact(self, revision: int) -> None:
        with self._txn() as db:
            self._compact(db, revision)

    # -- watch --------------------------------------------------------------------
    async def watch(self, prefix: str, start: int) -> AsyncIterator[list[Event]]:
        self._start_notifier()
        nxt = start
        hi = _upper(prefix)
        epoch = self._epoch
        while not self._closed.is_set():
            changed = self._changed
            db = self._read()
            try:
                db.execute("BEGIN")
                rev, compacted = self._meta(db)
                if self._epoch != epoch:
                    raise WorldReplaced(self._why)
                if nxt <= compacted and nxt <= rev:
                    raise Compacted(nxt, compacted)
                rows = db.execute(
                    "SELECT rev, type, key, value, create_rev, lease FROM log"
                    " WHERE rev >= ? AND rev <= ? AND key >= ? AND key < ? ORDER BY rev, seq",
                    (nxt, rev, prefix, hi),
                ).fetchall()
            except sqlite3.Error as e:
                raise WorldError(f"world {self.path}: {e}") from None
            finally:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("COMMIT")
            batch: list[Event] = []
            for r in rows:
                if batch and batch[0].revision != r[0]:
                    yield batch
                    batch = []
                batch.append(
                    Event("put" if r[1] == _PUT else "delete", r[2], bytes(r[3]), r[0], r[4], r[5])
                )
            if batch:
                yield batch
            nxt = max(nxt, rev + 1)
            await self._wait(changed)

    async def _wait(self, changed: asyncio.Event) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_POLL):
                await first_of(changed.wait(), self._closed.wait())

    def _start_notifier(self) -> None:
        if self._notifier is None:
            self._notifier = asyncio.create_task(
                notify_loop(self._notified(), self.path), name="world-sqlite-notify"
            )

    def _notified(self) -> Notified:
        return Notified(
            closed=self._closed,
            epoch=lambda: self._epoch,
            until_expiry=self._until_expiry,
            sweep_now=self._sweep_now,
            notify=self._notify,
            arm_after=self._arm_after,
        )

    def _until_expiry(self) -> float:
        """Seconds until the earliest lease expires (a little after), at most _IDLE."""
        try:
            row = self._read().execute("SELECT MIN(expires) FROM leases").fetchone()
        except sqlite3.Error:
            return _SWEEP  # try again soon
        if row is None or row[0] is None:
            return _IDLE
        return min(_IDLE, max(_SWEEP, float(row[0]) - time.time() + 0.01))

    async def _sweep_now(self) -> bool:
        """Delete what expired leases held; True if anything was."""
        db = self._read()
        due = db.execute("SELECT 1 FROM leases WHERE expires < ? LIMIT 1", (time.time(),))
        if due.fetchone() is None:
            return False
        try:
            with self._txn() as db:
                self._sweep(db)
        except WorldError as e:
            log.warning("world: lease sweep failed: %s", e)
            return False
        return True

    async def close(self) -> None:
        self._closed.set()
        self._notify()
        if self._notifier is not None:
            self._notifier.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._notifier
            self._notifier = None
        if self._db is not None:
            self._db.close()
            self._db = None  # type: ignore[assignment]
