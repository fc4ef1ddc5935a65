"""The one-shot lane (engine/scheduling.py, `_drain_lane`): a run that ends once
converged runs each due plain eager vertex in one fused step instead of the
general path's layers. It may change how much work a run costs, never what it
does: on random graphs (seeded) of mixed kinds (eager checks that finish
inline or suspend, checks run as tasks), with failures, retries, notify edges
and send/recv, the lane and the general path (`engine.lane = False`) give the
same statuses, exit status, recap, observer events and refresh deliveries,
and the lane is really taken (`engine.lane_runs`)."""

from __future__ import annotations

import asyncio
import itertools
import random
from pathlib import Path
from typing import Any, ClassVar

import pytest

from evergraph.engine import Edge, GraphModel
from evergraph.engine.contract import Meta, Registry, Resource, register
from evergraph.engine.engine import Engine
from tests.kit.engine import run_observed, settings, view

registry = Registry()


class _Base(Resource, kw_only=True, dict=True, forbid_unknown_fields=True):
    #: failures of the first runs, then success
    fail_times: int = 0
    clean: bool = True
    #: received from a sender (send/recv)
    value: str = ""
    sends: ClassVar[dict[str, Any]] = {"out": str}
    #: what every probe did, in order: (name, what) (reset by each run)
    log: ClassVar[list[tuple[str, str]]] = []

    def sent(self) -> dict[str, object]:
        return {"out": f"from-{self.name}"}

    def _run(self) -> bool:
        runs = sum(1 for n, w in _Base.log if n == self.name and w.startswith("run"))
        refresh = self.handle.refresh()
        _Base.log.append((self.name, f"run refresh={refresh} value={self.value}"))
        if runs < self.fail_times:
            raise RuntimeError(f"planned failure {runs + 1}")
        return self.clean and not refresh


@register("inline", registry=registry)
class Inline(_Base, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Eager, and finishes without suspending: what the lane fuses."""

    eager = True

    async def check_apply(self, apply: bool) -> bool:
        return self._run()


@register("suspends", registry=registry)
class Suspends(_Base, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Eager, and suspends once (as a file's write waiting for the disk)."""

    eager = True

    async def check_apply(self, apply: bool) -> bool:
        await asyncio.sleep(0)
        return self._run()


@register("task", registry=registry)
class Task(_Base, kw_only=True, dict=True, forbid_unknown_fields=True):
    """Not eager: each run a task of its own."""

    async def check_apply(self, apply: bool) -> bool:
        await asyncio.sleep(0)
        return self._run()


KINDS = (Inline, Inline, Inline, Suspends, Task)


def random_graph(seed: int, n: int = 80) -> GraphModel:
    """`n` resources of mixed kinds; each may fail a few times (with or without
    retries), change or be clean, or be hidden; edges only forward (a DAG), some notifying,
    some sending a value."""
    rng = random.Random(seed)
    model = GraphModel(name=f"random-{seed}")
    res: list[Resource] = []
    for i in range(n):
        cls = rng.choice(KINDS)
        fails = rng.choice((0, 0, 0, 0, 1, 2))
        if rng.random() < 0.06:
            meta: Meta | None = Meta(hidden=True)  # never applied; takes sent values
        elif fails or rng.random() < 0.1:
            meta = Meta(retry=rng.choice((0, 1, 2)), delay=0)
        else:
            meta = None
        kw: dict[str, Any] = {"fail_times": fails, "clean": rng.random() < 0.7}
        if meta is not None:
            kw["meta"] = meta
        r = cls(name=f"r{i}", **kw)
        res.append(r)
        model.add(r)
    seen: set[tuple[int, int]] = set()
    for b in range(1, n):
        for _ in range(rng.choice((0, 1, 1, 2))):
            a = rng.randrange(b)
            if (a, b) in seen:
                continue
            seen.add((a, b))
            roll = rng.random()
            if roll < 0.15:
                edge = Edge(res[a].ident, res[b].ident, notify=True)
            elif roll < 0.25:
                edge = Edge(res[a].ident, res[b].ident, send="out", recv="value")
            else:
                edge = Edge(res[a].ident, res[b].ident)
            model.connect(edge)
    model.check()
    return model


def run(
    tmp_path: Path,
    model: GraphModel,
    caplog: pytest.LogCaptureFixture,
    *,
    lane: bool,
    observe: bool = True,
    **kw: object,
) -> tuple[dict[str, Any], Engine]:
    _Base.log = []
    out, engine = run_observed(tmp_path, model, caplog, registry, lane=lane, observe=observe, **kw)
    runs: dict[str, list[str]] = {}
    for name, what in _Base.log:
        runs.setdefault(name, []).append(what)
    # each probe's runs, with the refresh it was served and the value it had
    return {**out, "runs": runs, "order": _Base.log}, engine


@pytest.mark.parametrize("seed", range(12))
def test_the_lane_and_the_general_path_agree_on_random_graphs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    general, g_engine = run(tmp_path / "g", random_graph(seed), caplog, lane=False)
    laned, l_engine = run(tmp_path / "l", random_graph(seed), caplog, lane=True)
    assert g_engine.lane_runs == 0
    assert l_engine.lane_runs > 0  # the lane was taken
    for key in ("status", "views", "recap", "events", "runs"):
        assert laned[key] == general[key], key
    # with no task to interleave, even the order of the runs is the same
    if not any(isinstance(r, Suspends | Task) for r in random_graph(seed).resources.values()):
        assert laned["order"] == general["order"]


def test_the_graphs_cover_what_the_lane_hands_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The random graphs do exercise failures, retries, refreshes, sent values and
    vertices held back below a failed parent (else the comparison proves little)."""
    seen: set[str] = set()
    for seed in range(12):
        out, _ = run(tmp_path / str(seed), random_graph(seed), caplog, lane=True)
        for states in out["events"].values():
            seen.update(states)
            if "retrying" in states:
                seen.add("retry")
        for what in (w for runs in out["runs"].values() for w in runs):
            if "refresh=True" in what:
                seen.add("refresh")
            if "value=from-" in what:
                seen.add("received")
        if any(s == "pending" for _, s, *_ in out["views"]):
            seen.add("held back")
        if any(r.meta.hidden for r in random_graph(seed).resources.values()):
            seen.add("hidden")
    assert {
        "clean",
        "changed",
        "failed",
        "retry",
        "refresh",
        "received",
        "held back",
        "hidden",
    } <= seen


def test_a_chain_of_inline_vertices_runs_in_the_lane(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Clean inline vertices each take the lane (counted); with no observer, the
    statuses are the same as the general path's."""
    model = GraphModel(name="chain")
    names = [f"c{i}" for i in range(50)]
    for n in names:
        model.add(Inline(name=n))
    for a, b in itertools.pairwise(names):
        model.connect(Edge(f"inline[{a}]", f"inline[{b}]"))
    model.check()
    out, engine = run(tmp_path / "l", model, caplog, lane=True, observe=False)
    assert engine.lane_runs == 50
    assert out["status"] == 0
    assert [n for n, _ in out["order"]] == names
    general, _ = run(tmp_path / "g", model, caplog, lane=False, observe=False)
    assert out["views"] == general["views"]
    assert out["recap"] == general["recap"] == ["recap: nothing changed or failed, 50 clean"]


@pytest.mark.parametrize(
    ("kw", "lane"),
    [
        ({}, True),  # --converged-exit (converged-timeout 0)
        ({"watch": False, "converged_exit": False}, True),  # --no-watch
        ({"converged_timeout": 1}, False),  # stays a moment after converging
    ],
)
def test_the_lane_is_for_one_shot_runs(tmp_path: Path, kw: dict[str, object], lane: bool) -> None:
    engine = Engine(settings(tmp_path, **kw), registry=registry)
    assert engine.lane is lane


def test_a_noop_run_agrees_too(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    general, _ = run(tmp_path / "g", random_graph(3), caplog, lane=False, noop=True)
    laned, engine = run(tmp_path / "l", random_graph(3), caplog, lane=True, noop=True)
    assert engine.lane_runs > 0
    for key in ("status", "views", "recap", "events", "runs"):
        assert laned[key] == general[key], key


def test_a_hidden_receiver_freed_by_a_lane_parent_takes_its_value_unapplied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hidden vertex sent a value (by `s`, general path) and held back by a parent
    checked in the lane (`p`, the later one) takes the value and is never applied."""

    def model() -> GraphModel:
        m = GraphModel(name="hidden")
        m.add(Inline(name="s", clean=False))  # changed: recorded by the general path
        m.add(Inline(name="a"))
        m.add(Inline(name="p"))
        m.add(Inline(name="h", meta=Meta(hidden=True)))
        m.connect(Edge("inline[s]", "inline[h]", send="out", recv="value"))
        m.connect(Edge("inline[a]", "inline[p]"))  # p runs a batch step after s
        m.connect(Edge("inline[p]", "inline[h]"))
        m.check()
        return m

    laned, engine = run(tmp_path / "l", model(), caplog, lane=True)
    general, _ = run(tmp_path / "g", model(), caplog, lane=False)
    assert engine.lane_runs == 2  # a and p
    assert "h" not in laned["runs"]  # never applied
    for key in ("status", "views", "recap", "events", "runs"):
        assert laned[key] == general[key], key


def test_an_observer_hub_no_one_listens_to_gets_nothing_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """The agent's observer hub with no subscriber builds no status in the lane; one
    subscribed gets every vertex's events as from the general path."""
    from evergraph.agent.observe import ObserverHub

    def go(hub: ObserverHub, lane: bool) -> tuple[list[tuple[object, ...]], Engine]:
        _Base.log = []
        engine = Engine(settings(tmp_path), observer=hub, registry=registry)
        engine.lane = lane
        assert asyncio.run(engine.run(random_graph(5))) == 1
        return sorted(view(s) for s in engine.status()), engine

    quiet = ObserverHub()
    assert not quiet.listening
    views, engine = go(quiet, lane=True)
    assert engine.lane_runs > 0
    general_views, _ = go(ObserverHub(), lane=False)
    assert views == general_views

    heard: dict[bool, list[tuple[str, str]]] = {True: [], False: []}
    for lane in (True, False):
        hub = ObserverHub()
        hub.subscribe(lambda s, lane=lane: heard[lane].append((s.ident, s.state)))
        assert hub.listening
        go(hub, lane)
    assert sorted(heard[True]) == sorted(heard[False])
    assert {"running", "clean", "changed", "failed"} <= {state for _, state in heard[True]}
