"""The engine's scheduling rules (SPEC §2.1, §2.4), in-process with probe resources."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from evergraph.engine.contract import Meta
from evergraph.engine.engine import Engine
from evergraph.testing.clock import FakeClock
from tests.kit.engine import settings, until
from tests.kit.probe import Journal, make

T = TypeVar("T")


async def on_fake_clock(clock: FakeClock, coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on `clock`: whenever a timer is armed, move time on to it (the
    deadlines pass at once, in order; no real time is waited for)."""
    task = asyncio.create_task(coro)
    while not task.done():
        await until(lambda: task.done() or clock.waiting() > 0)
        if not task.done():
            await clock.advance_to_next()
    return task.result()


def test_children_never_start_before_parents_succeeded(tmp_path: Path) -> None:
    rng = random.Random(3)
    names = [f"v{i}" for i in range(60)]
    edges = []
    for i in range(1, 60):
        for p in rng.sample(range(i), min(i, 2)):
            edges.append((f"v{p}", f"v{i}"))
    j = Journal()
    model = make(j, names, edges)
    rc = asyncio.run(Engine(settings(tmp_path)).run(model))
    assert rc == 0
    for n in names:
        assert j.runs(n) == 1
    for a, b in edges:
        assert j.stamps(a, "end")[0] <= j.stamps(b, "start")[0], f"{b} started before {a} ended"
        # strict order in the journal too (stamps may tie on a coarse clock)
        ia = j.entries.index((a, "end", j.stamps(a, "end")[0]))
        ib = j.entries.index((b, "start", j.stamps(b, "start")[0]))
        assert ia < ib


def test_independent_vertices_run_concurrently(tmp_path: Path) -> None:
    j = Journal()
    model = make(j, ["a", "b", "after"], [("a", "after"), ("b", "after")])

    async def main() -> int:
        for n in ("a", "b"):
            j.gates[n] = asyncio.Event()
            j.started[n] = asyncio.Event()
        eng = Engine(settings(tmp_path))
        task = asyncio.create_task(eng.run(model))
        # Both are in flight at the same time: each started before either ended.
        await asyncio.wait_for(j.started["a"].wait(), 5)
        await asyncio.wait_for(j.started["b"].wait(), 5)
        assert j.runs("after") == 0
        j.gates["a"].set()
        j.gates["b"].set()
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(main()) == 0
    a0, a1 = j.stamps("a", "start")[0], j.stamps("a", "end")[0]
    b0, b1 = j.stamps("b", "start")[0], j.stamps("b", "end")[0]
    assert a0 <= b1
    assert b0 <= a1
    assert j.stamps("after", "start")[0] >= max(a1, b1)


@pytest.mark.parametrize("eager", [False, True], ids=["task", "eager"])
def test_events_during_a_run_coalesce_into_exactly_one_more(tmp_path: Path, eager: bool) -> None:
    """Also for an eager (inline) kind that suspends after all: a task drives the rest."""
    j = Journal()
    model = make(j, ["x", "child"], [("x", "child")], eager=eager)  # type: ignore[arg-type]

    async def main() -> int:
        j.gates["x"] = asyncio.Event()
        j.started["x"] = asyncio.Event()
        eng = Engine(settings(tmp_path))
        task = asyncio.create_task(eng.run(model))
        await asyncio.wait_for(j.started["x"].wait(), 5)
        for _ in range(50):
            j.handles["x"].event()
        j.gates["x"].set()
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(main()) == 0
    assert j.runs("x") == 2
    # The child waits for x's last run and runs once: its cached clean state
    # answers the second poke.
    assert j.runs("child") == 1
    assert j.stamps("child", "start")[0] >= j.stamps("x", "end")[-1]


def test_failed_parent_holds_descendants_and_exit_is_1(tmp_path: Path) -> None:
    j = Journal()
    model = make(
        j,
        ["bad", "mid", "leaf", "free"],
        [("bad", "mid"), ("mid", "leaf")],
        bad={"fail_times": 99},
    )
    rc = asyncio.run(Engine(settings(tmp_path)).run(model))
    assert rc == 1
    assert j.runs("bad") == 1
    assert j.runs("mid") == 0
    assert j.runs("leaf") == 0
    assert j.runs("free") == 1


def test_retry_then_success_releases_children(tmp_path: Path) -> None:
    clock = FakeClock()
    j = Journal(clock=clock.monotonic)
    model = make(
        j,
        ["flaky", "child"],
        [("flaky", "child")],
        flaky={"fail_times": 2, "meta": Meta(retry=3, delay=50)},
    )
    rc = asyncio.run(on_fake_clock(clock, Engine(settings(tmp_path), clock=clock).run(model)))
    assert rc == 0
    assert j.runs("flaky") == 3
    starts = j.stamps("flaky", "start")
    fails = j.stamps("flaky", "fail")
    # each retry waited the delay after the failure (virtual time: exactly)
    assert starts[1] - fails[0] == pytest.approx(0.05)
    assert starts[2] - fails[1] == pytest.approx(0.05)
    assert j.runs("child") == 1
    assert j.stamps("child", "start")[0] >= j.stamps("flaky", "end")[0]


def test_retries_exhausted_is_permanent(tmp_path: Path) -> None:
    j = Journal()
    model = make(j, ["flaky"], [], flaky={"fail_times": 5, "meta": Meta(retry=2)})
    rc = asyncio.run(Engine(settings(tmp_path)).run(model))
    assert rc == 1
    assert j.runs("flaky") == 3


def test_timeout_cancels_a_hanging_apply(tmp_path: Path) -> None:
    clock = FakeClock()
    j = Journal(clock=clock.monotonic)
    model = make(j, ["hang"], [], hang={"meta": Meta(timeout=0.1)})

    async def main() -> tuple[int, str | None]:
        j.gates["hang"] = asyncio.Event()  # never set
        eng = Engine(settings(tmp_path), clock=clock)
        task = asyncio.create_task(eng.run(model))
        await until(lambda: j.runs("hang") == 1 and clock.waiting() > 0)
        await clock.advance(0.09)
        assert not task.done()  # not before its timeout
        await clock.advance(0.01)
        rc = await asyncio.wait_for(task, 10)
        return rc, eng.vertices["probe[hang]"].last_error

    rc, err = asyncio.run(main())
    assert rc == 1
    assert err is not None
    assert "timed out after 0.1s" in err
    assert j.stamps("hang", "start") == [0.0]


def test_converged_status_file_records_transitions(tmp_path: Path) -> None:
    j = Journal()
    status = tmp_path / "status"
    model = make(j, ["a"], [])
    rc = asyncio.run(Engine(settings(tmp_path, converged_status_file=status)).run(model))
    assert rc == 0
    assert status.read_text().split() == ["false", "true"]


def test_global_sema_bounds_concurrency(tmp_path: Path) -> None:
    j = Journal()
    names = [f"p{i}" for i in range(8)]
    model = make(j, names, [])
    rc = asyncio.run(Engine(settings(tmp_path, sema=2)).run(model))
    assert rc == 0
    # replay the journal: never more than 2 inside check_apply at once
    inside = peak = 0
    for _, what, _ in j.entries:
        inside += 1 if what == "start" else -1
        peak = max(peak, inside)
    assert peak == 2


def test_stop_request_is_graceful(tmp_path: Path) -> None:
    j = Journal()
    model = make(j, ["slow", "never"], [("slow", "never")])

    async def main() -> int:
        j.gates["slow"] = asyncio.Event()
        j.started["slow"] = asyncio.Event()
        eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None))
        task = asyncio.create_task(eng.run(model))
        await asyncio.wait_for(j.started["slow"].wait(), 5)
        eng.request_stop()  # first: let the in-flight apply finish
        await asyncio.sleep(0)
        assert not task.done()
        j.gates["slow"].set()
        return await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert j.stamps("slow", "end"), "the in-flight apply was allowed to finish"
    assert j.runs("never") == 0, "nothing new starts once stopping"


@pytest.mark.parametrize("eager", [False, True], ids=["task", "eager"])
def test_second_stop_request_cancels_in_flight(tmp_path: Path, eager: bool) -> None:
    j = Journal()
    model = make(j, ["stuck"], [], eager=eager)  # type: ignore[arg-type]

    async def main() -> int:
        j.gates["stuck"] = asyncio.Event()  # never set
        j.started["stuck"] = asyncio.Event()
        eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None))
        task = asyncio.create_task(eng.run(model))
        await asyncio.wait_for(j.started["stuck"].wait(), 5)
        eng.request_stop()
        eng.request_stop()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == 1
    assert not j.stamps("stuck", "end")


def test_swap_keeps_unchanged_running_and_releases_held_children(tmp_path: Path) -> None:
    """Removing a failed parent lets its child run; unchanged vertices do not re-run."""
    j = Journal()
    first = make(j, ["bad", "child", "steady"], [("bad", "child")], bad={"fail_times": 99})
    second = make(j, ["child", "steady", "new"], [])
    # identical parameters, so the engine must keep the running vertices
    second.resources["probe[child]"] = first.resources["probe[child]"]
    second.resources["probe[steady]"] = first.resources["probe[steady]"]

    async def main() -> int:
        eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None))
        task = asyncio.create_task(eng.run(first))
        await until(lambda: j.runs("steady") >= 1 and j.runs("bad") >= 1)
        assert j.runs("child") == 0  # held back by the failed parent
        await eng.swap(second)
        await until(lambda: j.runs("new") >= 1 and j.runs("child") >= 1)
        eng.request_stop()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == 0
    assert j.runs("steady") == 1
    assert j.runs("child") == 1
    assert j.runs("new") == 1


def test_meta_noop_checks_without_applying(tmp_path: Path) -> None:
    j = Journal()
    model = make(j, ["n", "a"], [("n", "a")], n={"meta": Meta(noop=True)})
    assert asyncio.run(Engine(settings(tmp_path)).run(model)) == 0
    assert j.stamps("n", "noop")
    assert not j.stamps("a", "noop")
    j2 = Journal()
    model = make(j2, ["x"], [])
    assert asyncio.run(Engine(settings(tmp_path, noop=True)).run(model)) == 3  # would change
    assert j2.stamps("x", "noop"), "global --noop reaches every vertex"


def test_limit_and_burst_bound_apply_starts(tmp_path: Path) -> None:
    clock = FakeClock()
    j = Journal(clock=clock.monotonic)
    model = make(j, ["r"], [], r={"meta": Meta(limit=20, burst=2)})

    async def main() -> int:
        eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None), clock=clock)
        task = asyncio.create_task(eng.run(model))
        await until(lambda: j.runs("r") >= 1)
        for i in range(2, 7):
            j.handles["r"].event()
            # the token bucket makes it wait (a timer) or lets it start at once
            await until(lambda i=i: j.runs("r") >= i or clock.waiting() > 0)  # type: ignore[misc]
            if j.runs("r") < i:
                await clock.advance_to_next()
            await until(lambda i=i: j.runs("r") >= i)  # type: ignore[misc]
        eng.request_stop()
        return await asyncio.wait_for(task, 5)

    asyncio.run(main())
    starts = j.stamps("r", "start")
    assert len(starts) == 6
    # burst 2 starts at once; after that at most 20 per second (virtual time: exactly)
    assert starts[:2] == [0.0, 0.0]
    for k in range(2, 6):
        assert starts[k] - starts[0] >= (k - 1) / 20 - 1e-9, (k, starts[k] - starts[0])


def test_poll_replaces_watch_with_a_timer(tmp_path: Path) -> None:
    clock = FakeClock()
    j = Journal(clock=clock.monotonic)
    model = make(j, ["p"], [], p={"meta": Meta(poll=0.02)})

    async def main() -> int:
        eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None), clock=clock)
        task = asyncio.create_task(eng.run(model))
        await until(lambda: j.runs("p") >= 1 and clock.waiting() > 0)
        await clock.advance(0.019)
        assert j.runs("p") == 1  # the poll timer has not fired yet
        for n in (2, 3):
            await clock.advance_to_next()
            await until(lambda n=n: j.runs("p") >= n)  # type: ignore[misc]
        eng.request_stop()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == 0
    assert j.stamps("p", "start") == pytest.approx([0.0, 0.02, 0.04])


def test_retry_budget_survives_a_swap_unless_reset(tmp_path: Path) -> None:
    for reset, expected in ((False, 2), (True, 3)):
        j = Journal()
        meta = Meta(retry=3, delay=60_000, reset=reset)
        first = make(j, ["f"], [], f={"fail_times": 99, "meta": meta})
        second = make(j, ["f"], [], f={"fail_times": 98, "meta": meta})

        async def main(first=first, second=second, j=j) -> int:  # type: ignore[no-untyped-def]
            eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None))
            task = asyncio.create_task(eng.run(first))
            await until(lambda: j.stamps("f", "fail") != [])
            assert eng.vertices["probe[f]"].retries_left == 2
            await eng.swap(second)  # params changed: a new vertex
            left = eng.vertices["probe[f]"].retries_left
            eng.request_stop()
            await asyncio.wait_for(task, 5)
            return left

        assert asyncio.run(main()) == expected, reset


def test_rewatch_restarts_a_failed_vertex_on_swap(tmp_path: Path) -> None:
    j = Journal()
    model = make(
        j,
        ["w", "plain"],
        [],
        w={"fail_times": 1, "meta": Meta(rewatch=True)},
        plain={"fail_times": 1},
    )

    async def main() -> int:
        eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None))
        task = asyncio.create_task(eng.run(model))
        await until(lambda: j.stamps("w", "fail") != [] and j.stamps("plain", "fail") != [])
        await eng.swap(model)
        await until(lambda: j.stamps("w", "end") != [])
        eng.request_stop()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == 1  # plain stays failed
    assert j.runs("w") == 2
    assert j.runs("plain") == 1


def test_realize_never_runs_before_its_parents_succeeded(tmp_path: Path) -> None:
    j = Journal()
    first = make(
        j,
        ["bad", "r", "other"],
        [("bad", "r"), ("bad", "other")],
        bad={"fail_times": 99},
        r={"meta": Meta(realize=True)},
    )
    second = make(j, [], [])

    async def main() -> int:
        eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None))
        task = asyncio.create_task(eng.run(first))
        await until(lambda: j.stamps("bad", "fail") != [])
        assert j.runs("r") == 0
        await eng.swap(second)
        eng.request_stop()
        return await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert j.runs("r") == 0, "realize: not applied while its parent has never succeeded"
    assert j.runs("other") == 0


def test_hidden_vertex_is_never_applied_but_orders_its_children(tmp_path: Path) -> None:
    j = Journal()
    model = make(j, ["h", "c"], [("h", "c")], h={"meta": Meta(hidden=True)})
    assert asyncio.run(Engine(settings(tmp_path)).run(model)) == 0
    assert j.runs("h") == 0
    assert j.runs("c") == 1


def test_meta_sema_never_more_than_n_overlap(tmp_path: Path) -> None:
    j = Journal()
    names = [f"s{i}" for i in range(9)]
    params = {
        n: {"meta": Meta(sema=["disk:3"] if i % 3 else ["disk:3", "net"])}
        for i, n in enumerate(names)
    }
    model = make(j, names, [], **params)
    assert asyncio.run(Engine(settings(tmp_path)).run(model)) == 0
    inside = peak = 0
    net_inside = net_peak = 0
    for name, what, _ in j.entries:
        d = 1 if what == "start" else -1
        inside += d
        peak = max(peak, inside)
        if int(name[1:]) % 3 == 0:
            net_inside += d
            net_peak = max(net_peak, net_inside)
    assert peak == 3
    assert net_peak == 1


def test_eager_kind_failing_after_suspending_is_retried(tmp_path: Path) -> None:
    j = Journal()
    model = make(
        j,
        ["f"],
        [],
        f={"fail_times": 1, "meta": Meta(retry=1)},
        eager=True,  # type: ignore[arg-type]
    )

    async def main() -> int:
        j.gates["f"] = asyncio.Event()
        j.gates["f"].set()  # suspends once on the (set) gate's wait, then fails
        return await asyncio.wait_for(Engine(settings(tmp_path)).run(model), 10)

    assert asyncio.run(main()) == 0
    assert j.runs("f") == 2


def test_retryreset_gives_a_fresh_budget_after_each_success(tmp_path: Path) -> None:
    for reset, expect_ok in ((True, True), (False, False)):
        j = Journal()
        meta = Meta(retry=1, retryreset=reset)
        # run 1 fails, 2 succeeds; after an event run 3 fails, 4 would succeed
        model = make(j, ["r"], [], r={"fail_runs": [1, 3], "meta": meta})

        async def main(j=j, model=model) -> int:  # type: ignore[no-untyped-def]
            eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None))
            task = asyncio.create_task(eng.run(model))
            await until(lambda: j.stamps("r", "end") != [])
            j.handles["r"].event()
            await until(lambda: len(j.stamps("r", "fail")) == 2)
            await until(lambda: not eng._running and not eng._retrying and not eng._queued)
            eng.request_stop()
            return await asyncio.wait_for(task, 5)

        assert (asyncio.run(main()) == 0) is expect_ok, reset
        assert j.runs("r") == (4 if expect_ok else 3), reset


def test_a_group_holds_the_semaphores_of_all_its_members(tmp_path: Path) -> None:
    from evergraph.engine.prepare import prepare
    from evergraph.resources.noop import Noop

    j = Journal()
    model = make(j, ["p"], [], p={"meta": Meta(sema=["lock"])})
    a = Noop(name="a", meta=Meta(sema=["lock"]))
    b = Noop(name="b", meta=Meta(sema=["other"]))
    model.add(a)
    model.add(b)
    prepare(model)
    assert [m.ident for m in model.resources["noop[a]"].group_members] == ["noop[b]"]

    async def main() -> int:
        j.gates["p"] = asyncio.Event()
        j.started["p"] = asyncio.Event()
        eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None))
        task = asyncio.create_task(eng.run(model))
        await asyncio.wait_for(j.started["p"].wait(), 5)
        # the probe holds "lock": the group (which includes a's "lock") must wait
        for _ in range(20):
            await asyncio.sleep(0)
        assert not eng.vertices["noop[a]"].ok
        j.gates["p"].set()
        await until(lambda: eng.vertices["noop[a]"].ok)
        eng.request_stop()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == 0


def test_a_stop_during_a_swap_still_ends_the_run(tmp_path: Path) -> None:
    """A stop that comes while a new graph is being swapped in (the swap waiting for
    a removed vertex's apply to finish) still ends the run: the swap's wait must not
    swallow the cancellation of the graph-update follower (it did, and the agent
    waited for the next graph forever: a farm worker stopped as its job ended)."""
    j = Journal()
    first = make(j, ["slow", "steady"], [])
    second = make(j, ["steady"], [])
    second.resources["probe[steady]"] = first.resources["probe[steady]"]

    async def main() -> int:
        j.gates["slow"] = asyncio.Event()
        j.started["slow"] = asyncio.Event()
        models: asyncio.Queue[object] = asyncio.Queue()

        async def updates():  # type: ignore[no-untyped-def]
            while True:
                yield await models.get()

        eng = Engine(settings(tmp_path, converged_exit=False, converged_timeout=None))
        task = asyncio.create_task(eng.run(first, updates()))
        await asyncio.wait_for(j.started["slow"].wait(), 5)
        models.put_nowait(second)  # the swap waits for slow's apply to end
        await until(lambda: "probe[slow]" not in eng.vertices)
        eng.request_stop()  # graceful: slow may finish, then the run must end
        j.gates["slow"].set()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == 0
