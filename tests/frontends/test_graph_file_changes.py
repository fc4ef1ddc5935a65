"""`frontends.base.file_changes`: a watched graph file is read once its save is
over. The wait restarts at each event (DEBOUNCE), and is short (SETTLE) after
the event that ends a save (closed after writing, renamed into place), so a
save in several steps makes one change, with the final text."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from evergraph.frontends import base
from evergraph.frontends.base import DEBOUNCE, SETTLE, file_changes
from evergraph.watch import InotifyHub

#: the hub of the running `_with_changes`, for a test's own subscription
_HUB: list[InotifyHub] = []


async def _with_changes(path: Path, body: object) -> list[str]:
    """Run `body(next_change)` while file_changes(path) runs; the changes seen."""
    seen: list[str] = []
    async with InotifyHub() as hub:
        _HUB[:] = [hub]
        pump = asyncio.create_task(hub.run())
        it: AsyncIterator[str] = file_changes(hub, path, path.read_text())
        try:

            async def next_change() -> str:
                text = await it.__anext__()
                seen.append(text)
                return text

            await asyncio.wait_for(body(next_change), 10)  # type: ignore[operator]
        finally:
            await it.aclose()  # type: ignore[attr-defined]
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
    return seen


FINAL = "a: 1\nb: 2\nc: 3\nd: 4\ne: 5\nf: 6\n"


def test_a_save_in_steps_is_one_change_with_the_final_text(tmp_path: Path) -> None:
    """Six writes 15 ms apart with the file open, then the close: a wait counted
    from the first event (50 ms) would read the file half written."""
    assert SETTLE < DEBOUNCE
    g = tmp_path / "g.yaml"
    g.write_text("old\n")

    async def body(next_change: object) -> None:
        waiting = asyncio.create_task(next_change())  # type: ignore[operator]
        await asyncio.sleep(0)  # armed and read once: that is the task's first step
        fd = os.open(g, os.O_WRONLY | os.O_TRUNC)
        try:
            for part in ("a: 1\n", "b: 2\n", "c: 3\n", "d: 4\n", "e: 5\n", "f: 6\n"):
                os.write(fd, part.encode())
                await asyncio.sleep(DEBOUNCE * 0.3)  # a slow editor, still writing
        finally:
            os.close(fd)
        assert await waiting == FINAL
        # the next change is the next save, not a leftover step of the first
        tmp = tmp_path / "g.yaml.new"
        tmp.write_text("second\n")
        os.rename(tmp, g)
        assert await next_change() == "second\n"  # type: ignore[operator]

    seen = asyncio.run(_with_changes(g, body))
    assert seen == [FINAL, "second\n"]


def test_the_end_of_a_save_shortens_a_wait_already_begun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save's first event (the truncation) starts the long wait; its close,
    a moment later, must cut it to SETTLE: the file is read then, not when the
    wait begun at the first event is over (here an hour: the deadline is 10 s)."""
    monkeypatch.setattr(base, "DEBOUNCE", 3600.0)
    g = tmp_path / "g.yaml"
    g.write_text("old\n")

    async def body(next_change: object) -> None:
        waiting = asyncio.create_task(next_change())  # type: ignore[operator]
        await asyncio.sleep(0)  # armed and read once
        hub = _HUB[0]
        modified = asyncio.Event()
        unsubscribe = hub.subscribe(str(g), lambda mask: modified.set())
        try:
            fd = os.open(g, os.O_WRONLY | os.O_TRUNC)
            try:
                await modified.wait()  # the truncation was seen: the long wait begins
                for _ in range(5):
                    await asyncio.sleep(0)  # (yields: file_changes enters its wait)
                os.write(fd, b"new\n")
            finally:
                os.close(fd)
            assert await waiting == "new\n"
        finally:
            unsubscribe()

    assert asyncio.run(_with_changes(g, body)) == ["new\n"]
