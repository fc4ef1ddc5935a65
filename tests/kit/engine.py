"""What the in-process engine tests share: their settings, and waiting on a
condition while the engine runs."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from evergraph.engine.contract import Registry
from evergraph.engine.engine import Engine
from evergraph.engine.model import GraphModel
from evergraph.engine.settings import Settings
from evergraph.engine.status import VertexStatus


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


def view(s: VertexStatus) -> tuple[object, ...]:
    return (s.ident, s.state, s.error, s.changed_count, s.clean_count, s.fail_count)


def run_observed(
    tmp_path: Path,
    model: GraphModel,
    caplog: pytest.LogCaptureFixture,
    registry: Registry,
    *,
    lane: bool | None = None,
    observe: bool = True,
    express: bool = True,
    **kw: object,
) -> tuple[dict[str, Any], Engine]:
    """Run `model` until it converges (kinds from `registry`; `lane`: force the
    one-shot lane on or off; `express`: off, a first graph decided whole ahead
    runs through the lane as any other; `kw`: settings) and say what it did: its exit
    `status`, each vertex's `views` (state, error, counts), the `recap` lines and
    each vertex's observed `events` (states in order)."""
    events: list[tuple[str, str]] = []
    engine = Engine(
        settings(tmp_path, **kw),
        observer=(lambda s: events.append((s.ident, s.state))) if observe else None,
        registry=registry,
    )
    if lane is not None:
        engine.lane = lane
    engine.express = express
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="evergraph.engine"):
        status = asyncio.run(engine.run(model))
    recap = [
        re.sub(r"\([0-9.]+ m?s\)", "(t)", r.getMessage())
        for r in caplog.records
        if r.getMessage().startswith("recap")
    ]
    per_vertex: dict[str, list[str]] = {}
    for ident, state in events:
        per_vertex.setdefault(ident, []).append(state)
    return {
        "status": status,
        "views": sorted(view(s) for s in engine.status()),
        "recap": recap,
        "events": per_vertex,
    }, engine
