"""A stream of durable writes (drift repairs under churn) holds the loop as little
as it can: a write is done inline to re-measure the disk at most once per
`_commit.SAMPLE_S` (an inline write stops the loop for its fsyncs), and a small
batch at the committer renames each file right after its own fsync, so the first
repair of a batch is in place after one fsync, not after all of them; each still
durable (its data on disk before its rename, the rename on disk before the
commit returns)."""

from __future__ import annotations

import asyncio
import collections
import os
import threading
from pathlib import Path

import pytest

from evergraph._util import atomic
from evergraph.resources import _commit


def renames_by_thread(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Records each rename: (new name, done in the loop's thread)."""
    done: list[tuple[str, bool]] = []
    real_rename = os.rename

    def rename(src: str, dst: str, **kw: object) -> None:
        real_rename(src, dst, **kw)  # type: ignore[arg-type]
        done.append((os.path.basename(dst), threading.current_thread() is threading.main_thread()))

    monkeypatch.setattr(os, "rename", rename)
    return done


def stream_of_writes(d: Path, n: int) -> None:
    """`n` writes one after another, each counted slow and in a stream."""

    async def main() -> None:
        writes = _commit.DurableWrites()
        writes._inline_s = collections.deque([1.0] * 5, maxlen=5)
        try:
            for i in range(n):
                await writes.write(f"{d}/f{i}", f"{i}\n".encode(), 0o640, None, lambda fd: None)
        finally:
            await writes.aclose()

    asyncio.run(main())
    for i in range(n):
        assert (d / f"f{i}").read_text() == f"{i}\n"


@pytest.mark.parametrize(("sample_s", "inline"), [(0.0, ["f2", "f5", "f8"]), (1e9, ["f2"])])
def test_a_stream_re_measures_inline_at_most_once_per_sample_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sample_s: float, inline: list[str]
) -> None:
    # every write is slow (whatever an inline one measures: its fsync may take less
    # than SLOW_S on a quiet disk) and in a stream; a sample is due every 2 writes...
    monkeypatch.setattr(_commit, "SLOW_S", 0.0)
    monkeypatch.setattr(_commit, "STREAM_S", 1e9)
    monkeypatch.setattr(_commit, "SAMPLE", 2)
    # ...and SAMPLE_S after the last one: with 0 every 3rd write is inline (as the
    # count alone says); with a period longer than the test, only the first sample
    monkeypatch.setattr(_commit, "SAMPLE_S", sample_s)
    d = tmp_path / "d"
    d.mkdir()
    done = renames_by_thread(monkeypatch)
    stream_of_writes(d, 10)
    assert sorted(name for name, _ in done) == sorted(f"f{i}" for i in range(10))
    assert [name for name, in_loop in done if in_loop] == inline


def test_a_small_batch_renames_each_file_right_after_its_own_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "d"
    d.mkdir()
    n = 3
    assert n < atomic.SYNCFS_MIN  # fsyncs, not syncfs
    ops: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        real_fsync(fd)
        ops.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))

    def rename(src: str, dst: str, **kw: object) -> None:
        real_rename(src, dst, **kw)  # type: ignore[arg-type]
        ops.append(("rename", f"{src} -> {dst}"))

    batch = [atomic.prepare(f"{d}/f{i}", f"{i}\n".encode(), mode=0o640) for i in range(n)]
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    assert atomic.commit(batch) == [None] * n
    want: list[tuple[str, str]] = []
    for p in batch:
        want += [("fsync", p.tmp), ("rename", f"{p.tmp} -> {p.name}")]
    assert ops == [*want, ("fsync", "d")]  # the directory once, after every rename
    for i in range(n):
        assert (d / f"f{i}").read_text() == f"{i}\n"
        assert (d / f"f{i}").stat().st_mode & 0o7777 == 0o640
    assert sorted(p.name for p in d.iterdir()) == [f"f{i}" for i in range(n)]
