"""Durable writes off the event loop: the group-commit of the file kind.

Making new content durable (fsync of the file and of its directory) takes ~0.5 ms
on a disk. (A file made where nothing was is not synced, atomic's fsync policy:
written inline, it never waits for the disk. Once FRESH_QUIET_S pass with no new
one, a thread puts those made so far on disk, if SYNCFS_MIN or more, one
syncfs(2) per filesystem, so that a later durable write's syncfs does not wait
for them.) A lone write does
it inline, but when writes are slow (a disk, not tmpfs) and follow each other
closely (a stream of repairs) the loop only writes each temporary file, and one
committer thread makes them durable and renames them, in batches (atomic's
`commit`: syncfs instead of an fsync per file), while the loop checks other
files. A write handed to the committer is awaited to its end even when the
check is cancelled: it is never left half done, nor done after the check has
returned.

`DurableWrites` is a service (`handle.services.get(DurableWrites)`): one per
agent, closed with it (its thread is joined); its thread also ends by itself
after IDLE_S without work, so a run that never closes it leaves nothing behind.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from evergraph._util.atomic import (
    SYNCFS_MIN,
    OpenDirs,
    Pending,
    atomic_write,
    commit,
    sync_filesystems_of,
)
from evergraph._util.atomic import discard as atomic_discard
from evergraph._util.atomic import prepare as atomic_prepare

if TYPE_CHECKING:
    import asyncio
    import threading

#: a write is handed to the committer only when writes are slow (the median of the
#: last few done inline: an fsync on a disk, ~0.5 ms here; tmpfs ~0.09 ms, where the
#: hop costs more than it saves) and they come in a stream: one starts within
#: STREAM_S of the last one's end, or while others are with the committer. A lone
#: write (a drift repair) is done inline: a hop to a thread and back is ~0.1 ms.
SLOW_S = 0.00025
STREAM_S = 0.005
#: in a stream sent to the committer, a write is still done inline to measure again
#: once SAMPLE writes and SAMPLE_S seconds have passed since the last inline one. Not
#: more often: an inline write stops the loop for its fsyncs (1-12 ms on a busy disk),
#: and every event and hand-back queued meanwhile waits. At 1,000 repairs/s, one write
#: in 32 inline held the loop 5 % of the time (in one traced run, a repair's wait from
#: its inotify event to its check: p99 28 ms with it, 1.2 ms without; BENCHMARKS.md,
#: "Issue 28: drift under churn").
SAMPLE = 32
SAMPLE_S = 1.0
#: writes with the committer at most: they hold their directories open (see
#: atomic.Pending; the writes of one turn of the loop share them), and a batch waits
#: for the one before it
MAX_PENDING = 512
#: seconds the committer thread waits for work before it ends (a new write starts
#: it again)
IDLE_S = 30.0
#: files made where nothing was (not synced: atomic's fsync policy) are put on disk by
#: a thread once this long has passed with no new one, if SYNCFS_MIN or more were
#: made since the last time: else the first durable write after a burst of them
#: waits for them all (its syncfs writes out everything the filesystem holds; a
#: running agent's first apply of 10k files made its next repairs at 1,000/s wait
#: ~50-100 ms, BENCHMARKS.md). A few (a deleted file made again) are left to the
#: kernel's writeback (~35 s): a syncfs for them would write out all the
#: filesystem's other data too
FRESH_QUIET_S = 0.1


class DurableWrites:
    """Atomic, durable writes, inline or by the committer (see the module's doc)."""

    def __init__(self) -> None:
        #: writes with the committer now; when (time.monotonic()) the last write
        #: ended; the durations of the last inline writes; writes sent since the
        #: last sample; writes waiting for room below MAX_PENDING
        self._in_flight = 0
        self._last_end = -1.0
        self._inline_s: collections.deque[float] = collections.deque([0.0], maxlen=5)
        self._since_sample = 0
        self._last_sample = -math.inf
        self._room: collections.deque[asyncio.Future[None]] = collections.deque()
        #: writes prepared this turn of the loop, not yet handed to the committer,
        #: and the directories they were prepared in (open once for them all)
        self._outbox: list[_Job] = []
        self._dirs = OpenDirs()
        self._committer: Committer | None = None
        #: the directories of the files made (`fresh`) since the last flush of them,
        #: and how many; when the last was made; the flush's timer while one is due
        self._fresh_dirs: dict[str, None] = {}
        self._fresh_count = 0
        self._fresh_last = 0.0
        self._fresh_timer: asyncio.TimerHandle | None = None

    def _slow(self) -> bool:
        return sorted(self._inline_s)[len(self._inline_s) // 2] >= SLOW_S

    async def write(
        self,
        path: str,
        data: bytes,
        mode: int,
        owner: tuple[int, int] | None,
        before_rename: Callable[[int], None],
        fresh: bool = False,
    ) -> None:
        """An atomic, durable write of `data` to `path` (see atomic_write): inline,
        or prepared here and committed by the committer thread (see SLOW_S); returns
        once it is durable. Cancelled while the committer works on it, it waits for
        the commit's end, then raises the cancellation. `fresh` (nothing was at
        `path` when the caller looked): atomic but not synced (atomic's fsync
        policy), inline: it waits for no disk."""
        if fresh:
            atomic_write(
                path, data, mode=mode, owner=owner, before_rename=before_rename, durable=False
            )
            self._fresh_dirs[path.rpartition("/")[0] or "/"] = None
            self._fresh_count += 1
            self._fresh_last = time.monotonic()
            if self._fresh_timer is None:
                import asyncio  # (loaded by then: we run in its loop)

                loop = asyncio.get_running_loop()
                self._fresh_timer = loop.call_later(FRESH_QUIET_S, self._flush_fresh, loop)
            return
        if (
            not self._slow()
            or (not self._in_flight and time.monotonic() - self._last_end > STREAM_S)
            or (self._since_sample >= SAMPLE and time.monotonic() - self._last_sample >= SAMPLE_S)
        ):
            self._since_sample = 0
            self._last_sample = t0 = time.monotonic()
            try:
                atomic_write(path, data, mode=mode, owner=owner, before_rename=before_rename)
            finally:
                self._last_end = time.monotonic()
                self._inline_s.append(self._last_end - t0)
            return
        import asyncio  # (loaded by then: we run in its loop)

        loop = asyncio.get_running_loop()
        while self._in_flight >= MAX_PENDING:
            room = loop.create_future()
            self._room.append(room)
            try:
                await room
            except asyncio.CancelledError:
                if room.done() and not room.cancelled():
                    self._free_room(1)  # woken, then cancelled: the place is another's
                raise
        self._since_sample += 1
        try:
            pending = atomic_prepare(
                path, data, mode=mode, owner=owner, before_rename=before_rename, dirs=self._dirs
            )
        except BaseException:
            if not self._outbox:
                self._dirs.close()  # (no hand-off is due to close them)
            raise
        job = _Job(pending, loop)
        # handed to the committer at the end of this turn of the loop, with the
        # other writes this turn prepared (see _hand_off)
        self._outbox.append(job)
        if len(self._outbox) == 1:
            loop.call_soon(self._hand_off)
        self._in_flight += 1
        cancel: asyncio.CancelledError | None = None
        try:
            while True:
                try:
                    await job.fut
                    break
                except asyncio.CancelledError as e:
                    # the write cannot be stopped half done: wait for its end, then stop
                    cancel = e
                    if job.done:
                        break
                    job.fut = job.loop.create_future()
        finally:
            self._in_flight -= 1
            self._last_end = time.monotonic()
            # room for one more, now that it is taken back: a write that began
            # waiting after the committer delivered this one, but before this
            # coroutine ran again, saw no room and is woken here (woken at the
            # delivery instead, such writes were never woken: a 10k first apply under
            # load hung with 512 writes waiting and none in flight)
            self._free_room(1)
        if cancel is not None:
            raise cancel
        if job.error is not None:
            raise job.error

    def _hand_off(self) -> None:
        """Give the committer the writes prepared since the last hand-off, at once:
        a first apply prepares hundreds of writes in one turn of the loop (a drain
        batch), and a hand-off each cost a lock, a wake-up of the committer thread
        and a tug of war for the GIL with it, each time it woke to commit a batch of
        one or two (a small batch also costs an fsync per file, see atomic.commit).
        In 10k writes to tmpfs, one hand-off a write made ~61k futex calls and cost
        the process ~0.5 s of CPU more than writing inline."""
        jobs, self._outbox = self._outbox, []
        dirs, self._dirs = self._dirs, OpenDirs()
        if not jobs:
            dirs.close()
            return
        try:
            if self._committer is None:
                self._committer = Committer()
            self._committer.submit(jobs, dirs)
        except BaseException as e:
            # (no committer thread: nothing will commit them) each write fails with
            # the error, its temporary file removed
            for job in jobs:
                with contextlib.suppress(OSError):
                    atomic_discard(job.pending)
            dirs.close()
            for job in jobs:
                job.error = e
                job.done = True
                if not job.fut.done():
                    job.fut.set_result(None)
            if not isinstance(e, Exception):
                raise

    def _free_room(self, freed: int) -> None:
        # Wake as many waiting writes as there is new room for, first come first:
        # waking them all (10k of a first apply waiting for 512 places) made each
        # delivery wake thousands of writes that found no room and waited again.
        while freed > 0 and self._room:
            fut = self._room.popleft()
            if not fut.done():  # (a cancelled one took no room)
                fut.set_result(None)
                freed -= 1

    def _flush_fresh(self, loop: asyncio.AbstractEventLoop) -> None:
        """Once FRESH_QUIET_S passed since the last file made: those made so far put
        on disk by a thread of their own, if there are SYNCFS_MIN or more (a daemon:
        a run that ends meanwhile does not wait for it; the kernel writes back what it
        did not)."""
        self._fresh_timer = None
        wait = self._fresh_last + FRESH_QUIET_S - time.monotonic()
        if wait > 0:
            self._fresh_timer = loop.call_later(wait, self._flush_fresh, loop)
            return
        dirs, self._fresh_dirs = list(self._fresh_dirs), {}
        count, self._fresh_count = self._fresh_count, 0
        if count < SYNCFS_MIN:
            return
        import threading

        with contextlib.suppress(RuntimeError):  # (no thread left: the kernel's writeback)
            threading.Thread(
                target=sync_filesystems_of, args=(dirs,), name="evergraph-flush", daemon=True
            ).start()

    async def aclose(self) -> None:
        """End the committer's thread (after the batch it may be committing)."""
        if self._fresh_timer is not None:
            self._fresh_timer.cancel()
            self._fresh_timer = None
        self._hand_off()
        if self._committer is not None:
            await self._committer.aclose()


class _Job:
    __slots__ = ("done", "error", "fut", "loop", "pending")

    def __init__(self, pending: Pending, loop: asyncio.AbstractEventLoop) -> None:
        self.pending = pending
        self.loop = loop
        self.fut: asyncio.Future[None] = loop.create_future()
        self.done = False
        self.error: BaseException | None = None


class Committer:
    """One daemon thread committing the temporary files the loop prepared: it takes
    every write queued meanwhile as one batch (a group commit: the longer the disk
    takes, the bigger the next batch) and hands the ended ones back with one
    wake-up of their loop (a future per write, and its wake-up, would cost the loop
    more than the write saves it when 10k files are written)."""

    def __init__(self) -> None:
        import threading  # (here: `check`, which writes nothing, does not load it)

        self._cv = threading.Condition(threading.Lock())
        self._jobs: list[_Job] = []
        #: the directories the queued jobs were prepared in, closed once committed
        self._dirs: list[OpenDirs] = []
        self._ended: dict[asyncio.AbstractEventLoop, list[_Job]] = {}
        self._thread: threading.Thread | None = None
        self._new_thread = threading.Thread
        self._closing = False

    def submit(self, jobs: list[_Job], dirs: OpenDirs | None = None) -> None:
        """Queue `jobs` for the thread; `dirs`: theirs, closed once they are committed
        (a batch takes every job queued: writes prepared together are committed
        together)."""
        with self._cv:
            self._jobs += jobs
            if dirs is not None:
                self._dirs.append(dirs)
            self._cv.notify()
            if self._thread is not None:
                return
            self._thread = self._new_thread(target=self._work, name="evergraph-commit", daemon=True)
            thread = self._thread
        try:
            thread.start()
        except BaseException:
            # (e.g. "can't start new thread": a machine out of threads or PIDs) this
            # write fails with the error; a thread never started must not stay
            # recorded as the committer, or every later write would wait forever
            with self._cv:
                if self._thread is thread:
                    self._thread = None
                taken = set(map(id, jobs))
                self._jobs = [j for j in self._jobs if id(j) not in taken]
                if dirs is not None:
                    self._dirs.remove(dirs)
            raise

    def _taken(self, batch: list[_Job]) -> None:
        """Called in the thread with each batch taken, before it is committed (a
        hook for tests that force an interleaving)."""

    def _work(self) -> None:
        while True:
            with self._cv:
                if not self._jobs and not self._closing:
                    self._cv.wait(IDLE_S)
                if not self._jobs:  # idle (or closing): end; a new write starts another
                    self._thread = None
                    return
                batch, self._jobs = self._jobs, []
                dirs, self._dirs = self._dirs, []
            self._taken(batch)
            try:
                errors = commit([job.pending for job in batch])
            except BaseException as e:  # handed to every awaiting check, raised there
                errors = [e] * len(batch)
            for d in dirs:
                with contextlib.suppress(OSError):
                    d.close()
            loops: set[asyncio.AbstractEventLoop] = set()
            with self._cv:
                for job, error in zip(batch, errors, strict=True):
                    job.error = error
                    self._ended.setdefault(job.loop, []).append(job)
                    loops.add(job.loop)
            for loop in loops:
                with contextlib.suppress(RuntimeError):  # (a closed loop: nobody waits)
                    loop.call_soon_threadsafe(self._deliver, loop)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._cv:
            ended = self._ended.pop(loop, [])
        for job in ended:
            job.done = True
            if not job.fut.done():
                job.fut.set_result(None)

    async def aclose(self) -> None:
        import asyncio

        with self._cv:
            self._closing = True
            self._cv.notify()
            thread: threading.Thread | None = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)
