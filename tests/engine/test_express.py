"""Express (engine/express.py): a one-shot run whose first graph the children ahead
decided whole (every resource found in its state or made by them) ends without
building a vertex. It may change what the run costs, never what it says or does:
on random graphs (seeded) it logs the same lines, recap, converged line and
status file, with the same exit status and the same files made, as the lane
given the same verdicts. A few resources to check (verdicts OTHER) and what is
below them are the lane's, in a graph of their own: the run is the same as the
lane's for the whole graph (the same lines, recap, checks, exit status, files).
It gives way to the lane, whose run is then the same as without it, for anything
else the lane would do more than record a verdict: more resources to check than
a part of the graph, a verdict below a change, a refresh owed, an observer, a
kind that cannot tell, an edge that is more than an order, a stop."""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from evergraph.engine import Edge, GraphModel
from evergraph.engine.contract import Meta, Resource
from evergraph.engine.engine import Engine
from evergraph.engine.store import VertexStore
from tests.engine.test_ahead import (
    Mark,
    Plain,
    Probe,
    ahead_of,
    found_ahead,
    journal,
    registry,
    stuck,
)
from tests.kit.engine import run_observed, settings

#: a duration in a line: not the same from one run to the next
_TIMES = re.compile(r"\([0-9.]+ m?s\)|after [0-9.]+s")


def marks_only(seed: int, root: Path, n: int = 120) -> GraphModel:
    """Marks (a third there already, half written through a Pending), tied by
    orders only, each from an earlier one: every verdict CLEAN or CREATED."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    model = GraphModel(name=f"express-{seed}")
    res: list[Resource] = []
    parents: list[set[int]] = [set() for _ in range(n)]
    for b in range(1, n):
        for _ in range(rng.choice((0, 1, 1, 2))):
            parents[b].add(rng.randrange(b))
    there: set[int] = set()
    for i in range(n):
        path = root / f"m{i}"
        if rng.random() < 0.3 and parents[i] <= there:  # (none there below one made)
            path.touch()
            there.add(i)
        r = Mark(name=f"r{i}", path=str(path), journal=str(root / "journal"), write=i % 2 == 0)
        res.append(r)
        model.add(r)
    for b, ps in enumerate(parents):
        for a in sorted(ps):
            model.connect(Edge(res[a].ident, res[b].ident))
    model.check()
    return model


def run(
    tmp_path: Path, model: GraphModel, caplog: pytest.LogCaptureFixture, **kw: Any
) -> tuple[dict[str, Any], Engine]:
    """The run (`run_observed`, no observer unless asked), and what it logged."""
    Probe.log = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    status_file = tmp_path / "converged"
    kw.setdefault("observe", False)
    out, engine = run_observed(
        tmp_path, model, caplog, registry, converged_status_file=status_file, **kw
    )
    if model.ahead is not None:
        model.ahead.stop()  # (as the run's end does, cli/runner.py)
    lines = [_TIMES.sub("(t)", r.getMessage()) for r in caplog.records]
    return {
        **out,
        "lines": sorted(lines),
        "converged": [line for line in lines if line.startswith(("converged", "graph "))],
        "status file": status_file.read_text(),
        "checks": list(Probe.log),
    }, engine


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("status", "recap", "lines", "converged", "status file", "checks"):
        assert a[key] == b[key], key


@pytest.mark.parametrize("seed", range(6))
def test_a_graph_decided_whole_ahead_ends_as_the_lane_ends_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    runs = {}
    for express in (False, True):
        root = tmp_path / f"m-{express}"
        model = marks_only(seed, root)
        ahead_of(model, whole=seed % 2 == 0, children=1 + seed % 2, journal=root / "made")
        out, engine = run(tmp_path / f"e-{express}", model, caplog, express=express)
        assert (engine.expressed is not None) == express
        assert engine.ahead_made > 0
        runs[express] = (out, engine, journal(root), sorted(p.name for p in root.iterdir()))
    (lane, l_engine, l_made, l_files), (fast, f_engine, f_made, f_files) = runs[False], runs[True]
    same(fast, lane)
    assert fast["status"] == 0
    assert fast["checks"] == []  # (no init, no check: all decided ahead)
    assert sorted(f_made) == sorted(l_made)  # the same made, each once, by the children
    assert {by for _, by in f_made} == {"ahead"}
    assert f_files == l_files
    assert (f_engine.ahead_made, f_engine.ahead_runs) == (l_engine.ahead_made, l_engine.ahead_runs)
    assert f_engine.vertices == {}  # (what it saves)
    assert lane["views"]
    assert not fast["views"]


def test_a_graph_found_whole_in_its_state_ends_with_nothing_changed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = found_ahead("clean", 40)
    model.connect(Edge("probe[p0]", "probe[p1]"))
    model.check()
    ahead_of(model)
    out, engine = run(tmp_path, model, caplog)
    assert engine.expressed is not None
    assert out["recap"] == ["recap: nothing changed or failed, 40 clean"]
    assert out["converged"] == [
        "graph clean loaded: 40 vertices",
        "converged: 40 vertices clean, 0 changed, (t)",
    ]
    assert out["status file"] == "false\ntrue\n"
    assert out["status"] == 0


def to_check(seed: int, root: Path, fails: bool = False) -> GraphModel:
    """`marks_only`, and below marks found there (or below none) a few probes to
    check (OTHER: one drifted, one in its state after all, one failing with
    `fails`), and probes found in their state ahead below those; a mark missing
    that may not be made ahead (meta noop: OTHER too)."""
    model = marks_only(seed, root)
    rng = random.Random(seed)
    there = [r.ident for r in model.resources.values() if Path(getattr(r, "path", "")).exists()]
    j = str(root / "journal")
    model.add(Mark(name="x", path=str(root / "x"), journal=j, meta=Meta(noop=True)))
    checked: list[str] = []
    for k in range(4):
        probe = Probe(name=f"o{k}", clean=k % 2 == 1, fail_times=9 if fails and k == 0 else 0)
        model.add(probe)
        checked.append(probe.ident)
        if there and k < 3:
            model.connect(Edge(rng.choice(there), probe.ident))
    for k in range(6):
        below = Probe(name=f"c{k}", ahead=True)
        model.add(below)
        for up in rng.sample(checked, rng.choice((1, 2))):
            model.connect(Edge(up, below.ident))
        if there and k % 2:
            model.connect(Edge(rng.choice(there), below.ident))
    model.connect(Edge("probe[c0]", "probe[c1]"))
    model.check()
    return model


@pytest.mark.parametrize("seed", range(6))
def test_a_few_to_check_are_the_lanes_and_the_run_ends_as_the_lanes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    """Those checked (OTHER) and everything below them run as the lane runs them,
    alone: a probe below a drifted one checked again, one below a clean one taken
    on its verdict; the rest recorded on the verdicts, with no vertex."""
    fails = seed % 3 == 2
    runs = {}
    for express in (False, True):
        root = tmp_path / f"m-{express}"
        model = to_check(seed, root, fails)
        ahead_of(model, whole=seed % 2 == 0, children=1 + seed % 2, journal=root / "made")
        out, engine = run(tmp_path / f"e-{express}", model, caplog, express=express)
        assert (engine.expressed is not None) == express
        runs[express] = (out, engine, journal(root), sorted(p.name for p in root.iterdir()))
    (lane, l_engine, l_made, l_files), (fast, f_engine, f_made, f_files) = runs[False], runs[True]
    rest = {"mark[x]", *(f"probe[o{k}]" for k in range(4)), *(f"probe[c{k}]" for k in range(6))}
    assert set(f_engine.vertices) == rest  # (no vertex for the others)
    assert len(l_engine.vertices) == len(rest) + 120
    for key in ("status", "recap", "lines", "converged", "status file"):
        assert fast[key] == lane[key], key
    assert fast["status"] == (1 if fails else 0)
    assert sorted(fast["checks"]) == sorted(lane["checks"])  # (the same, in another order)
    checked = {name for name, _ in fast["checks"]}
    assert {"o0", "o1", "o2", "o3"} <= checked
    # a probe below a drifted one (o2, and o0 unless it fails: their checks change
    # them) is checked again; one below a failed one is not run; one below only
    # those found in their state is taken on its verdict
    model = to_check(seed, tmp_path / "again", fails)
    up: dict[str, set[str]] = {}
    for e in model.edges:
        up.setdefault(e.to_id, set()).add(e.from_id)

    def above(ident: str) -> set[str]:
        found, stack = set(), [ident]
        while stack:
            for a in up.get(stack.pop(), ()):
                if a not in found:
                    found.add(a)
                    stack.append(a)
        return found

    changed = {"probe[o2]"} | (set() if fails else {"probe[o0]"})
    for k in range(6):
        ups = above(f"probe[c{k}]")
        again = bool(ups & changed) and not (fails and "probe[o0]" in ups)
        assert (f"c{k}" in checked) == again, k
    assert sorted(f_made) == sorted(l_made)
    assert f_files == l_files
    assert (f_engine.ahead_made, f_engine.ahead_runs) == (l_engine.ahead_made, l_engine.ahead_runs)


def _many_to_check(root: Path) -> GraphModel:
    """More probes to check than a part of the graph (express.REST_PART)."""
    model = marks_only(1, root, n=20)
    for k in range(8):  # (28 resources: at most 7 for the lane)
        model.add(Probe(name=f"o{k}", clean=k % 2 == 0))
    model.check()
    return model


def _above_many(root: Path) -> GraphModel:
    """One probe to check, with more below it than a part of the graph."""
    model = marks_only(6, root, n=20)
    model.add(Probe(name="top", clean=False))
    for k in range(8):
        model.add(Probe(name=f"b{k}", ahead=True))
        model.connect(Edge("probe[top]", f"probe[b{k}]"))
    model.check()
    return model


def _clean_below_made(root: Path) -> GraphModel:
    model = marks_only(2, root, n=20)
    model.add(Probe(name="below", ahead=True))
    model.connect(Edge("mark[r0]", "probe[below]"))
    (root / "m0").unlink(missing_ok=True)  # (r0 is made: "below" is checked again)
    model.check()
    return model


def _cannot_tell(root: Path) -> GraphModel:
    model = marks_only(3, root, n=20)
    model.add(Plain(name="plain"))
    model.check()
    return model


def _notify(root: Path) -> GraphModel:
    model = marks_only(4, root, n=20)
    model.add(Probe(name="told", ahead=True))
    model.connect(Edge("mark[r1]", "probe[told]", notify=True))
    model.check()
    return model


def _hidden_last(root: Path) -> GraphModel:
    # (after many of its kind with another meta: what the lane takes is asked per meta)
    model = marks_only(6, root, n=20)
    model.add(
        Mark(
            name="hid",
            path=str(root / "hid"),
            journal=str(root / "journal"),
            meta=Meta(hidden=True),
        )
    )
    model.check()
    return model


CASES: dict[str, tuple[Callable[[Path], GraphModel], dict[str, Any]]] = {
    "more to check than a part": (_many_to_check, {}),
    "a part below one to check": (_above_many, {}),
    "a clean one below one made": (_clean_below_made, {}),
    "a kind that cannot tell": (_cannot_tell, {}),
    "a notify edge": (_notify, {}),
    "a hidden one, last of its kind": (_hidden_last, {}),
    "an observer": (lambda root: marks_only(5, root, n=20), {"observe": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_express_gives_way_to_the_lane_for_anything_more_than_a_verdict(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    build, kw = CASES[case]
    runs = {}
    for express in (False, True):
        root = tmp_path / f"m-{express}"
        model = build(root)
        ahead_of(model, journal=root / "made")
        out, engine = run(tmp_path / f"e-{express}", model, caplog, express=express, **kw)
        assert engine.expressed is None
        assert engine.vertices  # (the lane ran it)
        runs[express] = (out, journal(root))
    same(runs[True][0], runs[False][0])
    assert runs[True][0]["views"] == runs[False][0]["views"]
    assert runs[True][1] == runs[False][1]


def test_a_refresh_owed_from_an_earlier_run_is_served_by_the_lane(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A notify edge's refresh a killed run owed (in the store) is the lane's: the
    vertex runs, refreshed, although its verdict ahead says it is in its state."""
    model = found_ahead("owed", 10)
    model.check()
    VertexStore(tmp_path / "e").owe_refresh("probe", "p3")
    ahead_of(model)
    out, engine = run(tmp_path / "e", model, caplog)
    assert engine.expressed is None
    assert ("p3", "check refresh=True value=") in out["checks"]
    assert [n for n, _ in out["checks"]] == ["p3", "p3"]  # (its init, its check)


def test_a_stop_while_the_children_work_ends_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop asked while express waits for a child stuck in a check: it gives way,
    the run ends (the child killed by the run's end), nothing recorded as done."""
    model = stuck(tmp_path, monkeypatch)
    ahead_of(model, whole=False)
    engine = Engine(settings(tmp_path / "e"), registry=registry)
    engine.stop.raise_to(1)  # (the first stop: graceful)
    with caplog.at_level(logging.INFO, logger="evergraph.engine"):
        asyncio.run(engine.run(model))
    assert model.ahead is not None
    model.ahead.stop()
    assert engine.expressed is None
    assert list(engine.vertices) == ["stuck[s]"]  # (the lane's run, cut short)
