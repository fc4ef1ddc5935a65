"""The inotify hub reads the kernel's events itself: a burst of thousands in one
read all reach their subscribers, each with its mask, and a removed directory's
watch is forgotten (its subscribers re-arm and are told to rescan)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

from evergraph.watch import InotifyHub
from evergraph.watch.inotify import IN_CLOSE_WRITE, IN_MOVED_TO, RESCAN


def test_a_burst_reaches_every_subscriber_with_its_mask(tmp_path: Path) -> None:
    n = 3000  # ~9,000 events: several reads of 64 KiB
    d = tmp_path / "d"
    d.mkdir()

    async def main() -> None:
        got: dict[int, int] = {}
        all_seen = asyncio.Event()

        def cb(i: int) -> object:
            def on(mask: int) -> None:
                got[i] = got.get(i, 0) | mask
                if len(got) == n and all(m & IN_MOVED_TO for m in got.values()):
                    all_seen.set()

            return on

        async with InotifyHub() as hub:
            pump = asyncio.create_task(hub.run())
            try:
                for i in range(n):
                    hub.subscribe(str(d / f"file-with-a-longer-name-{i}.txt"), cb(i))  # type: ignore[arg-type]
                for i in range(n):  # no await: all queued before the hub reads
                    tmp = d / f".tmp{i}"
                    tmp.write_text("x")
                    os.rename(tmp, d / f"file-with-a-longer-name-{i}.txt")
                await asyncio.wait_for(all_seen.wait(), 20)
                assert not any(m & IN_CLOSE_WRITE for m in got.values())  # the tmp's, not theirs
                # the directory goes: its subscribers are told, and the watch forgotten
                gone = asyncio.Event()
                hub.subscribe(str(d / "x" / "y"), lambda m: gone.set() if m == RESCAN else None)
                for p in d.iterdir():
                    p.unlink()
                d.rmdir()
                await asyncio.wait_for(gone.wait(), 10)
                assert str(d) not in hub._dirs
            finally:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    asyncio.run(main())
