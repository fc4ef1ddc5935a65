"""What the in-process engine tests share: their settings, and waiting on a
condition while the engine runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from evergraph.engine.settings import Settings


async def until(cond: Callable[[], bool], timeout: float = 5) -> None:
    """Yield to the engine until `cond` holds (a condition, not a sleep)."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.001)


def settings(tmp_path: Path, **kw: object) -> Settings:
    """An engine's settings for a test: state in `tmp_path`, converged at once."""
    base: dict[str, object] = {
        "state_dir": tmp_path,
        "converged_timeout": 0,
        "converged_exit": True,
        "hostname": "test",
    }
    base.update(kw)
    return Settings(**base)  # type: ignore[arg-type]
