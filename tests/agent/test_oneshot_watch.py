"""A run that exits the moment it converges (`--converged-exit`, converged-timeout 0)
sets up no passive watches (a file's inotify subscription) nor poll timers: they
would be thrown away. Kinds with a watch task (kv) keep it and still converge
through it; with a converged-timeout > 0 every watch stays and drift in that
window is repaired."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import evergraph.resources.file  # (registers the file kind)
import evergraph.resources.kv  # noqa: F401  (registers the kv kind)
from evergraph.engine.build import build
from evergraph.engine.contract import Meta, default_registry
from evergraph.engine.engine import Engine
from evergraph.engine.model import GraphModel
from evergraph.engine.settings import Settings
from evergraph.engine.status import VertexStatus
from evergraph.watch import InotifyHub
from evergraph.world.memory import MemoryKV
from tests.kit.probe import Journal, make


def files_model(root: Path, n: int, kv: bool = False) -> GraphModel:
    model = GraphModel(name="g")
    for i in range(n):
        data = {"name": f"f{i}", "path": f"{root}/d/f{i}", "content": f"{i}\n", "mode": "0644"}
        model.add(build(default_registry, "file", data))
    if kv:
        model.add(build(default_registry, "kv", {"name": "k", "value": "v"}))
    model.check()
    return model


async def converge(
    tmp_path: Path, model: GraphModel, timeout: float, world: MemoryKV, drift: Path | None = None
) -> tuple[int, Engine]:
    settings = Settings(
        state_dir=tmp_path / "state",
        hostname="test",
        converged_timeout=timeout,
        converged_exit=True,
    )
    drifted = False

    def observe(s: VertexStatus) -> None:
        nonlocal drifted
        if (
            drift is not None
            and not drifted
            and s.state in ("clean", "changed")
            and s.ident == "file[f0]"
        ):
            drifted = True  # someone edits the file inside the converged-timeout window
            drift.write_text("drift\n")

    async with InotifyHub() as hub:
        pump = asyncio.create_task(hub.run())
        try:
            engine = Engine(settings, observe, watcher=hub, world=world)
            rc = await asyncio.wait_for(engine.run(model), 30)
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
    assert drifted == (drift is not None)
    return rc, engine


def test_a_run_that_exits_at_once_subscribes_nothing_and_still_converges(
    tmp_path: Path,
) -> None:
    world = MemoryKV()
    rc, engine = asyncio.run(converge(tmp_path, files_model(tmp_path, 20, kv=True), 0, world))
    assert rc == 0
    assert engine.one_shot
    assert engine.subscriptions == 0  # no inotify subscription for 20 files
    for i in range(20):
        assert (tmp_path / "d" / f"f{i}").read_text() == f"{i}\n"
    # kv became ready through its watch task, kept in a one-shot run, and converged
    assert asyncio.run(world.get("kv/k")) is not None
    # a re-run: nothing to change, still nothing subscribed
    rc, engine = asyncio.run(converge(tmp_path, files_model(tmp_path, 20), 0, world))
    assert rc == 0
    assert engine.subscriptions == 0
    assert all(s.changed_count == 0 for s in engine.status())


def test_a_converged_timeout_keeps_the_watches_and_repairs_drift_in_the_window(
    tmp_path: Path,
) -> None:
    f0 = tmp_path / "d" / "f0"
    rc, engine = asyncio.run(
        converge(tmp_path, files_model(tmp_path, 5), 1.0, MemoryKV(), drift=f0)
    )
    assert rc == 0
    assert not engine.one_shot
    assert engine.subscriptions == 5
    assert f0.read_text() == "0\n"  # the drift was seen and repaired before the exit
    assert engine.events >= 1


def test_a_poll_vertex_in_a_one_shot_run_runs_once_without_a_timer(tmp_path: Path) -> None:
    j = Journal()
    model = make(j, ["p"], [], p={"meta": Meta(poll=0.01)})

    async def main() -> tuple[int, Engine]:
        settings = Settings(
            state_dir=tmp_path, hostname="test", converged_timeout=0, converged_exit=True
        )
        engine = Engine(settings)
        return await asyncio.wait_for(engine.run(model), 10), engine

    rc, engine = asyncio.run(main())
    assert rc == 0
    assert j.runs("p") == 1
    assert engine.subscriptions == 0
