"""A big swap yields to the event loop while it builds and starts vertices, so the
World lease's keep-alive (a task in the same loop) is not starved by a graph of a
million vertices; vertices not started yet are held back meanwhile."""

from __future__ import annotations

import asyncio
from pathlib import Path

from evergraph.engine.engine import YIELD_EVERY, Engine
from evergraph.engine.model import Edge, GraphModel
from evergraph.engine.settings import Settings
from evergraph.resources.noop import Noop


def test_a_big_swap_lets_other_tasks_run_while_building_and_starting(tmp_path: Path) -> None:
    n = 5 * YIELD_EVERY
    model = GraphModel(name="big")
    for i in range(n):
        model.add(Noop(name=f"n{i}"))
    for i in range(1, n):
        model.connect(Edge(f"noop[n{(i - 1) // 2}]", f"noop[n{i}]"))
    model.check()
    settings = Settings(
        state_dir=tmp_path, hostname="test", converged_timeout=0, converged_exit=True
    )

    async def main() -> tuple[int, list[tuple[int, int, int]]]:
        engine = Engine(settings)
        seen: list[tuple[int, int, int]] = []  # (vertices, held back, clean) per turn
        done = False

        async def ticker() -> None:
            while not done:
                vs = engine.vertices
                seen.append((len(vs), engine._unready, sum(1 for v in vs.values() if v.ok)))
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        try:
            rc = await asyncio.wait_for(engine.run(model), 60)
        finally:
            done = True
            await tick
        return rc, seen

    rc, seen = asyncio.run(main())
    assert rc == 0
    # turns while the vertices were being built...
    assert any(0 < count < n for count, _, _ in seen), seen[:5]
    # ...and while they were being started, the rest held back, none run yet
    assert any(count == n and 0 < held < n and clean == 0 for count, held, clean in seen)


def test_objects_built_with_the_collector_paused_go_to_the_oldest_generation() -> None:
    """Left in the youngest generation, the first collection after a big build walks
    all of them at once with the loop held (420 ms at 300k vertices)."""
    import gc

    from evergraph._util.gc import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        built = [[i] for i in range(50_000)]
    assert gc.isenabled()
    assert gc.get_count()[0] < 1_000
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert all(id(x) in oldest for x in built[::997])


def test_the_agent_prepares_a_big_graph_while_its_loop_turns() -> None:
    """Automatic edges and grouping of a big graph run in a thread: the loop keeps
    serving the World lease's keep-alive meanwhile."""
    from evergraph.agent.run import PREPARE_IN_THREAD, prepare_off_loop

    model = GraphModel(name="big")
    for i in range(PREPARE_IN_THREAD):
        model.add(Noop(name=f"n{i}"))
    model.check()
    settings = Settings(state_dir=Path("/nonexistent"), hostname="test")

    async def main() -> tuple[int, GraphModel]:
        turns = 0
        done = False

        async def ticker() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        start = turns
        try:
            out = await prepare_off_loop(model, settings)
        finally:
            done = True
            await tick
        return turns - start, out

    turns, out = asyncio.run(main())
    assert turns > 1
    assert len(out.resources) == 1  # grouped: it was prepared, not skipped
