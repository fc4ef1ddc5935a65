"""The file kind's durable writes off the event loop: writes that replace files and
come in a stream are prepared in the loop and committed by one thread in batches
(the loop checks and writes other files meanwhile), each still atomic and durable
(its data on disk before its rename, by an fsync or a syncfs; the rename on disk
before the write returns), our own renames still recognised by the watch, and a
write under way when its check is cancelled is finished before the cancellation
ends the run. A file made where nothing was is written inline and not synced
(atomic's fsync policy)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import evergraph.resources.file  # noqa: F401  (registers the file kind)
from evergraph._util import atomic
from evergraph._util.atomic import TEMP_RE, temp_name
from evergraph.engine import scheduling
from evergraph.engine.build import build
from evergraph.engine.contract import default_registry
from evergraph.engine.engine import Engine
from evergraph.engine.model import GraphModel
from evergraph.engine.settings import Settings
from evergraph.resources import _commit
from evergraph.watch import InotifyHub

#: how long a spy waits for what the test expects to happen (a failure, not a hang)
WAIT_S = 20.0


def model_of(d: Path, n: int) -> GraphModel:
    model = GraphModel(name="g")
    for i in range(n):
        data = {"name": f"f{i}", "path": f"{d}/f{i}", "content": f"{i}\n", "mode": "0640"}
        model.add(build(default_registry, "file", data))
    model.check()
    return model


def outdated(d: Path, n: int) -> None:
    """`d` with files f0..f<n-1> of other content: each write replaces a file, so it
    is synced (a file made where nothing was is not: atomic's fsync policy)."""
    d.mkdir()
    for i in range(n):
        (d / f"f{i}").write_text("old\n")


def settings(tmp_path: Path, converged_timeout: float) -> Settings:
    return Settings(
        state_dir=tmp_path / "state",
        hostname="test",
        converged_timeout=converged_timeout,
        converged_exit=True,
    )


class Spy:
    """Records the fsyncs and renames of the atomic writes (what, name, in a writer
    thread or not); `on_fsync(name)` may hold a writer thread's fsync of a temp file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ops: list[tuple[str, str, bool]] = []
        self.lock = threading.Lock()
        real_fsync, real_rename = os.fsync, os.rename

        def fsync(fd: int) -> None:
            path = os.readlink(f"/proc/self/fd/{fd}")
            name = os.path.basename(path)
            threaded = threading.current_thread() is not threading.main_thread()
            if os.path.isdir(path):
                self._add("fsync dir", name, threaded)
            else:
                self.on_fsync(name, threaded)
                self._add("fsync file", name, threaded)
            real_fsync(fd)

        def rename(src: str, dst: str, **kw: object) -> None:
            real_rename(src, dst, **kw)  # type: ignore[arg-type]
            threaded = threading.current_thread() is not threading.main_thread()
            self._add("rename", f"{src} -> {dst}", threaded)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)

    def _add(self, what: str, name: str, threaded: bool) -> None:
        with self.lock:
            self.ops.append((what, name, threaded))

    def on_fsync(self, name: str, threaded: bool) -> None:
        pass

    def of(self, i: int) -> list[tuple[str, str, bool]]:
        """The ops of file f<i>'s writes (in directory d)."""
        return [op for op in self.ops if f".f{i}." in op[1] or op[:2] == ("fsync dir", "d")]


def every_write_in_a_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write counts as slow and in a stream: each goes to the committer."""
    monkeypatch.setattr(_commit, "SLOW_S", 0.0)
    monkeypatch.setattr(_commit, "STREAM_S", 1e9)
    monkeypatch.setattr(_commit, "SAMPLE", 10**9)


def test_a_stream_of_writes_is_committed_in_batches_each_durable_and_recognised_as_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    every_write_in_a_stream(monkeypatch)  # a batch of 4 or more is synced by syncfs
    monkeypatch.setattr(atomic, "SYNCFS_MIN", 4)
    # one check per turn of the loop: the writes one turn prepares are handed to the
    # committer together (test_writes_of_one_turn_of_the_loop_are_handed_off_at_once),
    # so the interleaving below needs them spread over turns
    monkeypatch.setattr(scheduling, "DRAIN_BATCH", 1)
    d = tmp_path / "d"
    n = 12
    outdated(d, n)  # d exists: its watch is set before the writes
    spy = Spy(monkeypatch)
    # The interleaving is forced, not hoped for: the loop makes its second temp file
    # only once the committer has taken the first write (a batch of one), and the
    # committer holds that batch until the loop has handed it every other write. So
    # the loop goes on while the committer works, and the writes behind the first
    # one wait for it together: one batch, synced by syncfs.
    first_taken, all_made = threading.Event(), threading.Event()
    made_in_loop: list[str] = []
    batches: list[int] = []
    real_open, real_syncfs, real_commit = os.open, atomic.syncfs, _commit.commit
    real_submit = _commit.Committer.submit
    submitted: list[int] = []

    def open_(path: str, flags: int, *a: object, **kw: object) -> int:
        name = os.path.basename(path)
        ours = bool(flags & os.O_CREAT and TEMP_RE.match(name) and re.match(r"\.f\d+\.", name))
        in_loop = threading.current_thread() is threading.main_thread()
        if ours and in_loop and len(made_in_loop) == 1:
            first_taken.wait(WAIT_S)  # (a timeout fails the asserts below, not a hang)
        fd = real_open(path, flags, *a, **kw)  # type: ignore[arg-type]
        if ours:
            spy._add("create", path, not in_loop)
            if in_loop:
                made_in_loop.append(name)
        return fd

    def submit(
        self: _commit.Committer, jobs: list[Any], dirs: atomic.OpenDirs | None = None
    ) -> None:
        # every write handed to the committer: the ones behind the first are queued
        # (all_made set at the last temp file's open let the committer take a batch
        # before the last write was handed over: [1, 10, 1] once in a full run)
        real_submit(self, jobs, dirs)
        submitted.append(len(jobs))
        if sum(submitted) == n:
            all_made.set()

    def taken(self: _commit.Committer, batch: list[object]) -> None:
        batches.append(len(batch))
        if len(batches) == 1:
            first_taken.set()
            all_made.wait(WAIT_S)

    def syncfs(fd: int) -> None:
        spy._add("syncfs", "", threading.current_thread() is not threading.main_thread())
        real_syncfs(fd)

    def commit(batch: list[atomic.Pending]) -> list[BaseException | None]:
        errors = real_commit(batch)
        spy._add("committed", " ".join(p.tmp for p in batch), True)
        return errors

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(atomic, "syncfs", syncfs)
    monkeypatch.setattr(_commit, "commit", commit)
    monkeypatch.setattr(_commit.Committer, "_taken", taken)
    monkeypatch.setattr(_commit.Committer, "submit", submit)

    async def main() -> tuple[int, Engine]:
        async with InotifyHub() as hub:
            pump = asyncio.create_task(hub.run())
            try:
                engine = Engine(settings(tmp_path, 0.3), watcher=hub)
                return await asyncio.wait_for(engine.run(model_of(d, n)), 60), engine
            finally:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    rc, engine = asyncio.run(main())
    assert rc == 0
    assert first_taken.is_set(), "no write reached the committer"
    assert all_made.is_set(), "the loop did not write the other files while the committer worked"
    assert batches[:2] == [1, n - 1], batches  # the first alone, then all the others at once
    assert engine.subscriptions == n  # watched: our renames reach the watch...
    assert engine.events == 0  # ...and none of them was taken for a change to repair
    ops = spy.ops
    # the writes held behind the first one were committed together, by syncfs
    assert ("syncfs", "", True) in ops
    assert len([op for op in ops if op[0] == "fsync file"]) < n
    for i in range(n):
        f = d / f"f{i}"
        assert f.read_text() == f"{i}\n"
        assert f.stat().st_mode & 0o7777 == 0o640
        made = [
            k for k, (what, name, _) in enumerate(ops) if what == "create" and f".f{i}." in name
        ]
        assert len(made) == 1
        assert not ops[made[0]][2]  # its temp file, written in the loop
        tmp = os.path.basename(ops[made[0]][1])
        assert TEMP_RE.match(tmp)
        ren = ops.index(("rename", f"{tmp} -> f{i}", True))  # renamed by the committer
        done = next(k for k, op in enumerate(ops) if op[0] == "committed" and tmp in op[1])
        # its data on disk before the rename, the rename on disk before the commit ends
        assert any(
            op in (("fsync file", tmp, True), ("syncfs", "", True)) for op in ops[made[0] : ren]
        ), ops
        assert any(
            op in (("fsync dir", "d", True), ("syncfs", "", True)) for op in ops[ren:done]
        ), ops
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temp file left


def test_writes_of_one_turn_of_the_loop_are_handed_off_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writes a turn of the loop prepares (a drain batch of a first apply) reach
    the committer in one hand-off, as one batch: not one lock, wake-up of its thread
    and GIL hand-over each, nor a batch of one or two fsynced file by file."""
    every_write_in_a_stream(monkeypatch)
    n = 20
    handoffs: list[int] = []
    batches: list[int] = []
    real_submit = _commit.Committer.submit

    def submit(self: _commit.Committer, jobs: object, *dirs: object) -> None:
        handoffs.append(len(jobs) if isinstance(jobs, list) else 1)
        real_submit(self, jobs, *dirs)  # type: ignore[arg-type]

    def taken(self: _commit.Committer, batch: list[object]) -> None:
        batches.append(len(batch))

    dir_opens: list[str] = []
    real_open = os.open

    def open_(path: str, flags: int, *a: object, **kw: object) -> int:
        if flags & os.O_DIRECTORY:
            dir_opens.append(os.fspath(path))
        return real_open(path, flags, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(_commit.Committer, "submit", submit)
    monkeypatch.setattr(_commit.Committer, "_taken", taken)
    writes = _commit.DurableWrites()
    fds_before = len(os.listdir("/proc/self/fd"))
    writes._inline_s.extend([1.0] * 5)  # writes look slow: each goes to the committer

    async def main() -> None:
        monkeypatch.setattr(os, "open", open_)
        try:
            # gather starts every write in the same turn of the loop
            await asyncio.wait_for(
                asyncio.gather(
                    *(
                        writes.write(f"{tmp_path}/f{i}", f"{i}\n".encode(), 0o640, None, noop)
                        for i in range(n)
                    )
                ),
                60,
            )
        finally:
            await writes.aclose()

    asyncio.run(main())
    monkeypatch.setattr(os, "open", real_open)
    assert handoffs == [n]
    assert batches == [n]
    # their directory opened once for them all, and closed once they were committed
    assert dir_opens == [str(tmp_path)]
    assert len(os.listdir("/proc/self/fd")) == fds_before
    for i in range(n):
        assert (tmp_path / f"f{i}").read_text() == f"{i}\n"
        assert (tmp_path / f"f{i}").stat().st_mode & 0o7777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"f{i}" for i in range(n))


def noop(fd: int) -> None:
    pass


def test_writes_prepared_with_open_dirs_share_each_directory_until_its_owner_closes_it(
    tmp_path: Path,
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    dirs = atomic.OpenDirs()
    batch = [
        atomic.prepare(f"{d}/f{i}", f"{i}\n".encode(), mode=0o640, dirs=dirs)
        for i in range(atomic.SYNCFS_MIN)
        for d in (a, b)
    ]
    dropped = atomic.prepare(f"{a}/gone", b"x", mode=0o640, dirs=dirs)
    assert sorted(dirs.fds) == [str(a), str(b)]
    assert {p.dfd for p in batch} == set(dirs.fds.values())
    assert not any(p.owns_dir for p in batch)
    atomic.discard(dropped)  # its temporary file removed, the shared directory kept
    assert atomic.commit(batch) == [None] * len(batch)
    for fd in dirs.fds.values():
        os.fstat(fd)  # still open: the commit leaves them to their owner
    fds = list(dirs.fds.values())
    dirs.close()
    for fd in fds:
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)
    for d in (a, b):
        assert sorted(p.name for p in d.iterdir()) == sorted(
            f"f{i}" for i in range(atomic.SYNCFS_MIN)
        )
        for i in range(atomic.SYNCFS_MIN):
            assert (d / f"f{i}").read_text() == f"{i}\n"
            assert (d / f"f{i}").stat().st_mode & 0o7777 == 0o640


def test_a_write_under_way_when_cancelled_is_finished_before_the_run_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    every_write_in_a_stream(monkeypatch)
    d = tmp_path / "d"
    d.mkdir()
    (d / "f0").write_text("old\n")
    spy = Spy(monkeypatch)
    entered, release = threading.Event(), threading.Event()

    def on_fsync(name: str, threaded: bool) -> None:
        if threaded and name.startswith(".f0."):
            entered.set()
            release.wait(WAIT_S)

    spy.on_fsync = on_fsync  # type: ignore[method-assign]

    async def main() -> tuple[int, list[tuple[str, str, bool]], str]:
        engine = Engine(settings(tmp_path, 0))
        run = asyncio.create_task(engine.run(model_of(d, 1)))
        assert await asyncio.to_thread(entered.wait, WAIT_S), "the write never reached a thread"
        engine.request_stop()
        engine.request_stop()  # the second stop cancels the applies in flight
        for _ in range(200):  # the loop turns: the cancellation is delivered
            await asyncio.sleep(0)
            if run.done():
                break
        assert not run.done(), "the run ended while its write was still under way"
        assert (d / "f0").read_text() == "old\n"  # not renamed yet: the thread is held
        ops_then = list(spy.ops)
        release.set()
        rc = await asyncio.wait_for(run, WAIT_S)
        return rc, ops_then, (d / "f0").read_text()

    rc, ops_then, text = asyncio.run(main())
    assert rc == 1  # the vertex reports its run cancelled
    assert text == "0\n"  # the write was finished, whole
    assert not any(what == "rename" for what, _, _ in ops_then)
    whats = [what for what, _, _ in spy.of(0)]
    assert whats[-3:] == ["fsync file", "rename", "fsync dir"]  # durable before the end
    assert not [p for p in d.iterdir() if p.name.startswith(".")]


def test_a_lone_write_is_done_inline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no write before it, a write does not pay a hop to a thread (a drift repair)."""
    # (each engine built without an agent has its own services: no write before it)
    monkeypatch.setattr(_commit, "SLOW_S", 0.0)  # even when writes are slow
    d = tmp_path / "d"
    outdated(d, 1)
    spy = Spy(monkeypatch)
    rc = asyncio.run(asyncio.wait_for(Engine(settings(tmp_path, 0)).run(model_of(d, 1)), 30))
    assert rc == 0
    assert (d / "f0").read_text() == "0\n"
    assert [(what, t) for what, _, t in spy.of(0)] == [
        ("fsync file", False),
        ("rename", False),
        ("fsync dir", False),
    ]


def test_temp_names_are_random_without_the_secrets_module(tmp_path: Path) -> None:
    names = {temp_name("f") for _ in range(100)}
    assert len(names) == 100
    assert all(TEMP_RE.match(n) for n in names)
    code = (
        "import sys, evergraph.resources.file, evergraph._util.atomic as a\n"
        "a.atomic_write(sys.argv[1], b'x')\n"
        "print(sorted(m for m in ('secrets', 'hmac', 'hashlib') if m in sys.modules))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "f")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    assert (tmp_path / "f").read_bytes() == b"x"


def test_writes_into_one_directory_share_its_fsync_each_covered_after_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit: while one write's directory fsync runs, the others renamed into
    that directory wait and are covered by one more fsync that began after their
    renames; none returns before such an fsync has ended."""
    n = 6
    d = tmp_path / "d"
    d.mkdir()
    log: list[tuple[str, str]] = []
    lock = threading.Condition()
    renamed = 0
    real_fsync, real_rename = os.fsync, os.rename
    me = threading.local()

    def fsync(fd: int) -> None:
        if not os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            real_fsync(fd)
            return
        with lock:
            log.append(("dir fsync start", me.name))
            first = sum(1 for what, _ in log if what == "dir fsync start") == 1
            if first:  # held until every other write has renamed (and must wait for us)
                assert lock.wait_for(lambda: renamed == n, WAIT_S)
        real_fsync(fd)
        with lock:
            log.append(("dir fsync end", me.name))

    def rename(src: str, dst: str, **kw: object) -> None:
        nonlocal renamed
        real_rename(src, dst, **kw)  # type: ignore[arg-type]
        with lock:
            log.append(("rename", me.name))
            renamed += 1
            lock.notify_all()

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)

    def write(i: int) -> None:
        me.name = f"w{i}"
        atomic.atomic_write(d / f"f{i}", f"{i}\n".encode(), mode=0o644)
        with lock:
            log.append(("returned", me.name))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads)
    assert [f.read_text() for f in sorted(d.iterdir())] == [f"{i}\n" for i in range(n)]
    starts = [k for k, (what, _) in enumerate(log) if what == "dir fsync start"]
    assert len(starts) == 2  # the held one, then one for all the others (not n)
    for i in range(n):
        ren = log.index(("rename", f"w{i}"))
        ret = log.index(("returned", f"w{i}"))
        # some directory fsync began after this rename and ended before this return
        covered = [
            k
            for k in starts
            if ren < k
            and any(
                what == "dir fsync end" and who == log[k][1] and k < j < ret
                for j, (what, who) in enumerate(log)
            )
        ]
        assert covered, f"w{i}: returned without an fsync of the directory after its rename"


def test_a_stream_of_fast_writes_stays_in_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes quicker than SLOW_S (tmpfs) are not worth a thread's hop."""
    monkeypatch.setattr(_commit, "SLOW_S", 1.0)
    monkeypatch.setattr(_commit, "STREAM_S", 1e9)
    d = tmp_path / "d"
    outdated(d, 20)
    spy = Spy(monkeypatch)
    rc = asyncio.run(asyncio.wait_for(Engine(settings(tmp_path, 0)).run(model_of(d, 20)), 30))
    assert rc == 0
    assert all((d / f"f{i}").read_text() == f"{i}\n" for i in range(20))
    mine = [op for i in range(20) for op in spy.of(i)]
    assert len([op for op in mine if op[0] == "rename"]) == 20
    assert not [op for op in mine if op[2]]  # nothing in a writer thread


@pytest.mark.parametrize("fresh", [False, True])  # (synced or not, the same report)
@pytest.mark.parametrize("size", [2, 9])  # fsyncs each / syncfs (SYNCFS_MIN is 8)
def test_commit_reports_each_write_own_error_and_leaves_no_temp_file(
    tmp_path: Path, size: int, fresh: bool
) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "f1").mkdir()  # a directory in the way of one write: its rename fails
    (d / "f1" / "x").write_text("keep\n")
    fds_before = len(os.listdir("/proc/self/fd"))
    batch = [
        atomic.prepare(f"{d}/f{i}", f"{i}\n".encode(), mode=0o640, fresh=fresh) for i in range(size)
    ]
    assert all((d / p.tmp).exists() for p in batch)  # written, not yet placed
    assert not (d / "f0").exists()
    errors = atomic.commit(batch)
    assert isinstance(errors[1], IsADirectoryError)
    assert [e for i, e in enumerate(errors) if i != 1] == [None] * (size - 1)
    assert (d / "f1" / "x").read_text() == "keep\n"
    for i in range(size):
        if i != 1:
            assert (d / f"f{i}").read_text() == f"{i}\n"
            assert (d / f"f{i}").stat().st_mode & 0o7777 == 0o640
    assert not [p for p in d.iterdir() if TEMP_RE.match(p.name)]
    assert len(os.listdir("/proc/self/fd")) == fds_before  # every directory closed


def test_commit_whose_syncfs_fails_places_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose data could not be made durable never gets its name."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "f0").write_text("old\n")

    def syncfs(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(atomic, "syncfs", syncfs)
    fds_before = len(os.listdir("/proc/self/fd"))
    batch = [atomic.prepare(f"{d}/f{i}", b"new\n", mode=0o644) for i in range(atomic.SYNCFS_MIN)]
    errors = atomic.commit(batch)
    assert all(isinstance(e, OSError) and e.errno == 5 for e in errors)
    assert (d / "f0").read_text() == "old\n"
    assert sorted(p.name for p in d.iterdir()) == ["f0"]  # no temp file, nothing placed
    assert len(os.listdir("/proc/self/fd")) == fds_before  # every directory closed


def test_a_file_made_where_nothing_was_is_written_inline_and_not_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """atomic's fsync policy, in the file kind: of a stream of slow writes, those that
    replace a file go to the committer and are synced; those that make a file where
    nothing was are renamed in the loop with no fsync (a power cut can lose only
    them, and the next run makes them again)."""
    every_write_in_a_stream(monkeypatch)
    d = tmp_path / "d"
    outdated(d, 6)  # f0..f5 replaced, f6..f11 new
    spy = Spy(monkeypatch)
    rc = asyncio.run(asyncio.wait_for(Engine(settings(tmp_path, 0)).run(model_of(d, 12)), 30))
    assert rc == 0
    for i in range(12):
        assert (d / f"f{i}").read_text() == f"{i}\n"
        assert (d / f"f{i}").stat().st_mode & 0o7777 == 0o640
        mine = [(what, t) for what, name, t in spy.ops if f".f{i}." in name]
        if i < 6:  # with the committer: data on disk before the rename
            assert mine == [("fsync file", True), ("rename", True)], i
        else:
            assert mine == [("rename", False)], i
    assert not [p for p in d.iterdir() if TEMP_RE.match(p.name)]


@pytest.mark.parametrize("replaced", [3, 9])  # to sync: fsyncs each / syncfs
def test_commit_syncs_only_the_writes_that_replace_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replaced: int
) -> None:
    """In a batch of writes, those prepared `fresh` (nothing at their name) are
    renamed with no sync and count for nothing in choosing fsyncs or syncfs; a batch
    of fresh writes alone syncs nothing."""
    d = tmp_path / "d"
    d.mkdir()
    ops: list[str] = []
    real_fsync, real_syncfs = os.fsync, atomic.syncfs

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        ops.append("fsync dir" if os.path.isdir(path) else f"fsync {os.path.basename(path)}")
        real_fsync(fd)

    def syncfs(fd: int) -> None:
        ops.append("syncfs")
        real_syncfs(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(atomic, "syncfs", syncfs)
    fresh = [atomic.prepare(f"{d}/n{i}", b"new\n", mode=0o644, fresh=True) for i in range(20)]
    assert atomic.commit(fresh) == [None] * 20
    assert ops == []
    for i in range(replaced):
        (d / f"r{i}").write_text("old\n")
    batch = [atomic.prepare(f"{d}/m{i}", b"new\n", mode=0o644, fresh=True) for i in range(20)]
    batch += [atomic.prepare(f"{d}/r{i}", b"new\n", mode=0o644) for i in range(replaced)]
    assert atomic.commit(batch) == [None] * len(batch)
    if replaced < atomic.SYNCFS_MIN:
        assert ops == [f"fsync {p.tmp}" for p in batch[20:]] + ["fsync dir"]
    else:
        assert ops == ["syncfs", "syncfs"]  # (the data, then the renames)
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [f"n{i}" for i in range(20)]
        + [f"m{i}" for i in range(20)]
        + [f"r{i}" for i in range(replaced)]
    )
    assert all((d / n).read_text() == "new\n" for n in os.listdir(d))


def test_files_made_where_nothing_was_are_flushed_by_a_thread_once_they_stop_coming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running agent's new files (not synced when written) are put on disk by one
    syncfs of their filesystem, in a thread, once FRESH_QUIET_S passed with no new
    one: one flush for the burst, after its last rename, never in the loop."""
    monkeypatch.setattr(_commit, "FRESH_QUIET_S", 0.05)
    d = tmp_path / "d"
    d.mkdir()
    ops: list[tuple[str, str]] = []
    flushed = threading.Event()
    real_syncfs, real_rename = atomic.syncfs, os.rename

    def syncfs(fd: int) -> None:
        real_syncfs(fd)
        ops.append(("syncfs", threading.current_thread().name))
        flushed.set()

    def rename(src: str, dst: str, **kw: object) -> None:
        real_rename(src, dst, **kw)  # type: ignore[arg-type]
        ops.append(("rename", dst))

    monkeypatch.setattr(atomic, "syncfs", syncfs)
    monkeypatch.setattr(os, "rename", rename)

    async def main() -> int:
        async with InotifyHub() as hub:
            pump = asyncio.create_task(hub.run())
            try:
                engine = Engine(settings(tmp_path, 30), watcher=hub)
                run = asyncio.create_task(engine.run(model_of(d, 12)))
                # (the run goes on until told to stop: the flush comes while it runs)
                assert await asyncio.to_thread(flushed.wait, WAIT_S), "no flush"
                engine.request_stop()
                return await asyncio.wait_for(run, 30)
            finally:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    assert asyncio.run(main()) == 0
    assert all((d / f"f{i}").read_text() == f"{i}\n" for i in range(12))
    mine = [op for op in ops if op[0] == "syncfs" or op[1].startswith("f")]
    assert mine[-1] == ("syncfs", "evergraph-flush")
    assert sorted(name for what, name in mine[:-1]) == sorted(f"f{i}" for i in range(12))


def test_sync_filesystems_of_syncs_each_filesystem_once_and_passes_over_what_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_syncfs = atomic.syncfs

    def syncfs(fd: int) -> None:
        synced.append(os.fstat(fd).st_dev)
        real_syncfs(fd)

    monkeypatch.setattr(atomic, "syncfs", syncfs)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    atomic.sync_filesystems_of([str(tmp_path / "a"), str(tmp_path / "gone"), str(tmp_path / "b")])
    assert synced == [os.stat(tmp_path).st_dev]


@pytest.mark.parametrize("n", [3, 12])  # below SYNCFS_MIN (8): left to the kernel
def test_a_few_files_made_where_nothing_was_are_left_to_the_kernels_writeback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """The flush after a burst of new files comes only for SYNCFS_MIN or more: for a
    few (a deleted file made again) a syncfs would write out all the filesystem's
    other data too."""
    monkeypatch.setattr(_commit, "FRESH_QUIET_S", 0.01)
    d = tmp_path / "d"
    d.mkdir()
    synced = threading.Event()
    real_syncfs, real_flush = atomic.syncfs, _commit.DurableWrites._flush_fresh

    def syncfs(fd: int) -> None:
        real_syncfs(fd)
        synced.set()

    monkeypatch.setattr(atomic, "syncfs", syncfs)

    async def main() -> None:
        decided = asyncio.Event()

        def flush_fresh(self: _commit.DurableWrites, loop: asyncio.AbstractEventLoop) -> None:
            real_flush(self, loop)
            if self._fresh_timer is None:  # (not put off: decided)
                decided.set()

        monkeypatch.setattr(_commit.DurableWrites, "_flush_fresh", flush_fresh)
        writes = _commit.DurableWrites()
        try:
            for i in range(n):
                await writes.write(f"{d}/f{i}", b"new\n", 0o640, None, lambda fd: None, fresh=True)
            await asyncio.wait_for(decided.wait(), WAIT_S)
        finally:
            await writes.aclose()

    asyncio.run(main())
    for t in threading.enumerate():  # (a flush started has ended before the check)
        if t.name == "evergraph-flush":
            t.join(WAIT_S)
    assert sorted(p.name for p in d.iterdir()) == sorted(f"f{i}" for i in range(n))
    if n < atomic.SYNCFS_MIN:
        assert not synced.is_set()
    else:
        assert synced.wait(WAIT_S)  # (by the flush's own thread)
