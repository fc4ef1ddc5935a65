"""The committer's bound on writes in flight (`_commit.MAX_PENDING`): writes beyond
it wait for room, and each delivery wakes as many waiting writes as it made room
for, first come first; a waiting write woken and then cancelled passes its place on,
so no write is left waiting with room free."""

from __future__ import annotations

import asyncio
import collections
import threading
from pathlib import Path

import pytest

from evergraph.resources import _commit


class CountingDeque(collections.deque):  # type: ignore[type-arg]
    """The waiting writes' queue, counting every wait."""

    waits = 0

    def append(self, x: object) -> None:
        CountingDeque.waits += 1
        super().append(x)


def streaming(monkeypatch: pytest.MonkeyPatch, max_pending: int) -> _commit.DurableWrites:
    """A DurableWrites that sends every write to the committer (writes look slow,
    and always in a stream), at most `max_pending` at once."""
    monkeypatch.setattr(_commit, "MAX_PENDING", max_pending)
    monkeypatch.setattr(_commit, "STREAM_S", 1e9)
    monkeypatch.setattr(_commit, "SAMPLE", 1 << 30)
    CountingDeque.waits = 0
    writes = _commit.DurableWrites()
    writes._inline_s = collections.deque([1.0] * 5, maxlen=5)
    writes._room = CountingDeque()
    return writes


def test_writes_beyond_the_bound_wait_about_once_each_and_all_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, bound = 300, 4
    writes = streaming(monkeypatch, bound)

    async def main() -> None:
        try:
            async with asyncio.timeout(60):
                await asyncio.gather(
                    *(
                        writes.write(f"{tmp_path}/f{i}", f"{i}\n".encode(), 0o640, None, noop)
                        for i in range(n)
                    )
                )
        finally:
            await writes.aclose()

    asyncio.run(main())
    for i in range(n):
        assert (tmp_path / f"f{i}").read_text() == f"{i}\n"
    # woken only when there is room for them: a write waits once, or again when a
    # newcomer took the place first (waking them all made it ~n * n / bound waits)
    assert CountingDeque.waits < 2 * n
    assert not writes._room


def test_a_waiting_write_cancelled_leaves_no_other_stranded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, bound = 60, 2
    writes = streaming(monkeypatch, bound)
    woken_then_cancelled = 0
    real_free = writes._free_room

    def free_room(freed: int) -> None:
        # cancel each write as it is woken for a place, every third one: its
        # place must go on to the next waiting write
        nonlocal woken_then_cancelled
        before = [f for f in writes._room if not f.done()]
        real_free(freed)
        for j, fut in enumerate(f for f in before if f.done()):
            if j % 3 == 0:
                waiter[fut].cancel()
                woken_then_cancelled += 1

    writes._free_room = free_room  # type: ignore[method-assign]
    waiter: dict[asyncio.Future[None], asyncio.Task[None]] = {}

    async def main() -> list[BaseException | None]:
        class Room(CountingDeque):
            def append(self, fut: asyncio.Future[None]) -> None:
                task = asyncio.current_task()
                assert task is not None
                waiter[fut] = task
                super().append(fut)

        writes._room = Room()
        tasks = [
            asyncio.create_task(
                writes.write(f"{tmp_path}/f{i}", f"{i}\n".encode(), 0o640, None, noop)
            )
            for i in range(n)
        ]
        try:
            async with asyncio.timeout(60):  # a stranded write: a failure, not a hang
                results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await writes.aclose()
        return [r if isinstance(r, BaseException) else None for r in results]

    results = asyncio.run(main())
    cancelled = [i for i, r in enumerate(results) if isinstance(r, asyncio.CancelledError)]
    assert woken_then_cancelled > 0
    assert len(cancelled) == woken_then_cancelled
    for i, r in enumerate(results):
        if r is None:
            assert (tmp_path / f"f{i}").read_text() == f"{i}\n"
        else:
            assert isinstance(r, asyncio.CancelledError)
    assert not writes._room


def noop(fd: int) -> None:
    pass


def test_a_write_that_waits_for_room_after_the_delivery_is_still_woken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # room for one write. The committer delivers A; before A's coroutine runs again
    # (and gives its place back), B begins and finds no room, so it waits. A's place
    # must wake B when it is given back: woken at the delivery (when no one waited
    # yet), B waited forever (a 10k first apply under load hung this way, with 512
    # writes waiting and none in flight).
    writes = streaming(monkeypatch, 1)
    late: list[asyncio.Task[None]] = []

    class Committer(_commit.Committer):
        def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
            if not late:  # B's first step runs before A's coroutine is resumed
                b = writes.write(str(tmp_path / "b"), b"b\n", 0o644, None, noop)
                late.append(loop.create_task(b))
            super()._deliver(loop)

    monkeypatch.setattr(_commit, "Committer", Committer)

    async def main() -> None:
        try:
            await writes.write(str(tmp_path / "a"), b"a\n", 0o644, None, noop)
            assert late
            await asyncio.wait_for(late[0], 30)
        finally:
            await writes.aclose()

    asyncio.run(main())
    assert (tmp_path / "a").read_bytes() == b"a\n"
    assert (tmp_path / "b").read_bytes() == b"b\n"
    assert writes._in_flight == 0
    assert CountingDeque.waits == 1  # B waited (the interleaving happened)
    assert not writes._room


def test_a_committer_thread_that_cannot_start_fails_that_write_and_the_next_one_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a machine out of threads: the first start fails; the write that needed it
    # fails with that error, and the next write starts a committer and lands
    # (before, the thread that never started stayed recorded: every later write
    # queued for it and waited forever)
    writes = streaming(monkeypatch, 4)
    starts: list[str] = []

    class Flaky(threading.Thread):
        def start(self) -> None:
            starts.append(self.name)
            if len(starts) == 1:
                raise RuntimeError("can't start new thread")
            super().start()

    class Committer(_commit.Committer):
        def __init__(self) -> None:
            super().__init__()
            self._new_thread = Flaky

    monkeypatch.setattr(_commit, "Committer", Committer)

    async def main() -> None:
        try:
            with pytest.raises(RuntimeError, match="can't start new thread"):
                await writes.write(str(tmp_path / "a"), b"a\n", 0o644, None, noop)
            await asyncio.wait_for(writes.write(str(tmp_path / "b"), b"b\n", 0o644, None, noop), 30)
        finally:
            await writes.aclose()

    asyncio.run(main())
    assert len(starts) == 2
    assert not (tmp_path / "a").exists()
    assert (tmp_path / "b").read_bytes() == b"b\n"
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # no temporary file left
